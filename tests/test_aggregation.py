"""Unit tests of kvbus.streams.aggregation (pure: no Kafka, no Faust).

The reference is vLLM's KVEventAggregator rule written out directly: per engine step, a
``Counter`` of events hashed the way vLLM's ``__hash__`` does; an event is real when its count
equals the number of workers. The streaming aggregator must emit exactly those events, in the
engine's order, at rank 0's position, whatever order the workers' reports arrive in.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from kvbus.schemas.events import (
    AllBlocksCleared,
    BlockEvent,
    BlockRemoved,
    BlockStored,
    EventBatch,
    Incomplete,
    Reset,
    canonical_hash,
)
from kvbus.schemas.topics import Topics
from kvbus.streams.aggregation import AFTER_BATCH, Aggregator, Output, check, identity, load

TOPICS = Topics(raw="raw", blocks="blocks", incomplete="incomplete", dlq="dlq")
WINDOW = 5.0
REPLICA = "r1"


# -- vLLM's rule, written out -------------------------------------------------

@dataclass(frozen=True, eq=False)
class VllmKey:
    """An event hashed and compared as vLLM's KVCacheEvent ``__hash__`` does (lora_name excluded)."""

    event: object

    def _fields(self) -> tuple:
        e = self.event
        if isinstance(e, BlockStored):
            return ("S", tuple(e.block_hashes), e.parent_block_hash, tuple(e.token_ids), e.block_size,
                    e.lora_id, e.medium, e.extra_keys, e.group_idx, e.kv_cache_spec_kind,
                    e.kv_cache_spec_sliding_window, e.locality, e.ownership, e.session_id,
                    _tup(e.lookahead_token_ids), e.cache_salt, _tup(e.token_id_pairs),
                    _tup(e.block_digests), e.parent_block_digest)
        if isinstance(e, BlockRemoved):
            return ("R", tuple(e.block_hashes), e.medium, e.group_idx, e.locality, e.ownership,
                    _tup(e.block_digests))
        return (type(e).__name__,)

    def __hash__(self) -> int:
        return hash(self._fields())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, VllmKey) and self._fields() == other._fields()


def _tup(x):
    if isinstance(x, list):
        return tuple(_tup(v) for v in x)
    return x


def vllm_common(per_rank: list[list[object]], workers: int) -> list[object]:
    """KVEventAggregator.get_common_events for one step: events whose count equals workers."""
    counter: Counter = Counter()
    for events in per_rank:
        counter.update(VllmKey(e) for e in events)
    return [e for e in per_rank[0] if counter[VllmKey(e)] == workers]


# -- trace building -----------------------------------------------------------

def stored(n: int, **kw) -> BlockStored:
    kw.setdefault("medium", "GPU")
    return BlockStored(block_hashes=[canonical_hash(n)], parent_block_hash=canonical_hash(n + 10**6),
                       token_ids=list(range(n % 7, n % 7 + 4)), block_size=4, **kw)


def removed(n: int, **kw) -> BlockRemoved:
    kw.setdefault("medium", "GPU")
    return BlockRemoved(block_hashes=[canonical_hash(n)], **kw)


def batch(rank: int, workers: int, seq: int, events: list, epoch: int | None = None,
          replica: str = REPLICA, dp_rank: int = 0) -> EventBatch:
    return EventBatch(replica=replica, dp_rank=dp_rank, seq=seq, ts=1000.0 + seq,
                      events=events, worker_rank=rank, workers=workers,
                      epoch=epoch if epoch is not None else 100 + rank)


def run(agg: Aggregator, batches: list[EventBatch], now: float = 0.0, partition: int = 0) -> list[Output]:
    out: list[Output] = []
    for b in batches:
        agg.apply(b, partition, now, out)
    return out


def blocks(out: list[Output]) -> list[BlockEvent]:
    return [o.value for o in out if isinstance(o.value, BlockEvent)]


def incompletes(out: list[Output]) -> list[Incomplete]:
    return [o.value for o in out if isinstance(o.value, Incomplete)]


