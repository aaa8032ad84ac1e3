"""Bad input at scale, Faust worker stage (issue 9, part 4): 10,000 records written straight to the
test's raw topic, about 40 % good, the rest hostile, fixed seed. One worker process.

Designed outcomes, asserted exactly:

* REJECT, dead-lettered (reason ``decode: ...``): garbage bytes, truncated Avro of a good record,
  a wrong magic byte, schema ids the registry does not have, the BlockEvent schema's id on the raw
  topic, a ~1 MB garbage value;
* REJECT, dead-lettered (reason ``invariant: ...``): worker_rank >= workers, workers 0, negative
  dp_rank / epoch / first_index, seq < -1, empty replica or one with NUL, a key naming another holder;
* ACCEPT, legitimately: a good batch whose position goes backwards (``workers == 1`` passes through
  without dedup by design, aggregation.py rule 8; the sink drops it by position) and a good batch
  without a key (the key is checked when present);
* the blocks topic holds exactly the good events, once each (each carries its own hash); the worker
  is alive at the end; its RSS grows by < 150 MiB.

Found and fixed here (``streams/runtime.py``): the DeadLetter of a ~1 MB raw value was larger than
the output producer's ``message.max.bytes``; ``produce`` raised, the batch failed and the worker
crashed (and would again on every replay). Its payload is now cut to its first 64 KiB.
"""
from __future__ import annotations

import collections
import random
import time
import uuid
from pathlib import Path

import pytest
from confluent_kafka import Producer

from kvbus.runtime.settings import Settings
from kvbus.schemas.events import BlockEvent, DeadLetter, EventBatch, holder_key
from kvbus.schemas.serde import RecordSerde, registry_client
from tests.hostile import ACCEPT, GOOD, REJECT, TopicReader, good_stored, marker_hash, rss_mib
from tests.test_streams_integration import Workers, worker_env

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

SEED = 9_4
N = 10_000


def _inputs(seed: int, n: int, raw: str, serde: RecordSerde, other_id: int):
    """(kind, case, key, value, good number or None) for ``n`` records."""
    rng = random.Random(seed)
    goods = 0
    seqs: dict[str, int] = collections.defaultdict(int)

    def batch(replica: str, seq: int, good: int, **kw) -> EventBatch:
        return EventBatch(replica=replica, seq=seq, ts=1.7e9 + seq, events=[good_stored(good)], epoch=7, **kw)

    for i in range(n):
        replica = f"w{i % 8}"
        key = holder_key(replica, 0).encode()
        r = rng.random()
        if r < 0.4:
            seqs[replica] += 1
            yield GOOD, "good", key, serde.dumps(batch(replica, seqs[replica], goods), raw), goods
            goods += 1
            continue
        good_value = serde.dumps(batch(replica, 10**9 + i, 10**7 + i), raw)
        if r < 0.5:
            yield REJECT, "garbage", key, rng.randbytes(rng.randint(0, 200)), None
        elif r < 0.6:
            yield REJECT, "truncated", key, good_value[:rng.randrange(len(good_value))], None
        elif r < 0.63:
            yield REJECT, "wrong magic", key, bytes([rng.randint(1, 255)]) + good_value[1:], None
        elif r < 0.65:
            bad_id = rng.choice([2**31 - 1, 999_999, 4_000_000_000])
            yield REJECT, "unknown schema id", key, b"\x00" + bad_id.to_bytes(4, "big") + good_value[5:], None
        elif r < 0.67:
            yield REJECT, "BlockEvent schema id", key, b"\x00" + other_id.to_bytes(4, "big") + good_value[5:], None
        elif r < 0.83:
            bad = rng.choice([
                dict(worker_rank=2, workers=2), dict(worker_rank=0, workers=0), dict(dp_rank=-1),
                dict(epoch=-5), dict(seq=-2), dict(first_index=-1), dict(replica=""), dict(replica="a\x00b"),
                dict(workers=70_000), dict(worker_rank=-1),
            ])
            fields = dict(replica=replica, seq=10**9 + i, ts=1.0, events=[good_stored(10**7 + i)], epoch=7)
            fields.update(bad)
            b = EventBatch(**fields)
            k = holder_key(b.replica, b.dp_rank).encode()
            yield REJECT, "invariant " + ",".join(bad), k, serde.dumps(b, raw), None
        elif r < 0.9:
            yield REJECT, "key of another holder", holder_key(replica + "x", 0).encode(), good_value, None
        elif r < 0.95:  # a position that goes back (epoch 7, seq far below the holder's last)
            yield ACCEPT, "position backwards", key, serde.dumps(batch(replica, rng.randint(-1, 0), goods), raw), goods
            goods += 1
        else:
            seqs[replica] += 1
            yield ACCEPT, "no key", None, serde.dumps(batch(replica, seqs[replica], goods), raw), goods
            goods += 1
    yield REJECT, "1 MB garbage", holder_key("w0", 0).encode(), b"\x00" + bytes(1_000_000), None


