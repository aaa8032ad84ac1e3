"""The Redis view equals the in-memory model after random histories delivered at least once.

Histories (``tests.histories.random_streams``): several holders, GPU / ref-counted CPU / KV group /
ownership tiers, full-mode re-stores, AllBlocksCleared, engine restarts with Reset markers on every
topic. Delivery (``redeliver``): random interleavings of the per-(holder, topic) streams, random
batches, random rewinds (redelivery), and batches cut short as a sink killed mid-batch would leave them.
"""
from __future__ import annotations

import random
import uuid

import pytest

from kvbus.schemas.topics import Topics
from kvbus.sinks.view.redis_store import RedisStore
from tests.histories import random_streams, redeliver
from tests.memory_store import InMemoryStore

T = Topics(blocks="mb")


def forward_from(snapshot) -> dict:
    out: dict = {}
    for holder, tiers in snapshot.items():
        for tier, blocks in tiers.items():
            for h in blocks:
                out.setdefault(h, set()).add((holder, tier))
    return out


def check_same(rs: RedisStore, model: InMemoryStore) -> None:
    snap = rs.snapshot()
    assert snap == model.snapshot()
    assert rs.block_table() == forward_from(snap), "block table and per-holder index disagree"
    assert rs.positions() == model.positions()
    assert rs.reader().size() == model.size()
    assert rs.models() == model.models()
    names = rs.holder_ids()
    fields = {names[hid]: rs.dump_holder(hid).model for hid in names}
    assert {h: m for h, m in fields.items() if m is not None} == rs.models(), "P mh and the holders' m disagree"


@pytest.mark.parametrize("seed", range(12))
def test_view_equals_model_under_redelivery(redis_server, seed):
    records = random_streams(seed, T, holders=4, batches=160, pool=30, models=("llama", "qwen", None))
    rs = RedisStore(redis_server.client(), f"m{uuid.uuid4().hex[:8]}:")
    same, once = InMemoryStore(), InMemoryStore()
    once.apply(records)  # every event exactly once, canonical order
    for batch in redeliver(records, seed, dup=0.25):
        got, want = rs.apply(batch), same.apply(batch)
        assert (got.applied, got.skipped, got.entries_delta, got.resets, got.clears) == \
               (want.applied, want.skipped, want.entries_delta, want.resets, want.clears)
    check_same(rs, same)
    assert rs.snapshot() == once.snapshot(), "at-least-once delivery, exactly-once effect"
    rng = random.Random(seed)
    hashes = sorted({h for _, ev in records for h in getattr(ev.event, "block_hashes", [])})
    for _ in range(25):
        start = rng.randrange(len(hashes))
        chain = hashes[start:start + rng.randint(1, 8)]
        for name in (None, "llama", "qwen"):
            mine = {k: (v.matched, v.tiers, round(v.score, 6)) for k, v in rs.lookup(chain, model=name).items()}
            model = {k: (v.matched, v.tiers, round(v.score, 6)) for k, v in same.lookup(chain, model=name).items()}
            assert mine == model


@pytest.mark.parametrize("seed", range(3))
def test_wide_blocks_equal_model_under_redelivery(redis_server, seed):
    """Many holders on a small pool of hashes: blocks go wide (> 20 members) and shrink again."""
    records = random_streams(50 + seed, T, holders=14, batches=400, pool=12)
    r = redis_server.client()
    prefix = f"w{uuid.uuid4().hex[:8]}:"
    rs = RedisStore(r, prefix)
    same = InMemoryStore()
    wide_seen = False
    for batch in redeliver(records, seed, dup=0.2):
        got, want = rs.apply(batch), same.apply(batch)
        assert (got.applied, got.skipped, got.entries_delta) == (want.applied, want.skipped, want.entries_delta)
        wide_seen = wide_seen or any(True for _ in r.scan_iter(prefix + "W:*", count=1000))
    assert wide_seen, "some block went wide"
    check_same(rs, same)
    hashes = sorted({h for tiers in same.snapshot().values() for blocks in tiers.values() for h in blocks})
    rng = random.Random(seed)
    for _ in range(40):
        start = rng.randrange(len(hashes))
        chain = [hashes[(start + k) % len(hashes)] for k in range(rng.randint(1, 6))]
        mine = {k: (v.matched, v.tiers, round(v.score, 6)) for k, v in rs.lookup(chain).items()}
        model = {k: (v.matched, v.tiers, round(v.score, 6)) for k, v in same.lookup(chain).items()}
        assert mine == model


@pytest.mark.parametrize("seed", range(4))
def test_batches_cut_short_then_redelivered_leave_the_same_view(redis_server, seed):
    """A sink killed mid-batch has applied some of a batch's FCALLs and committed nothing."""
    records = random_streams(100 + seed, T, holders=6, batches=200, pool=40)
    rs = RedisStore(redis_server.client(), f"k{uuid.uuid4().hex[:8]}:")
    once = InMemoryStore()
    once.apply(records)
    rng = random.Random(seed)
    for batch in redeliver(records, seed, dup=0.0, max_batch=30):
        calls = [args for _, args in rs.packer.plan(batch)]
        if rng.random() < 0.5:
            killed = calls[: rng.randrange(len(calls) + 1)]  # killed after some FCALLs
            rs.transport.run("kvbus_apply", iter(killed), [])
        rs.apply(batch)  # restarted: the whole uncommitted batch comes again
    assert rs.snapshot() == once.snapshot()
    assert rs.block_table() == forward_from(once.snapshot())


def test_large_history_splits_buckets_and_stays_consistent(redis_server):
    records = random_streams(7, T, holders=4, batches=1500, pool=3000, max_chain=120, restart=0.004)
    r = redis_server.client()
    prefix = f"L{uuid.uuid4().hex[:8]}:"
    rs = RedisStore(r, prefix)
    model = InMemoryStore()
    for batch in redeliver(records, 7, dup=0.1, max_batch=40):
        rs.apply(batch)
        model.apply(batch)
    check_same(rs, model)
    meta = r.hgetall(prefix + "meta")
    assert int(meta[b"bL"]) >= 4, "block table split"
    assert any(L >= 1 for _, L, _ in rs._tiers_of(0).values()), "an index split"
    for key in r.scan_iter(prefix + "B:*", count=1000):
        assert r.object("encoding", key) == b"listpack"
    index = list(r.scan_iter(prefix + "I:*", count=1000))
    logged = sum(r.strlen(key) for key in index) // 8
    entries = int(meta[b"entries"])
    assert logged <= 2 * entries + 64 * len(index), f"index garbage: {logged} records for {entries} entries"