def split(b: EventBatch, cuts: list[int]) -> list[EventBatch]:
    """``b`` as the parts a producer makes of it, cut before each index in ``cuts``."""
    bounds = [0, *sorted(set(c for c in cuts if 0 < c < len(b.events))), len(b.events)]
    return [msgspec.structs.replace(b, events=b.events[lo:hi], first_index=b.first_index + lo)
            for lo, hi in zip(bounds, bounds[1:])]


@st.composite
def traces(draw, max_workers: int = 4, split_batches: bool | None = False):
    """Steps of unique events; each rank drops some; batches per rank in seq order.

    ``split_batches``: each rank's batches are cut into parts at random points (as the producers
    split a batch too large for one record; each rank's bridge splits its own way); None: drawn."""
    if split_batches is None:
        split_batches = draw(st.booleans())
    workers = draw(st.integers(2, max_workers))
    n_steps = draw(st.integers(1, 6))
    counter = 0
    steps = []
    for _ in range(n_steps):
        k = draw(st.integers(1, 4))
        evs = []
        for _ in range(k):
            counter += 1
            kind = draw(st.sampled_from(["stored", "removed", "tier"]))
            if kind == "stored":
                evs.append(stored(counter))
            elif kind == "removed":
                evs.append(removed(counter))
            else:
                evs.append(stored(counter, ownership="kvcr", medium="CPU"))
        steps.append(evs)
    drop = draw(st.lists(st.booleans(), min_size=workers * counter, max_size=workers * counter))
    lora = draw(st.booleans())
    per_rank_steps: list[list[list]] = []
    for r in range(workers):
        rs = []
        for s, evs in enumerate(steps):
            kept = []
            for e in evs:
                idx = int.from_bytes(e.block_hashes[0], "big") - 1
                if not drop[r * counter + idx] or draw(st.integers(0, 3)) > 0:
                    # lora_name is not part of the identity: vary it per rank
                    if lora and isinstance(e, BlockStored):
                        e = msgspec.structs.replace(e, lora_name=f"adapter-of-rank-{r}")
                    kept.append(e)
            rs.append(kept)
        per_rank_steps.append(rs)
    # each rank publishes a batch per step in which it has events; its own seq counter
    streams: list[list[tuple[int, EventBatch]]] = []
    for r in range(workers):
        seq = 0
        lst = []
        for s, kept in enumerate(per_rank_steps[r]):
            if kept:
                lst.append((s, batch(r, workers, seq, kept)))
                seq += 1
        streams.append(lst)
    records: list[list[EventBatch]] = []
    for r in range(workers):
        recs = []
        for _, b in streams[r]:
            cuts = draw(st.lists(st.integers(1, 3), max_size=3)) if split_batches else []
            recs.extend(split(b, cuts))
        records.append(recs)
    # random interleaving that keeps each rank's order, with redeliveries sprinkled in
    order = []
    cursors = [0] * workers
    delivered: list[EventBatch] = []
    while any(cursors[r] < len(records[r]) for r in range(workers)):
        live = [r for r in range(workers) if cursors[r] < len(records[r])]
        r = draw(st.sampled_from(live))
        order.append(records[r][cursors[r]])
        delivered.append(records[r][cursors[r]])
        cursors[r] += 1
        if draw(st.integers(0, 5)) == 0:
            order.append(draw(st.sampled_from(delivered)))  # redelivery of an earlier batch
    return workers, steps, per_rank_steps, streams, order


def expected_from_reference(workers, steps, per_rank_steps, streams):
    """(consolidated [(position, event)], incomplete {(first-report key, reported ranks)})."""
    rank0 = {s: b for s, b in streams[0]}
    consolidated = []
    incomplete = set()
    for s in range(len(steps)):
        per_rank = [per_rank_steps[r][s] for r in range(workers)]
        common = vllm_common(per_rank, workers) if per_rank[0] else []
        common_keys = {VllmKey(e) for e in common}
        for e in common:
            b = rank0[s]
            idx = next(i for i, x in enumerate(b.events) if VllmKey(x) == VllmKey(e))
            consolidated.append(((b.epoch, b.seq, idx), e))
        for e in steps[s]:
            if VllmKey(e) in common_keys:
                continue
            reported = tuple(r for r in range(workers) if any(VllmKey(x) == VllmKey(e) for x in per_rank[r]))
            if reported:
                incomplete.add((VllmKey(e), reported))
    return consolidated, incomplete


