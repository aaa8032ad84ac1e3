"""The sink's Kafka loop against the real Kafka + registry (and a private Redis): the view equals the
model of the produced events, bad records go to the dead-letter topic, and a sink SIGKILLed mid-stream
and restarted leaves the view exactly as if it had never stopped."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import replace

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from kvbus.runtime.settings import Settings
from kvbus.schemas.events import BlockEvent, BlockStored, DeadLetter, canonical_hash, holder_key
from kvbus.schemas.serde import RecordSerde, registry_client
from kvbus.schemas.topics import Topics
from kvbus.sinks.config import SinkConfig
from kvbus.sinks.consumer import SinkConsumer
from kvbus.sinks.view.redis_store import RedisStore
from tests.histories import random_streams
from tests.memory_store import InMemoryStore
from tests.waiting import Waiting, eventually

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def settings(stack) -> Settings:
    """The real stack (started by the session fixture; never skipped)."""
    return stack


@pytest.fixture
def topics(sink_topics) -> Topics:
    return sink_topics


def produce(settings: Settings, records, extra=(), conf: dict | None = None) -> None:
    serde = RecordSerde(registry_client(settings.registry_url), "BlockEvent")
    p = Producer({"bootstrap.servers": settings.bootstrap, "enable.idempotence": True, **(conf or {})})
    for topic, ev in records:
        p.produce(topic, key=holder_key(ev.replica, ev.dp_rank), value=serde.dumps(ev, topic))
    for topic, key, value in extra:
        p.produce(topic, key=key, value=value if isinstance(value, bytes) else serde.dumps(value, topic))
    assert p.flush(30) == 0


def wait_for(cond, timeout: float, what: str, step=None) -> None:
    eventually(cond, timeout, what=what, step=step)


def read_dead_letters(settings: Settings, topic: str, n: int) -> list[DeadLetter]:
    serde = RecordSerde(registry_client(settings.registry_url), "DeadLetter")
    c = Consumer({"bootstrap.servers": settings.bootstrap, "group.id": f"dlq-{uuid.uuid4().hex}",
                  "auto.offset.reset": "earliest"})
    c.subscribe([topic])
    out: list[DeadLetter] = []
    deadline = time.time() + 30
    while len(out) < n and time.time() < deadline:
        for m in c.consume(10, timeout=0.5):
            if not m.error():
                out.append(serde.loads(m.value(), topic))
    c.close()
    return out


def test_sink_applies_events_and_dead_letters_bad_records(settings, topics, redis_server):
    records = random_streams(11, topics, holders=4, batches=150, pool=30)
    good = BlockEvent(replica="x", epoch=1, seq=0, index=0, ts=1.0,
                      event=BlockStored(block_hashes=[canonical_hash(1)], medium="GPU"))
    tier_on_main = BlockEvent(replica="x", epoch=1, seq=1, index=0, ts=1.0,
                              event=BlockStored(block_hashes=[canonical_hash(2)], medium="CPU", ownership="kvcr"))
    produce(settings, records, extra=[(topics.blocks, b"r0#0", b"\x00garbage"),
                                      (topics.blocks, b"y#0", good),
                                      (topics.blocks, b"x#0", tier_on_main)])
    model = InMemoryStore()
    model.apply(records)
    store = RedisStore(redis_server.client(), f"s{uuid.uuid4().hex[:8]}:")
    sink = SinkConsumer(settings, store, SinkConfig(group=f"g-{uuid.uuid4().hex}", batch=50, stale_after=0,
                                                  poll_timeout=0.2), topics=topics)
    try:
        wait_for(lambda: store.positions() == model.positions(), 90, "the sink to catch up", step=sink.step)
    finally:
        sink.close()
    assert store.snapshot() == model.snapshot()
    letters = read_dead_letters(settings, topics.dlq, 3)
    assert len(letters) == 3
    assert {d.stage for d in letters} == {"sink"}
    reasons = " | ".join(sorted(d.reason for d in letters))
    assert "decode" in reasons and "does not name the event's holder" in reasons and "belongs on" in reasons
    assert b"\x00garbage" in [d.payload[0] for d in letters]
    assert sink.metrics.dead_letters.labels("decode")._value.get() == 1
    m = sink.metrics
    assert m.applied._value.get() + m.duplicates._value.get() == len(records)  # skips: old run after a reset


def test_sink_killed_mid_stream_and_restarted_leaves_the_exact_view(settings, topics, redis_server):
    records = random_streams(23, topics, holders=6, batches=1500, pool=60, max_chain=10)
    # The stream is produced in two halves so the kill lands mid-stream however fast the sink is:
    # the first sink is killed once it has applied something of the first half, before the second
    # half exists (it once got through the whole stream before the kill: flaky).
    half = len(records) // 2
    produce(settings, records[:half])
    model = InMemoryStore()
    model.apply(records)
    prefix = f"k{uuid.uuid4().hex[:8]}:"
    store = RedisStore(redis_server.client(), prefix)
    env = dict(os.environ, KVBUS_TOPIC_BLOCKS=topics.blocks, KVBUS_TOPIC_DLQ=topics.dlq,
               KVBUS_REDIS_URL=redis_server.url, KVBUS_BOOTSTRAP=settings.bootstrap,
               KVBUS_REGISTRY_URL=settings.registry_url)
    cmd = [sys.executable, "-m", "kvbus", "sink", "--group", f"g-{uuid.uuid4().hex}", "--prefix", prefix,
           "--batch", "7", "--stale-after", "0"]

    def applied() -> int:
        return sum(p[1] >= 0 for p in store.positions().values())

    first = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: applied() > 0, 60, "the first sink to start applying", step=lambda: time.sleep(0.01))
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(10)
    killed_at = store.positions()
    assert killed_at != model.positions(), "killed before the end of the stream"
    assert sum(p[1] >= 0 for p in killed_at.values()) > 0
    produce(settings, records[half:])
    second = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_for(lambda: store.positions() == model.positions(), 120, "the restarted sink to catch up")
    finally:
        second.send_signal(signal.SIGTERM)
        _, err = second.communicate(timeout=30)
    assert second.returncode == 0, err.decode()[-2000:]
    assert store.snapshot() == model.snapshot()
    assert store.reader().size() == model.size()


def test_sink_picks_up_new_tier_topics_and_expires_silent_replicas(settings, topics, redis_server):
    now = time.time()

    def ev(replica, seq, event, ts):
        return BlockEvent(replica=replica, epoch=1, seq=seq, index=0, ts=ts, event=event)

    # Staleness goes by arrival (the record's Kafka timestamp), not by the engine's clock: "old"
    # arrived 15 min ago with a correct engine clock, "new" arrives now from an engine whose clock
    # is a day behind (it must not be expired while it publishes).
    serde = RecordSerde(registry_client(settings.registry_url), "BlockEvent")
    p = Producer({"bootstrap.servers": settings.bootstrap, "enable.idempotence": True})
    for replica, engine_ts, arrived in (("old", now - 900, now - 900), ("new", now - 86_400, now)):
        event = ev(replica, 0, BlockStored(block_hashes=[canonical_hash(1)], medium="GPU"), engine_ts)
        p.produce(topics.blocks, key=holder_key(replica, 0), value=serde.dumps(event, topics.blocks),
                  timestamp=int(arrived * 1000))
    assert p.flush(30) == 0
    store = RedisStore(redis_server.client(), f"e{uuid.uuid4().hex[:8]}:")
    sink = SinkConsumer(settings, store, SinkConfig(group=f"g-{uuid.uuid4().hex}", batch=50, stale_after=600,
                                                  expire_every=0.0, poll_timeout=0.2),
                        topics=topics, consumer_conf={"topic.metadata.refresh.interval.ms": 1000})
    try:
        # both records are applied (they may sit on different partitions) and only the silent one expired
        def expired_only_the_silent_one() -> bool | Waiting:
            stale, holders = store.reader().stale(), set(store.lookup([canonical_hash(1)]))
            return ("old#0" in stale and holders == {"new"}) or Waiting(stale=sorted(stale), holders=sorted(holders))

        wait_for(expired_only_the_silent_one, 60, "the silent replica expired, the one publishing (engine clock "
                 "a day behind) still holding the block", step=sink.step)
        assert sink.metrics.stale._value.get() == 1 and sink.metrics.expired._value.get() == 1
        late = topics.for_ownership("lmcache")
        admin = AdminClient({"bootstrap.servers": settings.bootstrap})
        for f in admin.create_topics([NewTopic(late, num_partitions=1, replication_factor=1)]).values():
            f.result(30)
        try:
            produce(settings, [(late, ev("new", 1, BlockStored(block_hashes=[canonical_hash(2)], medium="CPU",
                                                               ownership="lmcache"), now - 86_400))])
            wait_for(lambda: store.reader().summary().get("new", {}).get("CPU@lmcache") == 1, 60,
                     "a tier topic created after the sink started", step=sink.step)
        finally:
            admin.delete_topics([late])
    finally:
        sink.close()


def committed_offsets(settings: Settings, group: str, topic: str, partitions: int) -> dict[int, int]:
    """Group ``group``'s committed offset per partition of ``topic`` (negative: none committed)."""
    c = Consumer({"bootstrap.servers": settings.bootstrap, "group.id": group})
    try:
        return {tp.partition: tp.offset
                for tp in c.committed([TopicPartition(topic, p) for p in range(partitions)], timeout=10)}
    finally:
        c.close()


