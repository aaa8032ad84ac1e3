"""Engine batches too large for one Kafka record (unit: no Kafka; producers get a recording double).

Both producer paths (the bridge's RawProducer and the in-process publisher) split a batch whose value
exceeds the record limit into parts under it, in order, with consecutive ``first_index``; an event
too large on its own is dead-lettered with a truncated payload. The parts, read back and joined,
are the batch.
"""
from __future__ import annotations

from dataclasses import replace as dc_replace

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from kvbus.producers.metrics import BridgeMetrics
from kvbus.producers.raw_producer import RawProducer
from kvbus.producers.split import MIN_RECORD_BYTES, RECORD_MARGIN, plan_split, record_limit
from kvbus.runtime.settings import Settings
from kvbus.schemas.codec import FastSerde, encode_event
from kvbus.schemas.events import DLQ_PAYLOAD_BYTES, AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from kvbus.schemas.serde import registry_client
from kvbus.schemas.topics import Topics
from tests.recording_producer import RecordingProducer

REGISTRY = registry_client("mock://split-batches")
BATCHES = FastSerde(REGISTRY, "EventBatch")
DEAD = FastSerde(REGISTRY, "DeadLetter")
TOPICS = Topics(raw="split.raw", blocks="split.blocks", incomplete="split.incomplete", dlq="split.dlq")


def stored(i: int, tokens: int) -> BlockStored:
    return BlockStored(block_hashes=[i.to_bytes(8, "big")], token_ids=[100_000 + i] * tokens, block_size=16,
                       medium="GPU")


def big_batch(sizes: list[int], seq: int = 4, first_index: int = 0) -> EventBatch:
    """A batch whose i-th event is a BlockStored of ``sizes[i]`` tokens (3 bytes each)."""
    return EventBatch(replica="pod-a", seq=seq, ts=12.5, epoch=77, worker_rank=1, workers=2,
                      events=[stored(i, n) for i, n in enumerate(sizes)], first_index=first_index)


def read(values: list[bytes], topic: str = TOPICS.raw) -> list[EventBatch]:
    return [BATCHES.loads(v, topic) for v in values]


def joined(parts: list[EventBatch]) -> list[tuple[int, object]]:
    """(index in the engine batch, event) of every event of the parts, in order."""
    return [(p.first_index + i, e) for p in parts for i, e in enumerate(p.events)]


# -- planning ------------------------------------------------------------------------------

@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.integers(1, 3000), max_size=40), st.integers(MIN_RECORD_BYTES, 5000))
def test_plan_packs_consecutive_events_greedily_and_sets_oversized_apart(sizes, limit):
    fixed = 60
    plan = plan_split(sizes, fixed, limit)
    budget = limit - fixed - 16
    covered = [i for a, b in plan.parts for i in range(a, b)]
    assert sorted(covered + plan.oversized) == list(range(len(sizes)))
    assert covered == sorted(covered)  # in order
    assert plan.oversized == [i for i, s in enumerate(sizes) if s > budget]
    for a, b in plan.parts:
        assert sum(sizes[a:b]) <= budget or not sizes
        # greedy: the next event (if it is not oversized and there is one) did not fit
        if b < len(sizes) and b not in plan.oversized:
            assert sum(sizes[a:b + 1]) > budget


def test_plan_of_a_batch_that_fits_is_one_part():
    assert plan_split([10, 20, 30], 50, 1000).parts == [(0, 3)]
    assert plan_split([], 50, 1000).parts == [(0, 0)]


def test_record_limit_follows_the_producer_configuration():
    assert record_limit(900_000) == 900_000  # librdkafka's default message.max.bytes is 1,000,000
    assert record_limit(900_000, {"message.max.bytes": 500_000}) == 500_000 - RECORD_MARGIN
    assert record_limit(5_000_000, {"message.max.bytes": "10000000"}) == 5_000_000
    with pytest.raises(ValueError):
        record_limit(100)


# -- the bridge's RawProducer ------------------------------------------------------------------

def sink(limit: int) -> tuple[RawProducer, RecordingProducer, BridgeMetrics]:
    producer, metrics = RecordingProducer(), BridgeMetrics()
    s = RawProducer(producer, TOPICS.raw, TOPICS.dlq, lambda b: BATCHES.dumps(b, TOPICS.raw),
                  lambda d: DEAD.dumps(d, TOPICS.dlq), metrics, max_record_bytes=limit)
    return s, producer, metrics


def test_sink_produces_a_batch_that_fits_as_one_record():
    s, producer, metrics = sink(10_000)
    batch = big_batch([100, 200])
    s.produce_batch(batch)
    assert read([v for _, v in producer.on(TOPICS.raw)]) == [batch]
    assert metrics.value("split_batches") == 0


@pytest.mark.parametrize("first_index", [0, 5])
def test_sink_splits_a_large_batch_into_parts_under_the_limit(first_index):
    limit = 4000
    s, producer, metrics = sink(limit)
    batch = big_batch([300, 200, 900, 10, 10, 600, 1000, 50, 0], first_index=first_index)
    assert len(BATCHES.dumps(batch, TOPICS.raw)) > 2 * limit
    s.produce_batch(batch)
    records = producer.on(TOPICS.raw)
    assert len(records) >= 3
    assert all(len(v) <= limit for _, v in records)
    assert {k for k, _ in records} == {b"pod-a#0"}
    parts = read([v for _, v in records])
    assert joined(parts) == [(first_index + i, e) for i, e in enumerate(batch.events)]
    for p in parts:  # every part is the batch's record but for its events
        assert msgspec.structs.replace(p, events=[], first_index=0) == \
            msgspec.structs.replace(batch, events=[], first_index=0)
    assert metrics.value("split_batches") == 1 and metrics.value("split_parts") == len(parts)
    assert metrics.value("batches_out") == len(parts) and metrics.value("events_out") == len(batch.events)
    assert producer.on(TOPICS.dlq) == []