# -- properties ---------------------------------------------------------------

@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(traces(), traces(split_batches=True)))
def test_matches_vllm_counter_in_any_interleaving(trace):
    """Whole batches, or batches split into parts (each rank its own way, parts of different ranks
    interleaved, parts redelivered): the same consolidated events at the same positions."""
    workers, steps, per_rank_steps, streams, order = trace
    agg = Aggregator(TOPICS, window=WINDOW)
    out = run(agg, order, now=0.0)
    consolidated, incomplete = expected_from_reference(workers, steps, per_rank_steps, streams)

    got = blocks(out)
    assert [(b.position, VllmKey(b.event)) for b in got] == [(p, VllmKey(e)) for p, e in consolidated]
    # the event emitted is rank 0's report, lora_name included
    assert [b.event for b in got] == [e for _, e in consolidated]
    positions = [b.position for b in got]
    assert positions == sorted(set(positions)), "positions must strictly grow"
    for o in out:
        ev = o.value.event
        assert o.topic == TOPICS.for_ownership(ev.ownership)
        assert o.key == b"r1#0"
    assert not incompletes(out), "nothing expires inside the window"

    # nothing completes by waiting; then the window closes
    late: list[Output] = []
    agg.expire(WINDOW - 0.01, late)
    assert late == []
    agg.expire(WINDOW + 0.01, late)
    assert {(VllmKey(i.event), tuple(i.reported)) for i in incompletes(late)} == incomplete
    for i in incompletes(late):
        assert i.missing == [r for r in range(workers) if r not in i.reported]
    assert agg.pending_count() == 0


def test_worker_that_never_reports_expires_with_missing_rank():
    agg = Aggregator(TOPICS, window=WINDOW)
    out: list[Output] = []
    agg.apply(batch(0, 3, 0, [stored(1), stored(2)]), 0, 10.0, out)
    agg.apply(batch(2, 3, 0, [stored(1), stored(2)]), 0, 11.0, out)
    assert out == [] and agg.pending_count() == 2
    agg.expire(14.99, out)
    assert out == []
    agg.expire(15.0, out)
    assert [(i.reported, i.missing, i.event) for i in incompletes(out)] == [
        ([0, 2], [1], stored(1)), ([0, 2], [1], stored(2))]
    assert out[0].topic == "incomplete" and out[0].kind == "incomplete"
    assert (out[0].value.epoch, out[0].value.seq, out[0].value.index) == (100, 0, 0)
    assert agg.stats.incomplete == 2 and agg.pending_count() == 0


def test_report_after_expiry_starts_a_new_aggregate():
    agg = Aggregator(TOPICS, window=WINDOW)
    out: list[Output] = []
    agg.apply(batch(0, 2, 0, [stored(1)]), 0, 0.0, out)
    agg.expire(6.0, out)
    agg.apply(batch(1, 2, 0, [stored(1)]), 0, 7.0, out)
    assert [o.kind for o in out] == ["incomplete"]
    assert agg.pending_count() == 1
    agg.expire(13.0, out)
    assert incompletes(out)[-1].reported == [1]


def test_emitted_the_moment_last_worker_reports():
    agg = Aggregator(TOPICS, window=WINDOW)
    out: list[Output] = []
    agg.apply(batch(1, 2, 0, [stored(1)]), 0, 0.0, out)
    assert out == []
    agg.apply(batch(0, 2, 7, [removed(9), stored(1)], epoch=555), 0, 0.1, out)
    assert [(b.position, b.event) for b in blocks(out)] == [((555, 7, 1), stored(1))]
    assert out[0].kind == "consolidated"


def test_same_worker_twice_counts_once_unlike_a_plain_counter():
    """vLLM's Counter would reach 2 with two reports of worker 0 and keep the event."""
    ev = stored(1)
    assert vllm_common([[ev, ev], []], 2) == [ev, ev]  # the Counter flaw
    agg = Aggregator(TOPICS, window=WINDOW)
    first = batch(0, 2, 0, [ev])
    out = run(agg, [first, first, first])  # redelivered
    assert out == [] and agg.stats.duplicates == 2
    # a second, later report of the same event by rank 0 is another occurrence, not a vote
    out = run(agg, [batch(0, 2, 1, [ev])])
    assert out == [] and agg.pending_count() == 2
    out = run(agg, [batch(1, 2, 0, [ev])])
    assert [b.position for b in blocks(out)] == [(100, 0, 0)]
    out = run(agg, [batch(1, 2, 1, [ev])])
    assert [b.position for b in blocks(out)] == [(100, 1, 0)]


