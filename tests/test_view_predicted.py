"""Predicted entries (issue 45): a router records the blocks of a prompt it just routed as predicted on the
holder it chose (``ViewClient.predict``, ``FCALL kvbus_predict``); lookups with ``predicted=<weight>``
count them until the engine's BlockStored confirms them or they expire, and a BlockRemoved,
AllBlocksCleared, Reset, expiry or drop of the holder after them removes them. Lookups without the option
answer as they did before predictions.

The contract suite's style (tests/test_sink_store_contract.py): the same tests on RedisStore over a Redis
7.0 and a Valkey 9.1, and on ShardedRedisStore over a 3-master cluster of each; the view is written through
the store (the sink's side), predictions and lookups go through its reader (the router's side). The
in-memory twin is left out: predictions are not the store's (``ResidencyStore``) but a router's write, and
the expected answers are written out below.
"""
from __future__ import annotations

import time
import uuid

import pytest
import redis

from kvbus.infra.scratch_redis import RedisServer
from kvbus.schemas import lookup, view_keys as vk
from kvbus.schemas.events import AllBlocksCleared, BlockEvent, BlockRemoved, BlockStored, Reset, canonical_hash
from kvbus.sinks.view.redis_store import RedisStore
from kvbus.sinks.view.sharded_store import ShardedRedisStore
from kvbus.sinks.view.store import ResidencyStore

MAIN = "tb"
H = [canonical_hash(0x2000 + i * 104729) for i in range(64)]
SHORT = 0.4
"""A TTL the tests wait out (seconds)."""


@pytest.fixture(params=["redis", "valkey", "redis-cluster", "valkey-cluster"])
def store(request) -> ResidencyStore:
    """RedisStore on a Redis and on a Valkey, ShardedRedisStore on a 3-master cluster of each."""
    prefix = f"p{uuid.uuid4().hex[:8]}:"
    if request.param.endswith("-cluster"):
        kind = request.param.removesuffix("-cluster")
        return ShardedRedisStore(request.getfixturevalue(f"{kind}_cluster_client"), prefix)
    return RedisStore(request.getfixturevalue(f"{request.param}_server").client(), prefix)


class Stream:
    """Events of one holder with growing positions, naming ``model``."""

    def __init__(self, replica: str, dp: int = 0, model: str | None = None):
        self.replica, self.dp, self.model, self.seq, self.epoch = replica, dp, model, 0, 100

    def ev(self, event) -> tuple[str, BlockEvent]:
        self.seq += 1
        return MAIN, BlockEvent(replica=self.replica, dp_rank=self.dp, epoch=self.epoch, seq=self.seq, index=0,
                                ts=1000.0 + self.seq, event=event, model=self.model)

    def reset(self) -> tuple[str, BlockEvent]:
        self.epoch += 10
        self.seq = 0
        return MAIN, BlockEvent(replica=self.replica, dp_rank=self.dp, epoch=self.epoch, seq=-1, index=0,
                                ts=1000.0, event=Reset(reason="engine-restart"), model=self.model)


def stored(hashes, medium="GPU"):
    return BlockStored(block_hashes=list(hashes), medium=medium)


def removed(hashes, medium="GPU"):
    return BlockRemoved(block_hashes=list(hashes), medium=medium)


def answer(store, chain, **kw) -> dict[str, tuple[int, dict[str, int], float]]:
    """{display name: (matched, tiers, score)} of a lookup through the store's reader."""
    return {m.name: (m.matched, m.tiers, round(m.score, 6)) for m in store.reader().lookup(hashes=chain, **kw)}


def setup_two(store) -> None:
    """Holder ``a`` holds H[0:2] on GPU, ``b`` holds H[40] only (known to the view, nothing of the chain)."""
    a, b = Stream("a"), Stream("b")
    store.apply([a.ev(stored(H[:2])), b.ev(stored(H[40:41]))])


def test_without_the_option_lookups_answer_as_before(store):
    setup_two(store)
    before = answer(store, H[:8])
    assert store.reader().predict("b", hashes=H[:6]) == 6
    assert store.reader().predict("a", hashes=H[:6]) == 6
    assert answer(store, H[:8]) == before == {"a": (2, {"GPU": 2}, 2.0)}


