"""The upgrade from block layout 1 (a BlockEvent record per event on ``<blocks>*``) to layout 2 (a
BlockEvents record per engine batch on ``<blocks>-packed*``), against the real Kafka, registry and Redis.

When the workers switch, a holder's events move from one topic to the other mid-stream, and a worker
produces again in layout 2 what it had not committed in layout 1: the sink must apply every event once,
in order, whichever topic it reads first (sinks/layout_gate.py); a view lost after the switch is rebuilt
from a snapshot taken before it; and a real worker restarted in the other layout (killed mid-stream)
leaves the view equal to what the aggregation rule makes of the raw stream."""
from __future__ import annotations

import dataclasses
import os
import random
import signal
import uuid

import pytest
import redis
from confluent_kafka import Producer

from kvbus.infra.dev_topics import ensure_topics
from kvbus.infra.scratch_redis import RedisServer
from kvbus.schemas.events import (
    BlockEvent,
    BlockRemoved,
    BlockStored,
    EventBatch,
    canonical_hash,
    holder_key,
)
from kvbus.schemas.serde import RecordSerde, registry_client
from kvbus.schemas.topics import Topics
from kvbus.sinks.snapshot import SnapshotWriter
from kvbus.sinks.view.redis_store import RedisStore
from kvbus.streams.aggregation import Aggregator, Output
from kvbus.streams.packing import Packer
from tests.histories import random_streams
from tests.pipeline import Pipeline, RawProducer, Waiting, eventually
from tests.test_sink_consumer import produce, read_dead_letters
from tests.test_view_recovery import catch_up, model_of, sink_for

pytestmark = pytest.mark.integration


@pytest.fixture
def topics(sink_topics: Topics, stack) -> Topics:
    """The sink test's topics, with the packed topics of both tiers made like the layout 1 ones."""
    ensure_topics(stack.bootstrap, [sink_topics.packed, sink_topics.for_ownership("kvcr", packed=True)], 2, 1)
    return sink_topics


def produce_packed(settings, topics: Topics, records, conf: dict | None = None) -> int:
    """``records`` ((layout 1 topic, BlockEvent)) produced as layout 2 records, packed as the worker packs
    them (kvbus.streams.packing), by a producer with ``conf``; returns how many records that made."""
    outputs = [Output(topic, holder_key(ev.replica, ev.dp_rank).encode(), -1, ev, "passthrough")
               for topic, ev in records]
    packed = Packer(topics).pack(outputs)
    serde = RecordSerde(registry_client(settings.registry_url), "BlockEvents")
    p = Producer({"bootstrap.servers": settings.bootstrap, "enable.idempotence": True, **(conf or {})})
    for o in packed:
        p.produce(o.topic, key=o.key, value=serde.dumps(o.value, o.topic))
    assert p.flush(30) == 0
    return len(packed)


def switched(records, at: int, redone: int):
    """The stream as the two layouts carry it when the workers switch at record ``at``: layout 1 up to
    it, layout 2 from ``redone`` records before it (what the workers had not committed, produced again)."""
    return records[:at], records[at - redone:]


ONE_BY_ONE = {"linger.ms": 0, "batch.num.messages": 1}
"""Producer settings that make a record batch of every record."""
SMALL_FETCHES = {"max.partition.fetch.bytes": 1}
"""A sink consumer fetching one record batch per partition at a time: with :data:`ONE_BY_ONE`, each poll
brings records of every partition of both layouts side by side (a packed record before the layout 1
records it follows, unless the sink holds it)."""