def test_repeated_identity_pairs_kth_with_kth():
    """Store, remove, store the same block: every occurrence is consolidated at its own position."""
    agg = Aggregator(TOPICS, window=WINDOW)
    r0 = [batch(0, 2, 0, [stored(1)]), batch(0, 2, 1, [removed(1)]), batch(0, 2, 2, [stored(1)])]
    r1 = [batch(1, 2, 0, [stored(1)]), batch(1, 2, 1, [removed(1)]), batch(1, 2, 2, [stored(1)])]
    out = run(agg, r0 + r1)
    assert [(b.position, type(b.event).__name__) for b in blocks(out)] == [
        ((100, 0, 0), "BlockStored"), ((100, 1, 0), "BlockRemoved"), ((100, 2, 0), "BlockStored")]


def test_identity_is_vllm_hash():
    base = stored(1, lora_id=3, lora_name="a")
    assert identity(base) == identity(msgspec.structs.replace(base, lora_name="b"))
    assert identity(base) == identity(msgspec.structs.replace(base, lora_name=None))
    for change in [dict(token_ids=[9]), dict(block_size=8), dict(lora_id=4), dict(medium="CPU"),
                   dict(extra_keys=b"\x90"), dict(group_idx=1), dict(kv_cache_spec_kind="mamba"),
                   dict(kv_cache_spec_sliding_window=128), dict(locality="LOCAL"),
                   dict(ownership="kvcr"), dict(parent_block_hash=None), dict(session_id="s"),
                   dict(lookahead_token_ids=[[1]])]:
        assert identity(base) != identity(msgspec.structs.replace(base, **change)), change
    rem = removed(1)
    for change in [dict(medium="CPU"), dict(group_idx=1), dict(locality="REMOTE"), dict(ownership="kvcr")]:
        assert identity(rem) != identity(msgspec.structs.replace(rem, **change)), change
    assert identity(base, 2) != identity(base, 4)


def test_reports_with_different_worker_counts_do_not_combine():
    agg = Aggregator(TOPICS, window=WINDOW)
    out = run(agg, [batch(0, 2, 0, [stored(1)]), batch(1, 4, 0, [stored(1)])])
    assert out == [] and agg.pending_count() == 2


def test_single_worker_passes_through():
    agg = Aggregator(TOPICS, window=WINDOW)
    evs = [stored(1), stored(2, ownership="kvcr"), removed(1), AllBlocksCleared(), Reset(reason="gap-unrecoverable")]
    out = run(agg, [batch(0, 1, 3, evs, epoch=9)], partition=2)
    assert [(o.topic, o.kind, o.value.position) for o in out] == [
        ("blocks", "passthrough", (9, 3, 0)),
        ("blocks.kvcr", "passthrough", (9, 3, 1)),
        ("blocks", "passthrough", (9, 3, 2)),
        ("blocks", "passthrough", (9, 3, 3)),
        ("blocks", "reset", (9, 3, 4)),
        ("blocks.kvcr", "reset", (9, 3, 4)),
    ]
    assert all(o.partition == 2 for o in out)
    assert agg.pending_count() == 0
    assert agg.holders["r1#0"].meta.tiers == ["kvcr"]  # only tier bookkeeping, no aggregation state


def test_ownership_routing_and_reset_fan_out():
    agg = Aggregator(TOPICS, window=WINDOW)
    t1 = stored(1, ownership="kvcr", medium="CPU")
    t2 = removed(2, ownership="lm/cache")
    evs = [stored(3), t1, t2, AllBlocksCleared()]
    out = run(agg, [batch(0, 2, 0, evs), batch(1, 2, 0, evs)])
    assert [(o.topic, type(o.value.event).__name__) for o in out] == [
        ("blocks", "BlockStored"), ("blocks.kvcr", "BlockStored"), ("blocks.lm_cache", "BlockRemoved"),
        ("blocks", "AllBlocksCleared")]
    out = run(agg, [batch(0, 2, -1, [Reset(reason="engine-restart")], epoch=200)], now=1.0)
    assert sorted(o.topic for o in out) == ["blocks", "blocks.kvcr", "blocks.lm_cache"]
    assert {o.value.position for o in out} == {(200, -1, 0)}