def test_a_sink_resuming_from_the_view_commits_its_positions_with_nothing_new_to_read(settings, topics,
                                                                                     redis_server):
    """The group's committed offsets say what the view holds, even for a sink whose assignment starts
    at the view's offsets and which never reads a record (a monitor would show a lag that is not)."""
    records = random_streams(5, topics, holders=3, batches=40, pool=20)
    produce(settings, records)
    model = InMemoryStore()
    model.apply(records)
    store = RedisStore(redis_server.client(), f"s{uuid.uuid4().hex[:8]}:")
    config = SinkConfig(group=f"g-{uuid.uuid4().hex}", batch=50, stale_after=0, poll_timeout=0.2)
    first = SinkConsumer(settings, store, config, topics=topics)
    try:
        wait_for(lambda: store.positions() == model.positions(), 90, "the first sink to catch up", step=first.step)
    finally:
        first.close()
    view = {p: off for (t, p), off in store.offsets().items() if t == topics.blocks}
    assert view  # the records reached the main block topic
    second = SinkConsumer(settings, store, replace(config, group=f"g-{uuid.uuid4().hex}"), topics=topics)
    parts = settings.partitions
    try:
        def committed() -> bool | Waiting:
            second.step()
            seen = {p: off for p, off in committed_offsets(settings, second.config.group, topics.blocks,
                                                           parts).items() if p in view}
            return seen == view or Waiting(committed=seen, view=view)
        eventually(committed, 60, what="the second sink's group to commit the view's offsets")
    finally:
        second.close()
    assert second.metrics.records._value.get() == 0  # it read nothing: the positions came from the view


def test_the_sink_serves_its_dead_letter_producers_queue_with_no_dead_letter(settings, topics, redis_server):
    """librdkafka queues the dead-letter producer's log lines and errors (at every broker fault) until
    the producer is polled, and with no dead letter nothing else polls it: the sink's loop serves it.
    Here the queued event is a delivery report of a record the test hands the producer."""
    store = RedisStore(redis_server.client(), f"s{uuid.uuid4().hex[:8]}:")
    sink = SinkConsumer(settings, store, SinkConfig(group=f"g-{uuid.uuid4().hex}", batch=50, stale_after=0,
                                                  poll_timeout=0.2), topics=topics)
    reports: list = []
    try:
        sink.producer.produce(topics.dlq, value=b"queued by the test", on_delivery=lambda err, msg: reports.append(err))
        wait_for(lambda: reports, 30, "the sink's loop to serve the dead-letter producer's delivery report",
                 step=sink.step)
    finally:
        sink.close()
    assert reports == [None]