def test_a_sink_reads_a_stream_that_moved_to_the_packed_layout_exactly_once(stack, topics):
    # no engine restarts: a Reset would make the final view forget events applied out of order before it
    records = random_streams(61, topics, holders=6, batches=900, pool=50, restart=0.0)
    old, new = switched(records, len(records) // 2, 60)
    produce(stack, old, conf=ONE_BY_ONE)
    n = produce_packed(stack, topics, new, conf=ONE_BY_ONE)
    assert n < len(new), "packed: fewer records than events"
    with RedisServer() as srv:  # both layouts are there before the sink starts: it reads them side by side
        store = RedisStore(srv.client(), "kvbus:")
        sink = sink_for(stack, topics, store, SMALL_FETCHES)
        try:
            catch_up(sink, store, records, "the whole stream across the switch")
            assert store.snapshot() == model_of(records).snapshot()
            assert store.reader().size() == model_of(records).size()
            m = sink.metrics  # every event applied once; the ones produced again in layout 2 skipped
            assert (m.applied._value.get(), m.duplicates._value.get()) == (len(records), 60)
        finally:
            sink.close()


def test_a_view_lost_after_the_switch_is_rebuilt_from_a_snapshot_taken_before_it(stack, topics):
    records = random_streams(67, topics, holders=6, batches=900, pool=50, models=("llama", None), restart=0.0)
    at = len(records) // 2
    old, new = switched(records, at, 40)
    settings = dataclasses.replace(stack, topics=topics)
    with RedisServer() as srv:
        store = RedisStore(srv.client(), "kvbus:")
        sink = sink_for(stack, topics, store, SMALL_FETCHES)
        try:
            produce(stack, old[:at // 2])
            catch_up(sink, store, old[:at // 2], "the first quarter, in layout 1")
            SnapshotWriter(settings, store).take()  # in layout 1: no packed offsets in it
            produce(stack, old[at // 2:], conf=ONE_BY_ONE)
            produce_packed(stack, topics, new, conf=ONE_BY_ONE)
            catch_up(sink, store, records, "the rest, across the switch")
            srv.kill()
            srv.start()  # no persistence: the view is gone
            assert store.reader().size()["entries"] == 0
            catch_up(sink, store, records, "the view rebuilt from the layout 1 snapshot, replayed across the switch")
            assert store.snapshot() == model_of(records).snapshot()
            assert store.models() == model_of(records).models()
            assert sink.metrics.rebuilds._value.get() >= 1
        finally:
            sink.close()


def raw_batches(seed: int, holders: int, batches: int) -> list[EventBatch]:
    """Single-worker engine batches of stores and removes on GPU and on a ``kvcr`` tier."""
    rng = random.Random(seed)
    pool = [canonical_hash(rng.getrandbits(64)) for _ in range(40)]
    seq = [0] * holders
    out = []
    for _ in range(batches):
        h = rng.randrange(holders)
        events = []
        for _ in range(rng.randint(1, 6)):
            tier = "kvcr" if rng.random() < 0.2 else None
            chain = rng.sample(pool, rng.randint(1, 4))
            events.append(BlockStored(block_hashes=chain, block_size=16, medium="CPU" if tier else "GPU",
                                      ownership=tier) if rng.random() < 0.6 else
                          BlockRemoved(block_hashes=chain[:1], medium="CPU" if tier else "GPU", ownership=tier))
        out.append(EventBatch(replica=f"up-{h}", seq=seq[h], ts=1.7e9 + len(out), events=events, epoch=9_000 + h))
        seq[h] += 1
    return out


def expected_view(batches: list[EventBatch], topics: Topics):
    """What the aggregation rule makes of ``batches``, applied to the model of the view."""
    agg, out = Aggregator(topics, 5.0), []
    for b in batches:
        agg.apply(b, 0, 0.0, out)
    return model_of([(o.topic, o.value) for o in out])


def test_a_worker_restarted_in_the_packed_layout_mid_stream_leaves_the_exact_view(test_settings, tmp_path):
    """A real worker writes layout 1, is killed (SIGKILL: what it had not committed is produced again)
    and started again in layout 2, while a real sink applies both."""
    settings = test_settings
    topics = settings.topics
    batches = raw_batches(71, holders=8, batches=600)
    third = len(batches) // 3
    raw = RawProducer(settings)
    pipeline = Pipeline(settings, tmp_path)
    prefix = f"u{uuid.uuid4().hex[:8]}:"
    store = RedisStore(redis.Redis.from_url(settings.redis_url), prefix)
    worker = ("worker", "--app-id", f"up-{uuid.uuid4().hex[:8]}", "--workdir", str(tmp_path))
    try:
        pipeline.start("sink", "sink", "--group", f"s-{uuid.uuid4().hex[:8]}", "--prefix", prefix,
                       "--stale-after", "0")
        first = pipeline.children.start("worker-1", *worker, "--block-layout", "events")
        for b in batches[:third]:
            raw.send(b)
        raw.flush()
        third_applied = expected_view(batches[:third], topics).positions()
        eventually(lambda: store.positions() == third_applied or Waiting(holders=len(store.positions())), 120, pipeline)
        for b in batches[third:2 * third]:
            raw.send(b)
        raw.flush()
        os.killpg(first.proc.pid, signal.SIGKILL)  # mid-stream: its last outputs may be in Kafka, its offsets not
        first.proc.wait()
        pipeline.children.started.remove(first)  # killed on purpose: not a process that died
        pipeline.start("worker-2", *worker)  # the default: packed
        for b in batches[2 * third:]:
            raw.send(b)
        raw.flush()
        want = expected_view(batches, topics)
        eventually(lambda: store.positions() == want.positions() or Waiting(
            behind={h: p for h, p in want.positions().items() if store.positions().get(h) != p}), 180, pipeline)
        assert store.snapshot() == want.snapshot()
        assert store.reader().size() == want.size()
    finally:
        pipeline.stop()


def test_a_bad_event_of_a_packed_record_is_dead_lettered_alone(stack, topics):
    """One event of a BlockEvents record that cannot be applied (a tier's event on the framework topic)
    goes to the dead-letter topic on its own, its index in the source; the record's other events apply."""
    def ev(index: int, event) -> BlockEvent:
        return BlockEvent(replica="bad", epoch=3, seq=0, index=index, ts=1.0, event=event)

    good = [ev(0, BlockStored(block_hashes=[canonical_hash(1)], medium="GPU")),
            ev(2, BlockRemoved(block_hashes=[canonical_hash(1)], medium="GPU"))]
    stray = ev(1, BlockStored(block_hashes=[canonical_hash(2)], medium="CPU", ownership="kvcr"))
    assert produce_packed(stack, topics, [(topics.blocks, e) for e in (good[0], stray, good[1])]) == 1
    with RedisServer() as srv:
        store = RedisStore(srv.client(), "kvbus:")
        sink = sink_for(stack, topics, store)
        try:
            catch_up(sink, store, [(topics.blocks, e) for e in good], "the record's good events")
            (letter,) = read_dead_letters(stack, topics.dlq, 1)
            assert letter.source.startswith(f"{topics.packed}[") and letter.source.endswith("]@0#1")
            assert "ownership 'kvcr'" in letter.reason and letter.stage == "sink"
            assert sink.metrics.dead_letters.labels("invalid")._value.get() == 1
            assert store.snapshot() == model_of([(topics.blocks, e) for e in good]).snapshot()
        finally:
            sink.close()