def test_all_blocks_cleared_expires_pre_clear_partials_keeps_post_clear_reports():
    agg = Aggregator(TOPICS, window=WINDOW)
    # rank 0: S1, Clear, S2 ; rank 1 lost S1 and is slower
    out = run(agg, [batch(0, 2, 0, [stored(1)]), batch(0, 2, 1, [AllBlocksCleared()]),
                    batch(0, 2, 2, [stored(2)]), batch(1, 2, 0, [AllBlocksCleared()])])
    assert [(o.kind, o.topic, type(o.value.event).__name__) for o in out] == [
        ("consolidated", "blocks", "AllBlocksCleared"), ("cleared", "incomplete", "BlockStored")]
    assert incompletes(out)[0].missing == [1]
    out = run(agg, [batch(1, 2, 1, [stored(2)])])
    assert [(b.position, b.event) for b in blocks(out)] == [((100, 2, 0), stored(2))]


def test_reset_engine_restart_any_order_one_marker_between_runs():
    """Both workers restart: old run, Reset, new run per rank, merged in every order."""
    old = [stored(1), stored(2)]
    new = [stored(3), removed(1)]
    r0 = [batch(0, 2, 0, old, epoch=100), batch(0, 2, -1, [Reset(reason="engine-restart")], epoch=300),
          batch(0, 2, 0, new, epoch=300)]
    r1 = [batch(1, 2, 0, old, epoch=101), batch(1, 2, -1, [Reset(reason="engine-restart")], epoch=301),
          batch(1, 2, 0, new, epoch=301)]
    import itertools
    for picks in set(itertools.permutations([0, 0, 0, 1, 1, 1])):
        agg = Aggregator(TOPICS, window=WINDOW)
        it = [iter(r0), iter(r1)]
        out = run(agg, [next(it[p]) for p in picks], now=0.0)
        kinds = [(o.kind, o.value.position) for o in out]
        resets = [k for k in kinds if k[0] == "reset"]
        assert len(resets) == 1, (picks, kinds)
        # the new run is complete and after the marker
        after = kinds[kinds.index(resets[0]) + 1:]
        assert [k for k in after if k[0] == "consolidated"] == [
            ("consolidated", (300, 0, 0)), ("consolidated", (300, 0, 1))], (picks, kinds)
        assert all(k[0] == "consolidated" for k in kinds[:kinds.index(resets[0])])
        positions = [p for _, p in kinds]
        assert positions == sorted(set(positions))
        assert agg.pending_count() == 0


def test_reset_of_one_worker_forwards_marker_after_rank0_last_batch():
    agg = Aggregator(TOPICS, window=WINDOW)
    out = run(agg, [batch(0, 2, 4, [stored(1)]), batch(1, 2, 7, [stored(1)]),
                    batch(0, 2, 5, [stored(2)])])
    assert [b.position for b in blocks(out)] == [(100, 4, 0)]
    # rank 1's bridge lost batches: its Reset (new epoch of rank 1) drops the partial S2
    out = run(agg, [batch(1, 2, -1, [Reset(reason="gap-unrecoverable", missing_from=8, missing_to=9)], epoch=900)],
              now=1.0)
    assert [(o.kind, o.value.position) for o in out] == [("reset", (100, 5, AFTER_BATCH))]
    assert agg.pending_count() == 0 and agg.stats.dropped_by_reset == 1
    out = run(agg, [batch(0, 2, 6, [stored(4)]), batch(1, 2, 0, [stored(4)], epoch=900)], now=1.5)
    assert [b.position for b in blocks(out)] == [(100, 6, 0)]
    # much later, a second incident from rank 0 is forwarded again
    out = run(agg, [batch(0, 2, -1, [Reset(reason="engine-restart")], epoch=1000)], now=100.0)
    assert [(o.kind, o.value.position) for o in out] == [("reset", (1000, -1, 0))]


