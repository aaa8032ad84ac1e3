"""Block topics under an operator's hands, on the real Kafka and registry (and a private Redis): a
block topic deleted and recreated under a running sink leaves the view's stored offsets past the new
log's end; the sink notices and rebuilds the view from the latest snapshot (the recreated
partitions replayed from their start), or with no snapshot from the start. And a topic retaining
less than the snapshot interval: refused at start, naming both settings; doubtful ones warned about."""
from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
import sys
import time
import uuid

import msgspec
import pytest
from confluent_kafka.admin import AdminClient, AlterConfigOpType, ConfigEntry, ConfigResource

from kvbus.infra.scratch_redis import RedisServer
from kvbus.runtime.settings import Settings
from kvbus.schemas.events import BlockEvent
from kvbus.sinks.config import SinkConfig
from kvbus.sinks.consumer import SinkConsumer
from kvbus.sinks.retention import Retention, judge
from kvbus.sinks.snapshot import SnapshotWriter
from kvbus.sinks.view.redis_store import RedisStore
from tests.histories import growing_streams
from tests.memory_store import InMemoryStore
from tests.test_probes import wait_until
from tests.test_sink_consumer import produce


def model_of(records) -> InMemoryStore:
    m = InMemoryStore()
    m.apply(records)
    return m


def later(records, seq_from: int) -> list[tuple[str, BlockEvent]]:
    """``records`` moved on in their holders' positions (the engines went on publishing after the
    topic was recreated): each seq raised by ``seq_from``, its hashes offset so they are new blocks."""
    from kvbus.schemas.events import canonical_hash

    out = []
    for topic, ev in records:
        e = ev.event
        hashes = [canonical_hash(int.from_bytes(h, "big") + 10**9) for h in e.block_hashes]
        out.append((topic, msgspec.structs.replace(ev, seq=ev.seq + seq_from,
                                                   event=msgspec.structs.replace(e, block_hashes=hashes))))
    return out


def recreate(stack: Settings, topic: str, partitions: int, gone_for: float = 0.0) -> None:
    """Delete ``topic`` and create it again empty, waiting until each is done (and ``gone_for``
    seconds between the two)."""
    from kvbus.infra.dev_topics import ensure_topics

    admin = AdminClient({"bootstrap.servers": stack.bootstrap})
    admin.delete_topics([topic], operation_timeout=30)[topic].result(30)
    wait_until(lambda: topic not in admin.list_topics(timeout=10).topics, 60, f"{topic} to be deleted")
    time.sleep(gone_for)
    deadline = time.monotonic() + 60
    while True:  # the broker refuses to create it while the deletion is still being finished
        try:
            ensure_topics(stack.bootstrap, [topic], partitions, 1)
            break
        except Exception:  # noqa: BLE001 - TOPIC_ALREADY_EXISTS / marked for deletion: wait
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
    wait_until(lambda: len(admin.list_topics(topic, timeout=10).topics[topic].partitions) == partitions, 60,
               f"{topic} to be recreated with {partitions} partitions")


def sink_for(stack, topics, store) -> SinkConsumer:
    return SinkConsumer(stack, store, SinkConfig(group=f"g-{uuid.uuid4().hex}", batch=100, stale_after=0,
                                                 poll_timeout=0.2), topics=topics)


def until(sink: SinkConsumer, cond, timeout: float, what: str) -> None:
    """Step ``sink`` until ``cond()``."""
    wait_until(lambda: (sink.step(), cond())[1], timeout, what, interval=0)