def test_predicted_blocks_count_with_the_weight_the_lookup_gives(store):
    setup_two(store)
    view = store.reader()
    view.predict("b", hashes=H[:6])
    view.predict("a#0", hashes=H[:6])
    assert answer(store, H[:8], predicted=0.5) == {
        "a": (6, {"GPU": 2, "predicted": 6}, 2 + 4 * 0.5),  # held blocks keep their tier's weight
        "b": (6, {"predicted": 6}, 6 * 0.5)}
    assert answer(store, H[:8], predicted=0) == {"a": (6, {"GPU": 2, "predicted": 6}, 2.0),
                                                 "b": (6, {"predicted": 6}, 0.0)}
    assert answer(store, H[:4], predicted=1.5)["b"] == (4, {"predicted": 4}, 6.0), "the chain bounds the answer"
    assert answer(store, H[6:8], predicted=1) == {}, "nothing of this chain is held or predicted"


def test_held_blocks_after_a_predicted_gap_count_with_their_tier(store):
    a = Stream("a")
    store.apply([a.ev(stored(H[:2])), a.ev(stored(H[3:5], "CPU"))])
    store.reader().predict("a", hashes=H[2:3])
    assert answer(store, H[:8], predicted=0.25) == {"a": (5, {"GPU": 2, "predicted": 5}, 2 + 0.25 + 2 * 0.8)}


def test_candidates_and_unknown_holders(store):
    setup_two(store)
    view = store.reader()
    assert view.predict("nobody", hashes=H[:6]) == 0, "a holder the view does not know gets no prediction"
    assert view.predict("b", hashes=[]) == 0
    view.predict("b", hashes=H[:6])
    assert set(answer(store, H[:8], predicted=1, candidates=["a"])) == {"a"}
    assert set(answer(store, H[:8], predicted=1, candidates=["b#0"])) == {"b"}


def test_a_prediction_expires_after_its_ttl_with_its_keys(store):
    setup_two(store)
    view = store.reader()
    view.predict("b", hashes=H[:6], ttl=SHORT)
    assert answer(store, H[:8], predicted=1)["b"] == (6, {"predicted": 6}, 6.0)
    time.sleep(SHORT + 0.3)
    assert answer(store, H[:8], predicted=1) == {"a": (2, {"GPU": 2}, 2.0)}
    assert predicted_keys(store) == [], "what never came goes by itself"


def test_predicting_again_keeps_the_later_expiry(store):
    setup_two(store)
    view = store.reader()
    view.predict("b", hashes=H[:3], ttl=30)
    view.predict("b", hashes=H[:6], ttl=SHORT)
    time.sleep(SHORT + 0.3)
    assert answer(store, H[:8], predicted=1)["b"] == (3, {"predicted": 3}, 3.0)


def test_a_confirming_block_stored_keeps_the_block_matched_after_the_ttl(store):
    b = Stream("b")
    store.apply([b.ev(stored(H[40:41]))])
    store.reader().predict("b", hashes=H[:6], ttl=SHORT)
    store.apply([b.ev(stored(H[:4]))])
    assert answer(store, H[:8], predicted=0.5)["b"] == (6, {"GPU": 4, "predicted": 6}, 4 + 2 * 0.5)
    assert members(store, "b", 0) == 2, "the confirmed predictions are dropped: the real entries count"
    time.sleep(SHORT + 0.3)
    assert answer(store, H[:8], predicted=0.5) == {"b": (4, {"GPU": 4}, 4.0)}
    assert answer(store, H[:8]) == {"b": (4, {"GPU": 4}, 4.0)}


def test_a_block_removed_after_a_prediction_removes_it(store):
    a = Stream("a")
    store.apply([a.ev(stored(H[:2]))])
    store.reader().predict("a", hashes=H[:6], ttl=30)
    store.apply([a.ev(removed(H[3:4]))])  # the engine evicted it (it never told the view it held it)
    assert answer(store, H[:8], predicted=1) == {"a": (3, {"GPU": 2, "predicted": 3}, 3.0)}
    store.apply([a.ev(removed(H[0:1]))])  # held and predicted: both go
    assert answer(store, H[:8], predicted=1) == {}