def test_disordered_completion_is_not_emitted_backwards():
    agg = Aggregator(TOPICS, window=WINDOW)
    out = run(agg, [batch(0, 2, 0, [stored(1), stored(2)]), batch(1, 2, 0, [stored(2), stored(1)])])
    assert [(o.kind, o.value.seq if o.kind == "consolidated" else None) for o in out] == [
        ("consolidated", 0), ("disordered", None)]
    assert agg.stats.disordered == 1


@pytest.mark.parametrize("bad,reason", [
    (dict(workers=0, worker_rank=0), "workers"),
    (dict(workers=2, worker_rank=2), "worker_rank"),
    (dict(workers=2, worker_rank=-1), "worker_rank"),
    (dict(dp_rank=-1), "dp_rank"),
    (dict(seq=-2), "seq"),
    (dict(replica=""), "replica"),
    (dict(first_index=-1), "first_index"),
])
def test_invariants(bad, reason):
    b = msgspec.structs.replace(batch(0, 1, 0, [stored(1)]), **bad)
    assert reason in check(b)
    assert check(batch(0, 2, 0, [stored(1)]), b"r1#0") is None
    assert "key" in check(batch(0, 2, 0, [stored(1)]), b"other#0")


# -- split batches (one engine batch as several raw records) -----------------

def test_split_batch_from_two_workers_equals_the_unsplit_batch():
    """Each worker's bridge split the same engine batch its own way; the parts interleave with
    the other worker's, some arrive twice: the outputs are those of the two whole batches."""
    evs = [stored(1), removed(2), stored(3, ownership="kvcr", medium="CPU"), stored(4), AllBlocksCleared(),
           stored(5), removed(1)]
    before, after = batch(0, 2, 2, [stored(9)]), batch(0, 2, 4, [removed(9)])
    before1, after1 = batch(1, 2, 2, [stored(9)]), batch(1, 2, 4, [removed(9)])
    whole0, whole1 = batch(0, 2, 3, evs), batch(1, 2, 3, evs)
    unsplit = run(Aggregator(TOPICS, window=WINDOW), [before, before1, whole0, whole1, after, after1])

    p0 = split(whole0, [2, 3, 6])  # [0,2) [2,3) [3,6) [6,7)
    p1 = split(whole1, [4])  # [0,4) [4,7)
    order = [before, p0[0], before1, p1[0], p0[1], p0[0], p0[2], p1[1], p1[0], p0[3], p0[3], after, after1]
    agg = Aggregator(TOPICS, window=WINDOW)
    out = run(agg, order)
    assert [(o.topic, o.kind, o.value.position, o.value.event) for o in out] == \
           [(o.topic, o.kind, o.value.position, o.value.event) for o in unsplit]
    assert [b.position for b in blocks(out)][:8] == [(100, 2, 0)] + [(100, 3, i) for i in range(7)]
    assert agg.stats.duplicates == len(p0[0].events) + len(p0[3].events) + len(p1[0].events)
    assert agg.pending_count() == 0 and agg.holders["r1#0"].meta.hwm == {0: (100, 4, 1), 1: (101, 4, 1)}


def test_single_worker_parts_pass_through_at_their_batch_positions():
    evs = [stored(1), stored(2), removed(1)]
    out = run(Aggregator(TOPICS, window=WINDOW), split(batch(0, 1, 6, evs, epoch=9), [1]))
    assert [(o.value.position, o.value.event) for o in out] == [((9, 6, i), e) for i, e in enumerate(evs)]


def test_part_overlapping_what_was_applied_skips_exactly_the_overlap():
    """A restarted producer may cut the same batch elsewhere: only the new events count."""
    evs = [stored(i) for i in range(1, 7)]
    agg = Aggregator(TOPICS, window=WINDOW)
    run(agg, split(batch(1, 2, 0, evs), [3])[:1])  # rank 1 applied events 0..2
    run(agg, split(batch(1, 2, 0, evs), [2]))  # re-cut: [0,2) again, then [2,6) of which 2 was applied
    assert agg.stats.duplicates == 3 and agg.stats.reports == 6
    out = run(agg, [batch(0, 2, 0, evs)])
    assert [b.position for b in blocks(out)] == [(100, 0, i) for i in range(6)]


