"""Bad input at scale, sink stage (issue 9, part 4): 10,000 records written straight to the test's
blocks topic, about 40 % good, the rest hostile, fixed seed; the sink loop (``SinkConsumer.step``) runs
in this process against a private Redis.

Designed outcomes, asserted exactly:

* REJECT, dead-lettered with reason ``decode: ...``: garbage bytes, truncated Avro of a good record, a
  wrong magic byte, schema ids the registry does not have, the EventBatch schema's id on the topic;
* REJECT, dead-lettered by ``kvbus.sinks.validate.problem``: a key naming another holder, an empty replica,
  a negative dp_rank, impossible positions (epoch < 0, seq < -1, index < 0), a tier event on the
  framework topic;
* ACCEPT, legitimately: a good event whose position goes backwards is skipped by the stored position
  (redelivery, by design: counted as a duplicate, not dead-lettered) and a good event without a key
  is applied (the key is checked when present);
* the view equals the model (``InMemoryStore``) of exactly the good and accepted records; the loop
  never raised; this process's RSS grows by < 150 MiB.
"""
from __future__ import annotations

import collections
import random
import time
import uuid

import pytest
from confluent_kafka import Producer

from kvbus.infra.scratch_redis import RedisServer
from kvbus.producers.recovery import partition_for
from kvbus.runtime.settings import Settings
from kvbus.schemas.events import DLQ_PAYLOAD_BYTES, BlockEvent, BlockStored, DeadLetter, EventBatch, holder_key
from kvbus.schemas.serde import RecordSerde, registry_client
from kvbus.schemas.topics import Topics
from kvbus.sinks.config import SinkConfig
from kvbus.sinks.consumer import SinkConsumer
from kvbus.sinks.view.redis_store import RedisStore
from tests.hostile import ACCEPT, GOOD, REJECT, TopicReader, good_stored, marker_hash, rss_mib
from tests.memory_store import InMemoryStore

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

SEED = 9_4_3
N = 10_000


@pytest.fixture
def topics(sink_topics):
    return sink_topics


def _inputs(seed: int, n: int, t: Topics, serde: RecordSerde, other_id: int):
    """(kind, case, topic, key, value, event or None) for ``n`` records."""
    rng = random.Random(seed)
    goods = 0
    seqs: dict[str, int] = collections.defaultdict(int)

    def ev(replica: str, seq: int, good: int, **kw) -> BlockEvent:
        kw.setdefault("epoch", 3)
        return BlockEvent(replica=replica, seq=seq, index=0, ts=1.0, event=good_stored(good), **kw)

    for i in range(n):
        replica = f"s{i % 6}"
        key = holder_key(replica, 0).encode()
        r = rng.random()
        if i % 2000 == 1:  # near the record size limit: its dead letter keeps the first 64 KiB
            yield REJECT, "huge garbage", t.blocks, key, rng.randbytes(999_900), None
            continue
        if r < 0.4:
            seqs[replica] += 1
            e = ev(replica, seqs[replica], goods)
            goods += 1
            yield GOOD, "good", t.blocks, key, serde.dumps(e, t.blocks), e
            continue
        good_value = serde.dumps(ev(replica, 10**9, 10**7 + i), t.blocks)
        if r < 0.5:
            yield REJECT, "garbage", t.blocks, key, rng.randbytes(rng.randint(0, 200)), None
        elif r < 0.6:
            yield REJECT, "truncated", t.blocks, key, good_value[:rng.randrange(len(good_value))], None
        elif r < 0.63:
            yield REJECT, "wrong magic", t.blocks, key, bytes([rng.randint(1, 255)]) + good_value[1:], None
        elif r < 0.65:
            bad_id = rng.choice([2**31 - 1, 999_999, 4_000_000_000])
            yield REJECT, "unknown schema id", t.blocks, key, b"\x00" + bad_id.to_bytes(4, "big") + good_value[5:], None
        elif r < 0.67:
            value = b"\x00" + other_id.to_bytes(4, "big") + good_value[5:]
            yield REJECT, "EventBatch schema id", t.blocks, key, value, None
        elif r < 0.85:
            bad = rng.choice([dict(replica=""), dict(dp_rank=-1), dict(epoch=-1), dict(seq=-2), dict(index=-1),
                              dict(key=True), dict(tier=True)])
            fields = dict(replica=replica, seq=10**9 + i, index=0, ts=1.0, epoch=3, event=good_stored(10**7 + i))
            k = None
            if bad.pop("key", False):
                k = holder_key(replica + "x", 0).encode()
            if bad.pop("tier", False):
                fields["event"] = BlockStored(block_hashes=[marker_hash(10**7 + i)], medium="CPU", ownership="kvcr")
            fields.update(bad)
            e = BlockEvent(**fields)
            k = k or holder_key(e.replica, e.dp_rank).encode()
            yield REJECT, "invalid", t.blocks, k, serde.dumps(e, t.blocks), None
        elif r < 0.93:  # a position that goes back: skipped as a redelivery (applied if the holder had none)
            e = ev(replica, rng.randint(-1, 0), goods)
            goods += 1
            yield ACCEPT, "position backwards", t.blocks, key, serde.dumps(e, t.blocks), e
        else:
            seqs[replica] += 1
            e = ev(replica, seqs[replica], goods)
            goods += 1
            yield ACCEPT, "no key", t.blocks, None, serde.dumps(e, t.blocks), e