@pytest.mark.integration
@pytest.mark.parametrize("snapshot", [False, True], ids=["no-snapshot", "snapshot"])
def test_a_block_topic_recreated_under_a_running_sink_makes_it_rebuild_the_view(stack, sink_topics, snapshot,
                                                                                caplog):
    """Old records (the first part snapshotted when ``snapshot``), the topic deleted and recreated,
    fewer new records on it: the view equals the model of what a rebuild can know, the snapshot's
    records and the new ones (with no snapshot, the new ones alone), not the old view moved on."""
    caplog.set_level(logging.WARNING, "kvbus.sinks")
    old = growing_streams(sink_topics, holders=6, events=60)
    cut = len(old) // 2
    new = later(old[: len(old) // 10], seq_from=10_000)
    with RedisServer() as srv:
        store = RedisStore(srv.client(), "kvbus:")
        sink = sink_for(stack, sink_topics, store)
        try:
            produce(stack, old[:cut])
            until(sink, lambda: store.positions() == model_of(old[:cut]).positions(), 90, "the first old half")
            if snapshot:
                SnapshotWriter(dataclasses.replace(stack, topics=sink_topics), store).take()
            produce(stack, old[cut:])
            until(sink, lambda: store.positions() == model_of(old).positions(), 90, "every old record")
            stored = store.offsets()
            recreate(stack, sink_topics.blocks, 2)
            produce(stack, new)
            known = (old[:cut] if snapshot else []) + new
            want = model_of(known)
            assert want.snapshot() != model_of(old + new).snapshot(), "the test tells a rebuild from moving on"
            rebuilds = sink.metrics.rebuilds._value.get()
            until(sink, lambda: store.status().get("state") == "ready" and store.positions() == want.positions()
                  and sink.metrics.rebuilds._value.get() > rebuilds, 120,
                  f"the view to be rebuilt from {'the snapshot' if snapshot else 'the start'} and ready "
                  f"(stored offsets before: {stored})")
            assert store.snapshot() == want.snapshot() and store.reader().size() == want.size()
            assert sink.metrics.rebuilds._value.get() == rebuilds + 1
            assert sink.metrics.log_replaced._value.get() >= 1
            assert any("the topic was deleted and recreated" in m for m in caplog.messages)
            ends = sink._end_offsets()
            assert {tp: o for tp, o in store.offsets().items() if tp[0] == sink_topics.blocks} == \
                {tp: o for tp, o in ends.items() if tp[0] == sink_topics.blocks and o > 0}
        finally:
            sink.close()


# ------------------------------------------------------------------ retention against the snapshot interval


@pytest.mark.parametrize("ms, by, every, refused, warned", [
    (60_000, -1, 300, True, False),          # a minute against five: refused
    (400_000, -1, 300, False, True),         # under two intervals: warned
    (604_800_000, -1, 300, False, False),    # a week: fine
    (-1, 10**9, 300, False, True),           # forever by time, bounded by size: warned only
    (-1, -1, 300, False, False),             # forever
    (60_000, -1, 0, False, False),           # no snapshots: said at INFO, not warned
])
def test_retention_is_judged_against_the_snapshot_interval(ms, by, every, refused, warned):
    why, notes = judge(Retention("kvbus.blocks", ms, by), every)
    assert (why is not None) == refused, why
    assert any(level >= logging.WARNING for level, _ in notes) == warned, notes
    if why:
        assert "retention.ms=60000" in why and "--snapshot-every / KVBUS_SINK_SNAPSHOT_EVERY=300" in why


@pytest.mark.integration
def test_a_sink_refuses_block_topics_retaining_less_than_its_snapshot_interval(stack, sink_topics):
    admin = AdminClient({"bootstrap.servers": stack.bootstrap})
    tier = sink_topics.for_ownership("kvcr")
    change = ConfigEntry("retention.ms", "60000", incremental_operation=AlterConfigOpType.SET)
    for fut in admin.incremental_alter_configs([ConfigResource(ConfigResource.Type.TOPIC, tier,
                                                               incremental_configs=[change])]).values():
        fut.result(30)
    with RedisServer() as srv:
        env = {**os.environ, **dataclasses.replace(stack, topics=sink_topics, redis_url=srv.url).to_env()}
        out = subprocess.run([sys.executable, "-m", "kvbus", "sink", "--group", f"g-{uuid.uuid4().hex}",
                              "--snapshot-every", "120"], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out
    line = out.stderr.strip().splitlines()[-1]
    assert line.startswith("kvbus sink: ") and "Traceback" not in out.stderr, out.stderr
    assert f"topic {tier} keeps records retention.ms=60000" in line and \
        "--snapshot-every / KVBUS_SINK_SNAPSHOT_EVERY=120" in line, line


# ------------------------------------------------------------------ the worker producing into a recreated topic


@pytest.mark.integration
def test_a_worker_keeps_running_while_its_block_topic_is_deleted_and_recreated(test_settings, tmp_path):
    """A replica publishing all along while the operator deletes the worker's output topic and
    creates it again: records refused meanwhile (``_UNKNOWN_TOPIC``) are produced again once it
    exists, the worker does not crash, and a block stored after the recreation reaches the new topic."""
    import threading
    from typing import Callable

    from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

    from kvbus.schemas.events import BlockStored, EventBatch, canonical_hash
    from kvbus.schemas.serde import RecordSerde, registry_client
    from tests.pipeline import Pipeline, RawProducer, eventually
    from tests.waiting import Waiting

    run, topic = uuid.uuid4().hex[:8], test_settings.topics.packed  # what the worker writes: block layout 2
    pipeline = Pipeline(test_settings, tmp_path)
    raw = RawProducer(test_settings)
    seq, stop = [0], threading.Event()

    def publish(n: int) -> None:
        raw.send(EventBatch(replica="r", worker_rank=0, workers=1, epoch=1, seq=seq[0], ts=time.time(),
                            events=[BlockStored(block_hashes=[canonical_hash(n)], token_ids=[1], block_size=1,
                                                medium="GPU")]))
        seq[0] += 1

    def fleet() -> None:
        while not stop.wait(0.05):
            publish(seq[0] + 1)

    serde = RecordSerde(registry_client(test_settings.registry_url), "BlockEvents", auto_register=False)
    marker = canonical_hash(10**6)

    def stored_on_topic() -> list[bytes]:
        """Every block hash the block topic holds now (up to each partition's end when asked), read
        from its start."""
        c = Consumer({"bootstrap.servers": test_settings.bootstrap, "group.id": f"t-{run}",
                      "enable.auto.commit": False})
        try:
            parts = c.list_topics(topic, timeout=10).topics[topic].partitions
            ends = {p: c.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1] for p in parts}
            left = {p: end for p, end in ends.items() if end > 0}
            c.assign([TopicPartition(topic, p, 0) for p in left])
            hashes: list[bytes] = []
            deadline = time.monotonic() + 30
            while left and time.monotonic() < deadline:
                for m in c.consume(500, timeout=1.0):
                    if m.error() is not None:
                        continue
                    for ev in serde.loads(m.value(), topic).unpacked():
                        hashes += getattr(ev.event, "block_hashes", [])
                    if m.partition() in left and m.offset() + 1 >= left[m.partition()]:
                        del left[m.partition()]
            assert not left, f"partitions of {topic} not read to their end {ends} in 30 s: {sorted(left)}"
            return hashes
        finally:
            c.close()

    #: what the cluster answers while a topic it has just created (or deleted) has no leader everywhere yet
    not_yet = {KafkaError.NOT_LEADER_FOR_PARTITION, KafkaError.LEADER_NOT_AVAILABLE, KafkaError.UNKNOWN_TOPIC_OR_PART}

    def topic_holds(wanted: Callable[[list[bytes]], bool], what: str) -> Callable[[], object]:
        """A check that the block topic's hashes satisfy ``wanted``; while the topic's partitions have
        no leader yet (after its creation), it says so and waits."""
        def check() -> object:
            try:
                hashes = stored_on_topic()
            except KafkaException as e:
                if e.args[0].code() not in not_yet:
                    raise
                return Waiting(kafka=str(e.args[0]))
            return wanted(hashes) or Waiting(stored=len(hashes))
        check.__doc__ = what
        return check

    # librdkafka marks a topic gone at once (not after 30 s), looks at the cluster every second, and
    # does not have the broker create the deleted topic again (auto.create.topics.enable) when the
    # worker produces to it, which would race the deletion
    props = tmp_path / "client.properties"
    props.write_text("topic.metadata.propagation.max.ms=0\ntopic.metadata.refresh.interval.ms=1000\n"
                     "allow.auto.create.topics=false\n")
    pipeline.start("worker", "worker", "--app-id", f"streams-{run}", "--workdir", str(tmp_path),
                   env={"KVBUS_KAFKA_PROPERTIES": str(props)})
    feeder = threading.Thread(target=fleet, daemon=True)
    try:
        feeder.start()
        eventually(topic_holds(lambda h: len(h) >= 5, "five blocks on the topic"), 120, pipeline)
        recreate(test_settings, topic, test_settings.partitions, gone_for=5)  # the worker's producer learns it is gone
        time.sleep(2)  # the replica goes on publishing into the recreated topic
        stop.set()
        feeder.join(10)
        publish(10**6)
        raw.flush()
        eventually(topic_holds(lambda h: marker in h, "the block stored after the recreation on the topic"), 120,
                   pipeline)
        pipeline.check_alive()
    finally:
        stop.set()
        pipeline.stop()