def test_high_water_marks_written_before_split_batches_still_drop_redeliveries():
    """A state in the changelog from before first_index holds (epoch, seq) per rank: the whole batch."""
    from kvbus.streams.aggregation import HolderMeta, encode_meta, meta_key

    legacy = encode_meta(HolderMeta(REPLICA, 0, 0, {0: (100, 3), 1: (101, 3)}))  # the old layout's bytes
    agg = Aggregator(TOPICS, window=WINDOW, holders=load([(meta_key("r1#0"), legacy)]))
    out = run(agg, [batch(0, 2, 3, [stored(1)]), batch(1, 2, 3, [stored(1)])])  # redelivered
    assert out == [] and agg.stats.duplicates == 2
    out = run(agg, [batch(0, 2, 4, [stored(2)]), batch(1, 2, 4, [stored(2)])])
    assert [b.position for b in blocks(out)] == [(100, 4, 0)]
    assert agg.holders["r1#0"].meta.hwm == {0: (100, 4, 1), 1: (101, 4, 1)}


def test_reset_of_another_worker_between_two_parts_of_rank0_batch():
    """Rank 1 resets while rank 0's batch is half delivered: the Reset goes after rank 0's batch
    (as if it had been one record) and the late parts' reports, which the Reset would have dropped
    pending, do not pair with rank 1's new run."""
    agg = Aggregator(TOPICS, window=WINDOW)
    p0 = split(batch(0, 2, 5, [stored(1), stored(2), stored(3)]), [1])
    out = run(agg, [batch(1, 2, 5, [stored(1)]), p0[0]])
    assert [b.position for b in blocks(out)] == [(100, 5, 0)]
    out = run(agg, [batch(1, 2, -1, [Reset(reason="engine-restart")], epoch=900)], now=1.0)
    assert [(o.kind, o.value.position) for o in out] == [("reset", (100, 5, AFTER_BATCH))]
    # rank 1's new run reports S2 again; rank 0's late part (old run) must not complete it
    out = run(agg, [batch(1, 2, 0, [stored(2)], epoch=900), p0[1]], now=1.1)
    assert out == [] and agg.stats.dropped_by_reset == 2
    out = run(agg, [batch(0, 2, 6, [stored(2)])], now=1.2)  # rank 0's own later report pairs with it
    assert [(o.kind, o.value.position) for o in out] == [("consolidated", (100, 6, 0))]


# -- durable state: a crash between commit and the next flush ----------------

@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(traces(max_workers=3, split_batches=None), st.data())
def test_restart_from_store_loses_nothing_and_keeps_positions(trace, data):
    """The store holds every flush up to record k; offsets were committed at c <= k. A new
    process loads the store and replays from c: together with what was delivered before the
    crash, it produces exactly the uninterrupted outputs (duplicates carry the same position)."""
    workers, steps, per_rank_steps, streams, order = trace
    reference = run(Aggregator(TOPICS, window=WINDOW), order)

    k = data.draw(st.integers(0, len(order)))
    c = data.draw(st.integers(0, k))
    store: dict[bytes, bytes] = {}
    agg = Aggregator(TOPICS, window=WINDOW)
    delivered: list[Output] = []
    for b in order[:k]:
        out: list[Output] = []
        agg.apply(b, 0, 0.0, out)
        delivered += out  # outputs are delivered before the state is written
        for _, key, value in agg.flush():
            if value is None:
                store.pop(key, None)
            else:
                store[key] = value
    # optionally, the flush of record k+1 was cut after a prefix (meta is written last)
    if k < len(order) and data.draw(st.booleans()):
        out = []
        agg.apply(order[k], 0, 0.0, out)
        delivered += out
        items = list(agg.flush())
        for _, key, value in items[: data.draw(st.integers(0, max(0, len(items) - 1)))]:
            if value is None:
                store.pop(key, None)
            else:
                store[key] = value

    restarted = Aggregator(TOPICS, window=WINDOW, holders=load(store.items(), {0}))
    replayed = run(restarted, order[c:])

    def sig(o: Output):
        return (o.topic, o.value.position, VllmKey(o.value.event))

    want = [sig(o) for o in reference if o.kind == "consolidated"]
    got = [sig(o) for o in delivered + replayed if o.kind == "consolidated"]
    assert set(got) == set(want), "lost or invented a consolidated event"
    # anything emitted twice is the same event at the same position
    assert len({p for _, p, _ in got}) == len(set(got))
    # after the restart, positions only grow
    pos = [o.value.position for o in replayed if o.kind == "consolidated"]
    assert pos == sorted(set(pos))