@pytest.mark.parametrize("event", ["cleared", "reset"])
def test_all_blocks_cleared_or_a_reset_after_a_prediction_removes_the_holders_predictions(store, event):
    a, b = Stream("a"), Stream("b")
    store.apply([a.ev(stored(H[:2])), b.ev(stored(H[40:41]))])
    view = store.reader()
    view.predict("a", hashes=H[:6], ttl=30)
    view.predict("b", hashes=H[:5], ttl=30)
    store.apply([a.ev(AllBlocksCleared()) if event == "cleared" else a.reset()])
    assert answer(store, H[:8], predicted=1) == {"b": (5, {"predicted": 5}, 5.0)}, "b's predictions stay"
    assert members(store, "a", 0) == 0
    view.predict("a", hashes=H[:6], ttl=30)  # a prediction after it counts again
    assert answer(store, H[:8], predicted=1)["a"] == (6, {"predicted": 6}, 6.0)


def test_expiry_and_drop_of_the_holder_remove_its_predictions(store):
    a, b = Stream("a"), Stream("b")
    store.apply([a.ev(stored(H[40:41])), b.ev(stored(H[41:42]))])
    view = store.reader()
    view.predict("a", hashes=H[:6], ttl=30)
    view.predict("b", hashes=H[:6], ttl=30)
    store.heartbeat("b", 0, 5000.0)
    assert store.expire_stale(max_age=600, now=5100.0) == ["a#0"]
    assert answer(store, H[:8], predicted=1) == {"b": (6, {"predicted": 6}, 6.0)}
    assert store.drop_holder("b", 0, now=2000.0) == 1
    assert answer(store, H[:8], predicted=1) == {}
    assert predicted_keys(store) == []


def test_another_model_never_sees_a_prediction(store):
    a = Stream("a", model="m2")  # serves m2
    c = Stream("c", model="m1")  # serves m1
    store.apply([a.ev(stored(H[40:41])), c.ev(stored(H[41:42]))])
    view = store.reader()
    view.predict("a", hashes=H[:6], model="m1", ttl=30)  # a router's mistake: a serves m2
    view.predict("c", hashes=H[:4], ttl=30)  # no model named
    assert answer(store, H[:8], predicted=1, model="m2") == {}, "a's prediction is m1's, c serves m1"
    assert answer(store, H[:8], predicted=1, model="m1") == {}, "a serves m2; c's prediction names no model"
    assert answer(store, H[:8], predicted=1) == {"a": (6, {"predicted": 6}, 6.0), "c": (4, {"predicted": 4}, 4.0)}
    view.predict("c", hashes=H[:3], model="m1", ttl=30)  # predictions of one model at a time: the others go
    assert answer(store, H[:8], predicted=1, model="m1") == {"c": (3, {"predicted": 3}, 3.0)}
    assert answer(store, H[:8], predicted=1, model="m3") == {}


def test_hybrid_model_holders_are_answered_without_their_predictions(store):
    """A holder with two KV cache groups is answered with vLLM's hybrid coordinator's hit (docs/lookup-protocol.md,
    "Hybrid models"), which predictions do not extend; a one-group holder beside it is."""
    a, d = Stream("a"), Stream("d")

    def grouped(hashes, group, kind, window=None):
        return BlockStored(block_hashes=list(hashes), medium="GPU", group_idx=group, block_size=16,
                           kv_cache_spec_kind=kind, kv_cache_spec_sliding_window=window)

    store.apply([a.ev(grouped(H[:10], 0, "full_attention")), a.ev(grouped(H[4:8], 1, "sliding_window", 48)),
                 d.ev(grouped(H[:10], 0, "full_attention"))])
    view = store.reader()
    view.predict("a", hashes=H[:12], ttl=30)
    view.predict("d", hashes=H[:12], ttl=30)
    got = {m.name: m for m in view.lookup(hashes=H[:12], predicted=1)}
    assert (got["a"].matched, got["a"].groups, got["a"].tiers) == (8, {0: 10, 1: 8}, {"GPU": 10})
    assert (got["d"].matched, got["d"].tiers) == (12, {"GPU": 10, "predicted": 12})