def test_sink_survives_10000_hostile_records(stack: Settings, topics: Topics):
    import os

    s = stack
    reg = registry_client(s.registry_url)
    serde = RecordSerde(reg, "BlockEvent")
    batch_serde = RecordSerde(reg, "EventBatch")
    other_id = int.from_bytes(batch_serde.dumps(EventBatch(replica="x", seq=0, ts=0.0, events=[]),
                                                "kvbus.raw")[1:5], "big")  # a global id
    kinds: collections.Counter = collections.Counter()
    rejected: collections.Counter = collections.Counter()
    model_records = []
    producer = Producer({"bootstrap.servers": s.bootstrap, "linger.ms": 20, "compression.type": "lz4"})
    for kind, case, topic, key, value, e in _inputs(SEED, N, topics, serde, other_id):
        kinds[kind] += 1
        # keyless records go to their holder's partition too, or the model's order would not be Kafka's
        holder = key if key is not None else holder_key(e.replica, e.dp_rank).encode()
        producer.produce(topic, value, key, partition=partition_for(holder, 2))
        producer.poll(0)
        if kind == REJECT:
            rejected[case] += 1
        elif e is not None:
            model_records.append((topic, e))
    assert producer.flush(60) == 0
    model = InMemoryStore()
    expected = model.apply(model_records)
    n_dead = sum(rejected.values())
    with RedisServer() as redis_server:
        store = RedisStore(redis_server.client(), f"fz{uuid.uuid4().hex[:8]}:")
        sink = SinkConsumer(s, store, SinkConfig(group=f"g-{uuid.uuid4().hex}", batch=500, stale_after=0,
                                               poll_timeout=0.2), topics=topics)
        rss_before = rss_mib(os.getpid())
        t0 = time.monotonic()
        try:
            deadline = time.monotonic() + 120
            while store.positions() != model.positions():
                assert time.monotonic() < deadline, "the sink did not catch up"
                sink.step()  # raises if the loop would crash
            elapsed = time.monotonic() - t0
            rss_after = rss_mib(os.getpid())
            snapshot = store.snapshot()
            m = sink.metrics
            duplicates = m.duplicates._value.get()
        finally:
            sink.close()
    assert snapshot == model.snapshot()
    assert duplicates == expected.skipped > 0
    reader = TopicReader(s.bootstrap, [topics.dlq], lambda v, t: RecordSerde(reg, "DeadLetter").loads(v, t))
    try:
        reader.until(lambda: len(reader.values()) >= n_dead, 60, f"{n_dead} dead letters")
        reader.to_end()
    finally:
        reader.close()
    letters: list[DeadLetter] = reader.values()
    assert len(letters) == n_dead and {d.stage for d in letters} == {"sink"}
    reasons = collections.Counter("decode" if d.reason.startswith("decode:") else "invalid" for d in letters)
    assert reasons == {"decode": n_dead - rejected["invalid"], "invalid": rejected["invalid"]}
    truncated = [d for d in letters if "payload truncated" in d.reason]
    assert len(truncated) == len(range(1, N, 2000)) and all(len(d.payload[0]) == DLQ_PAYLOAD_BYTES for d in truncated)
    assert rss_after - rss_before < 150, (rss_before, rss_after)
    applied = expected.applied
    print(f"\nsink fuzz: sent {N} ({dict(kinds)}), dead-lettered {len(letters)} ({dict(rejected)}), "
          f"applied {applied}, skipped as backwards {duplicates}, crashes 0, "
          f"rss {rss_before:.0f} -> {rss_after:.0f} MiB, {elapsed:.1f} s")