def test_merged_state_changes_keep_last_values_and_write_metas_last():
    """Runtime completes delivered batches together: one write per key (its last value), every
    aggregate entry before every holder meta, as within one batch."""
    from kvbus.streams.aggregation import aggregate_key, is_meta_key, meta_key
    from kvbus.streams.runtime import _Batch, merge_changes

    a, b = _Batch(()), _Batch(())
    ident = b"\x00" * 15 + b"\x01"
    a.items = [(0, aggregate_key("r#0", ident), b"v1"), (0, meta_key("r#0"), b"m1")]
    b.items = [(1, aggregate_key("s#0", ident), b"w1"), (1, meta_key("s#0"), b"n1"),
               (0, aggregate_key("r#0", ident), None), (0, meta_key("r#0"), b"m2")]
    merged = merge_changes([a, b])
    assert merged == [(0, aggregate_key("r#0", ident), None), (1, aggregate_key("s#0", ident), b"w1"),
                      (0, meta_key("r#0"), b"m2"), (1, meta_key("s#0"), b"n1")]
    assert [is_meta_key(k) for _, k, _ in merged] == [False, False, True, True]


def _with_model(b: EventBatch, model: str | None) -> EventBatch:
    return msgspec.structs.replace(b, model=model)


def test_outputs_carry_the_model_of_their_batch():
    """Passed through: the batch's model; consolidated: the lowest rank's batch's (rank 1 may report
    first); a forwarded Reset: its own batch's. The model is not part of the identity."""
    agg = Aggregator(TOPICS, window=WINDOW)
    out = run(agg, [_with_model(batch(0, 1, 0, [stored(1), Reset(reason="gap-unrecoverable")], replica="p"), "llama")])
    assert [(o.kind, o.value.model) for o in out] == [("passthrough", "llama"), ("reset", "llama")]
    out = run(agg, [_with_model(batch(1, 2, 0, [stored(2)]), "rank-1-told-otherwise"),
                    _with_model(batch(0, 2, 0, [stored(2)]), "qwen")])
    assert [(o.kind, o.value.model) for o in out] == [("consolidated", "qwen")]
    out = run(agg, [_with_model(batch(0, 2, 1, [stored(3)]), "qwen"), batch(1, 2, 1, [stored(3)])])
    assert [(o.kind, o.value.model) for o in out] == [("consolidated", "qwen")], "reports pair whatever their model"
    out = run(agg, [_with_model(batch(0, 2, -1, [Reset(reason="engine-restart")], epoch=500), "mistral")], now=1.0)
    assert [(o.kind, o.value.model) for o in out] == [("reset", "mistral")]
    assert blocks(run(agg, [batch(0, 1, 5, [stored(9)], replica="none")]))[0].model is None


def test_open_aggregates_stored_before_models_load_without_one():
    """A state store written before aggregates kept the model (nine fields) still loads."""
    from kvbus.streams.aggregation import Aggregate, aggregate_key, encode_aggregates, encode_meta, meta_key

    agg = Aggregator(TOPICS, window=WINDOW)
    run(agg, [_with_model(batch(0, 2, 0, [stored(1)]), "qwen")])
    (key, st), = agg.holders.items()
    (ident, aggs), = st.pending.items()
    old = msgspec.msgpack.encode([list(msgspec.structs.astuple(a))[:9] for a in aggs])
    states = load([(aggregate_key(key, ident), old), (meta_key(key), encode_meta(st.meta))])
    (restored,) = states[key].pending[ident]
    assert isinstance(restored, Aggregate) and restored.model is None and restored.reports == aggs[0].reports
    assert load([(aggregate_key(key, ident), encode_aggregates(aggs))])[key].pending[ident][0].model == "qwen"