def test_sink_dead_letters_an_event_too_large_for_any_record(caplog):
    limit = 2000
    s, producer, metrics = sink(limit)
    batch = big_batch([100, 30_000, 100, 100])  # event 1 alone is ~90 kB
    with caplog.at_level("ERROR", logger="kvbus.producers.split"):
        s.produce_batch(batch)
    parts = read([v for _, v in producer.on(TOPICS.raw)])
    assert joined(parts) == [(i, e) for i, e in enumerate(batch.events) if i != 1]
    [(key, value)] = producer.on(TOPICS.dlq)
    dl = DEAD.loads(value, TOPICS.dlq)
    avro = encode_event(batch.events[1])
    assert key == b"pod-a#0" and dl.stage == "bridge" and dl.source == "pod-a#0"
    assert dl.payload == [avro[:DLQ_PAYLOAD_BYTES]] and len(avro) > DLQ_PAYLOAD_BYTES
    for word in ("BlockStored", "index 1", "pod-a#0 worker 1 epoch 77 seq 4", f"{len(avro)} bytes", str(limit)):
        assert word in dl.reason
    assert metrics.value("oversized_events") == 1 and metrics.value("dlq") == 1
    assert "pod-a#0 worker 1 epoch 77 seq 4" in caplog.text and f"{len(avro)} bytes" in caplog.text


def test_sink_split_uses_the_configured_serializer():
    """With confluent's serializer (bridge --serializer confluent) the parts are the same bytes."""
    from kvbus.schemas.serde import RecordSerde

    slow = RecordSerde(REGISTRY, "EventBatch")
    fast_sink, fast_producer, _ = sink(3000)
    producer = RecordingProducer()
    slow_sink = RawProducer(producer, TOPICS.raw, TOPICS.dlq, lambda b: slow.dumps(b, TOPICS.raw),
                          lambda d: DEAD.dumps(d, TOPICS.dlq), BridgeMetrics(), max_record_bytes=3000)
    batch = big_batch([400, 400, 400, 400, 400])
    fast_sink.produce_batch(batch)
    slow_sink.produce_batch(batch)
    assert producer.records == fast_producer.records and len(producer.records) > 1


# -- the in-process publisher ------------------------------------------------------------------

class Batch(msgspec.Struct):
    """What vLLM hands a publisher (ts, events)."""

    ts: float
    events: list


@pytest.fixture
def publisher(monkeypatch):
    from kvbus.producers import publisher as module
    from kvbus.producers.publisher import KafkaEventPublisher

    monkeypatch.setattr(module, "registry_client", lambda url: REGISTRY)  # one mock registry for the test
    made = []

    def make(limit: int):
        settings = dc_replace(Settings(), bootstrap="127.0.0.1:1", topics=TOPICS, max_record_bytes=limit,
                              keep_token_ids=True)  # the tokens make the batches this large
        producer = RecordingProducer()
        pub = KafkaEventPublisher(replica="pod-a", settings=settings, schema_id=BATCHES.schema_id(TOPICS.raw),
                                  producer=producer, worker_rank=1, workers=2)
        made.append(pub)
        del producer.records[:]  # the engine-restart marker
        return pub, producer

    yield make
    for pub in made:
        pub.shutdown(timeout=0.1)


def test_publisher_splits_like_the_sink_and_dead_letters_oversized_events(publisher):
    pub, producer = publisher(3000)
    events = [stored(i, n) for i, n in enumerate([100, 400, 20_000, 300, 300, 300, 0])] + \
             [BlockRemoved(block_hashes=[b"x" * 8]), AllBlocksCleared()]
    pub.publish(Batch(ts=3.0, events=[stored(99, 10)]))  # fits: one record
    pub.publish(Batch(ts=4.0, events=events))
    records = producer.on(TOPICS.raw)
    first, parts = read([records[0][1]])[0], read([v for _, v in records[1:]])
    assert (first.seq, first.first_index, len(first.events)) == (0, 0, 1)
    assert len(parts) > 1 and all(len(v) <= 3000 for _, v in records)
    assert {(p.seq, p.epoch, p.engine, p.worker_rank, p.ts) for p in parts} == {(1, pub.epoch, "kvbus", 1, 4.0)}
    assert joined(parts) == [(i, e) for i, e in enumerate(events) if i != 2]
    [(key, value)] = producer.on(TOPICS.dlq)
    dl = DEAD.loads(value, TOPICS.dlq)
    assert (key, dl.stage, dl.source) == (b"pod-a#0", "publisher", "pod-a#0")
    assert "index 2" in dl.reason and "seq 1" in dl.reason
    assert dl.payload == [encode_event(events[2])[:DLQ_PAYLOAD_BYTES]]
    m = pub.metrics
    assert (m.value("split_batches"), m.value("split_parts"), m.value("oversized_events")) == (1, len(parts), 1)


def test_publisher_parts_equal_the_sinks(publisher):
    """One helper, two paths: the same batch gives the same parts either way."""
    pub, producer = publisher(2500)
    batch = big_batch([200, 300, 500, 100, 700, 50, 50])
    pub.publish(Batch(ts=batch.ts, events=batch.events))
    s, sink_producer, _ = sink(2500)
    s.produce_batch(msgspec.structs.replace(batch, replica="pod-a", seq=0, epoch=pub.epoch, engine="kvbus"))
    assert [v for _, v in producer.on(TOPICS.raw)] == [v for _, v in sink_producer.on(TOPICS.raw)]