def test_worker_survives_10000_hostile_records(test_settings: Settings, tmp_path: Path):
    s = test_settings
    t = s.topics
    reg = registry_client(s.registry_url)
    serde = RecordSerde(reg, "EventBatch")
    block_serde = RecordSerde(reg, "BlockEvent")
    other_id = int.from_bytes(block_serde.dumps(BlockEvent(replica="x", epoch=0, seq=0, index=0, ts=0.0,
                                                           event=good_stored(0)), t.blocks)[1:5], "big")
    workers = Workers(tmp_path)
    app_id = f"fuzz-{uuid.uuid4().hex[:8]}"
    proc = workers.start("w1", worker_env(s, app_id, tmp_path / "w1", 5.0))
    dl_serde = RecordSerde(reg, "DeadLetter")
    packed_serde = RecordSerde(reg, "BlockEvents")
    reader = TopicReader(s.bootstrap, [t.packed, t.dlq],  # the worker's block layout 2: events unpacked
                         lambda v, topic: dl_serde.loads(v, topic) if topic == t.dlq
                         else packed_serde.loads(v, topic).unpacked())

    def block_events() -> list[BlockEvent]:
        return [e for record in reader.values(t.packed) for e in record]

    def alive() -> str | None:
        return None if proc.poll() is None else f"worker exited {proc.returncode}:\n{workers.log('w1')[-4000:]}"

    producer = Producer({"bootstrap.servers": s.bootstrap, "linger.ms": 20, "message.max.bytes": 1_040_000,
                         "compression.type": "lz4"})
    try:
        # warm up: one good record through, so the RSS baseline is a running worker
        warm = EventBatch(replica="warm", seq=0, ts=1.0, events=[good_stored(999_999)], epoch=1)
        producer.produce(t.raw, serde.dumps(warm, t.raw), holder_key("warm", 0).encode())
        assert producer.flush(30) == 0
        reader.until(lambda: len(block_events()) >= 1, 120, "the warm-up record", alive)
        rss_before = rss_mib(proc.pid)
        t0 = time.monotonic()
        kinds: collections.Counter = collections.Counter()
        good: collections.Counter = collections.Counter()
        rejected: collections.Counter = collections.Counter()
        for kind, case, key, value, g in _inputs(SEED, N, t.raw, serde, other_id):
            kinds[kind] += 1
            producer.produce(t.raw, value, key)
            producer.poll(0)
            if kind == REJECT:
                rejected[case.split(" ")[0] if case.startswith("invariant") else case] += 1
            if g is not None:
                good[marker_hash(g)] += 1
        assert producer.flush(60) == 0
        n_dead = sum(rejected.values())
        reader.until(lambda: len(reader.values(t.dlq)) >= n_dead and len(block_events()) >= 1 + len(good),
                     150, f"{n_dead} dead letters and {len(good)} good events", alive)
        elapsed = time.monotonic() - t0
        rss_after = rss_mib(proc.pid)
        assert alive() is None
        reader.to_end()
    finally:
        reader.close()
        workers.stop_all()
    letters: list[DeadLetter] = reader.values(t.dlq)
    assert len(letters) == n_dead
    reasons = collections.Counter(d.reason.split(":")[0] for d in letters)
    invariant = ("invariant", "key of another holder")
    assert reasons == {"decode": sum(v for k, v in rejected.items() if k not in invariant),
                       "invariant": sum(rejected[k] for k in invariant)}
    assert {d.stage for d in letters} == {"streams"}
    big = [d for d in letters if "payload truncated" in d.reason]
    assert len(big) == 1 and len(big[0].payload[0]) == 64 * 1024  # the 1 MB value, cut (the fix)
    blocks = block_events()
    got = collections.Counter(h for b in blocks for h in b.event.block_hashes if h != marker_hash(999_999))
    assert got == good
    assert rss_after - rss_before < 150, (rss_before, rss_after)
    print(f"\nworker fuzz: sent {N + 1} ({dict(kinds)}), dead-lettered {len(letters)} {dict(reasons)} "
          f"({dict(rejected)}), good events out {sum(good.values())}, crashes 0, "
          f"rss {rss_before:.0f} -> {rss_after:.0f} MiB, {elapsed:.1f} s")