def test_bad_options_and_arguments_are_refused(store):
    setup_two(store)
    view = store.reader()
    for bad in (-1, float("nan"), float("inf"), "x"):
        with pytest.raises(ValueError):
            view.lookup(hashes=H[:4], predicted=bad)
    for ttl in (0, -1, lookup.MAX_PREDICT_TTL + 1):
        with pytest.raises(ValueError):
            view.predict("a", hashes=H[:4], ttl=ttl)
    with pytest.raises(ValueError):
        view.predict("a", hashes=H[:4], model="")


def test_the_library_refuses_a_bad_weight_and_bad_predict_arguments(redis_server):
    store = RedisStore(redis_server.client(), "bad:")
    setup_two(store)
    r = redis_server.client()
    chain = b"".join(H[:2])
    for w in ("x", "-1", "inf", ""):
        with pytest.raises(redis.ResponseError, match="predicted needs a weight"):
            r.fcall_ro("kvbus_lookup", 0, "bad:", chain, "", "\0predicted", w)
    with pytest.raises(redis.ResponseError, match="predicted needs a weight"):
        r.fcall_ro("kvbus_lookup", 0, "bad:", chain, "", "\0predicted")
    for ttl in ("0", "1.5", "600001", "x"):
        with pytest.raises(redis.ResponseError, match="malformed arguments"):
            r.fcall("kvbus_predict", 0, "bad:", "a", "0", ttl, chain)
    with pytest.raises(redis.ResponseError, match="write"):
        r.fcall_ro("kvbus_predict", 0, "bad:", "a", "0", "1000", chain)


def test_a_prediction_survives_a_restart_until_its_ttl():
    """The server saved, killed and started again: a prediction still within its TTL counts, one whose TTL
    ran out meanwhile does not (expiries are absolute times of the server's clock)."""
    srv = RedisServer().start()
    try:
        store = RedisStore(srv.client(), "rs:")
        setup_two(store)
        view = store.reader()
        view.predict("a", hashes=H[:6], ttl=60)
        view.predict("b", hashes=H[:4], ttl=SHORT)
        srv.client().save()
        view.close()
        srv.kill()
        time.sleep(SHORT + 0.3)
        srv.start()
        again = RedisStore(srv.client(), "rs:")
        assert answer(again, H[:8], predicted=1) == {"a": (6, {"GPU": 2, "predicted": 6}, 6.0)}
    finally:
        srv.stop()


# ----------------------------------------------------------------------------- helpers


def _shard(store, replica: str, dp: int) -> tuple[redis.Redis | redis.RedisCluster, str]:
    """The client and key prefix of the view (shard) that holds a holder."""
    if isinstance(store, ShardedRedisStore):
        s = lookup.holder_shard(replica, dp, store.nshards)
        assert s == store.shard(replica, dp), "predictions go to the holder's own shard"
        return store.rc, store.shards[s].prefix
    return store.r, store.prefix


def _hid(store, replica: str, dp: int) -> int:
    client, prefix = _shard(store, replica, dp)
    return int(client.hget(vk.HID(prefix), f"{replica}#{dp}"))


def members(store, replica: str, dp: int) -> int:
    """The predicted entries a holder's key holds (expired ones included until pruned)."""
    client, prefix = _shard(store, replica, dp)
    return client.zcard(vk.PREDICTED(prefix, _hid(store, replica, dp)))


def predicted_keys(store) -> list[str]:
    """The view's prediction keys still present (``P xh``, ``P X:<hid>`` of its holders)."""
    sharded = isinstance(store, ShardedRedisStore)
    client = store.rc if sharded else store.r
    out = []
    for p in [st.prefix for st in store.shards] if sharded else [store.prefix]:
        keys = [vk.PREDICTED_HOLDERS(p)] + [vk.PREDICTED(p, int(h)) for h in client.hvals(vk.HID(p)) if h.isdigit()]
        out += [k for k in keys if client.exists(k)]
    return out
