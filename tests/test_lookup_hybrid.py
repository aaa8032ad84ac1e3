"""Hybrid models (docs/lookup-protocol.md, "Hybrid models"): a holder whose events name two KV cache groups or
more is answered with the prefix vLLM's hybrid coordinator would hit, against vectors made by vLLM 0.33's own
``HybridKVCacheCoordinator`` (tests/vectors/vllm_hybrid_hits.json, tests/vectors/make_hybrid_vectors.py):
full attention with sliding windows (one or several groups, one or two window sizes, groups of larger
blocks), with Mamba (of the same and of larger blocks: fine-grained hits), with both, with chunked local
attention, and two full-attention kinds. Every vector is one holder of one view, on the in-memory model, a
Redis and a Valkey; the sink's own store writes the view from BlockStored events as vLLM would send them.
"""
from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

from kvbus.infra.scratch_redis import VALKEY, RedisServer
from kvbus.schemas.events import (
    BlockEvent,
    BlockRemoved,
    BlockStored,
    Reset,
    canonical_hash,
)
from kvbus.sinks.view.redis_store import RedisStore
from kvbus.sinks.view.store import ResidencyStore
from tests.memory_store import InMemoryStore

DOC = json.loads((Path(__file__).resolve().parent / "vectors" / "vllm_hybrid_hits.json").read_text())
VECTORS = DOC["vectors"]
CHUNK = {name: groups[1][2] for name, groups in DOC["models"].items() if groups[1][0] == "chunked"}
"""attention_chunk_size of the chunked-local models: not in vLLM's events (kv_cache_spec_sliding_window is
None), so the view holds those groups to the full-attention rule, equal to vLLM's within the first chunk."""


def chain(k: int) -> list[bytes]:
    return [canonical_hash((k << 20) | j) for j in range(VECTORS[k]["n"])]


def runs(positions: list[int]) -> list[list[int]]:
    out: list[list[int]] = []
    for j in positions:
        if out and out[-1][-1] == j - 1:
            out[-1].append(j)
        else:
            out.append([j])
    return out


def records(k: int) -> list:
    """The events of vector ``k``'s holder: per group, a block of another prompt stored and evicted (a
    group names itself with its first store: every group of a serving engine has stored something), then
    one BlockStored per run of positions the group holds, with what vLLM's events say of the group."""
    v, hashes, out = VECTORS[k], chain(k), []

    def add(event):
        out.append(("tb", BlockEvent(replica=f"v{k}", dp_rank=0, epoch=1, seq=len(out), index=0, ts=1.0, event=event)))

    for g, (spec, held) in enumerate(zip(v["groups"], v["held"])):
        other = [canonical_hash((k << 20) | 0xFFFFF)]
        add(BlockStored(block_hashes=other, medium="GPU", group_idx=g, **spec))
        add(BlockRemoved(block_hashes=other, medium="GPU", group_idx=g))
        for run in runs(held):
            add(BlockStored(block_hashes=[hashes[j] for j in run], medium="GPU", group_idx=g, **spec))
    return out


@pytest.fixture(scope="module", params=["memory", "redis", "valkey"])
def view(request) -> ResidencyStore:
    """All vectors' holders in one view of each store."""
    if request.param == "memory":
        store: ResidencyStore = InMemoryStore()
        store.apply([r for k in range(len(VECTORS)) for r in records(k)])
        yield store
        return
    with RedisServer(kind=VALKEY) if request.param == "valkey" else RedisServer() as srv:
        store = RedisStore(srv.client(), f"h{uuid.uuid4().hex[:8]}:")
        store.apply([r for k in range(len(VECTORS)) for r in records(k)])
        yield store


def expected(k: int) -> tuple[int, dict[int, int]]:
    """vLLM's hit and per-group hits of vector ``k``, in chain blocks."""
    v = VECTORS[k]
    u = v["hash_block_size"]
    return v["hit_tokens"] // u, {g: t // u for g, t in enumerate(v["per_group_tokens_walked"])}


def answer(store: ResidencyStore, k: int) -> tuple[int, dict[int, int]]:
    m = store.lookup(chain(k)).get(f"v{k}")
    return (m.matched, m.groups) if m else (0, {})


def test_the_vectors_cover_the_models_and_hit_lengths():
    assert {v["model"] for v in VECTORS} == set(DOC["models"])
    for name in DOC["models"]:
        hits = [expected(k)[0] for k, v in enumerate(VECTORS) if v["model"] == name]
        assert len(set(hits)) >= 3 and 0 in hits, (name, hits)  # misses, short and long hits
    assert {v["cache_hit_alignment_tokens"] for v in VECTORS} > {v["hash_block_size"] for v in VECTORS}
    assert all(v["hit_tokens"] == v["hit_tokens_walked"] for v in VECTORS)
    # the answer "leading blocks held by any group" (what a one-group holder gets) is wrong for many
    assert sum(0 < expected(k)[0] < v["walked"] for k, v in enumerate(VECTORS)) >= 40
    assert sum(expected(k)[0] == 0 < v["walked"] for k, v in enumerate(VECTORS)) >= 40


@pytest.mark.parametrize("k", [k for k, v in enumerate(VECTORS) if v["model"] not in CHUNK],
                         ids=lambda k: f"{VECTORS[k]['model']}-{k}")
def test_hybrid_answers_equal_vllms_coordinator(view, k):
    """matched is find_longest_cache_hit's hit, groups find_longest_cache_hit_per_group's (over the blocks
    held in some tier); a holder vLLM would hit nothing of is not answered."""
    want = expected(k)
    assert answer(view, k) == (want if want[0] else (0, {}))


@pytest.mark.parametrize("k", [k for k, v in enumerate(VECTORS) if v["model"] in CHUNK],
                         ids=lambda k: f"{VECTORS[k]['model']}-{k}")
def test_chunked_local_answers_equal_vllms_within_the_first_chunk_and_never_exceed_them(view, k):
    v = VECTORS[k]
    got, want = answer(view, k), expected(k)
    if v["walked"] * v["hash_block_size"] < CHUNK[v["model"]]:
        assert got == (want if want[0] else (0, {}))
    else:
        assert got[0] <= want[0]
        assert all(got[1].get(g, 0) <= run for g, run in want[1].items())


def test_chunked_local_vectors_test_both_sides_of_the_first_chunk():
    within = [v for v in VECTORS if v["model"] in CHUNK and v["walked"] * v["hash_block_size"] < CHUNK[v["model"]]]
    beyond = [v for v in VECTORS if v["model"] in CHUNK and v not in within]
    assert len(within) >= 30 and len(beyond) >= 10
    assert any(expected(VECTORS.index(v))[0] > 0 for v in within)


def test_score_sums_the_hit_blocks_only_and_tiers_keep_their_runs(view):
    """A hybrid holder's score is over its matched (hit) blocks; its tiers' runs are still each tier's
    leading run, which may be longer."""
    k = next(k for k, v in enumerate(VECTORS) if v["model"] == "full+sliding" and 0 < expected(k)[0] < v["walked"]
             and v["held"][0][:v["walked"]] == list(range(v["walked"])))
    m = view.lookup(chain(k))[f"v{k}"]
    assert m.score == m.matched == expected(k)[0]
    assert m.tiers["GPU"] == VECTORS[k]["walked"] > m.matched


def _stored(replica, seq, hashes, group, kind, window=None, epoch=1):
    return ("tb", BlockEvent(replica=replica, dp_rank=0, epoch=epoch, seq=seq, index=0, ts=1.0,
                             event=BlockStored(block_hashes=hashes, medium="GPU", group_idx=group, block_size=16,
                                               kv_cache_spec_kind=kind, kv_cache_spec_sliding_window=window)))


@pytest.fixture(params=["memory", "redis"])
def store(request) -> ResidencyStore:
    if request.param == "memory":
        yield InMemoryStore()
        return
    with RedisServer() as srv:
        yield RedisStore(srv.client(), f"h{uuid.uuid4().hex[:8]}:")


H = [canonical_hash(0x5000 + i) for i in range(12)]


def test_a_reset_forgets_the_groups_and_a_one_group_engine_answers_as_before(store):
    """After an engine restart (Reset marker) the holder's groups are what its new stores say: a model
    with one group answers any-tier leading runs again."""
    store.apply([_stored("a", 0, H[:8], 0, "full_attention"), _stored("a", 1, H[6:8], 1, "sliding_window", 32)])
    assert (store.lookup(H)["a"].matched, store.lookup(H)["a"].groups) == (8, {0: 8, 1: 8})
    store.apply([_stored("a", 2, H[:4], 1, "sliding_window", 32)])
    assert store.lookup(H)["a"].matched == 8  # windows ending at 8 (blocks 6, 7) and at 4 are held
    reset = BlockEvent(replica="a", dp_rank=0, epoch=2, seq=-1, index=0, ts=2.0, event=Reset(reason="engine-restart"))
    store.apply([("tb", reset), _stored("a", 0, H[:5], 0, "full_attention", epoch=2)])
    got = store.lookup(H)["a"]
    assert (got.matched, got.groups) == (5, {})


def test_the_latest_store_of_a_group_decides_its_kind_and_window(store):
    store.apply([_stored("a", 0, H[:8], 0, "full_attention"), _stored("a", 1, H[5:8], 1, "sliding_window", 64)])
    assert "a" not in store.lookup(H)  # a window of 4 blocks: 3 held, none from block 0
    store.apply([_stored("a", 2, H[7:8], 1, "sliding_window", 32)])
    assert store.lookup(H)["a"].matched == 8


def test_an_unknown_kind_is_held_to_the_full_attention_rule(store):
    """``unknown`` (or any kind this release does not know) needs every block from the start: never more
    than any of vLLM's managers would hit."""
    store.apply([_stored("a", 0, H[:8], 0, "full_attention"), _stored("a", 1, H[:3] + H[5:8], 1, "unknown"),
                 _stored("b", 0, H[:8], 0, "full_attention"), _stored("b", 1, H[:3] + H[5:8], 1, "a kind; of text")])
    got = store.lookup(H)
    assert (got["a"].matched, got["a"].groups) == (3, {0: 8, 1: 3})
    assert (got["b"].matched, got["b"].groups) == (3, {0: 8, 1: 3})


def test_a_snapshot_keeps_the_groups_and_the_rebuilt_view_answers_the_same():
    """kvbus_dump -> the snapshot record (Avro) -> kvbus_restore (in several calls per holder) into a new
    view: every vector's answer is the same."""
    from kvbus.schemas import codec
    from kvbus.sinks.snapshot import holder_dump, holder_record

    with RedisServer() as srv:
        live, rebuilt = (RedisStore(srv.client(), f"s{uuid.uuid4().hex[:8]}:") for _ in range(2))
        live.apply([r for k in range(len(VECTORS)) for r in records(k)])
        for hid, name in live.holder_ids().items():
            replica, _, dp = name.rpartition("#")
            rec = holder_record(1, name, live.dump_holder(hid))
            rec = codec.decode("ViewSnapshot", codec.encode("ViewSnapshot", rec))
            assert len(rec.groups) == len(VECTORS[int(replica[1:])]["groups"])
            rebuilt.restore_holder(replica, int(dp), holder_dump(rec), max_hashes=3)
        assert rebuilt.snapshot() == live.snapshot()
        def groups(store):  # holder name -> its P gs value
            names = store.holder_ids()
            return {names[int(hid)]: v for hid, v in srv.client().hgetall(store.prefix + "gs").items()}

        assert groups(rebuilt) == groups(live) and len(groups(live)) == len(VECTORS)
        for k in range(len(VECTORS)):
            assert answer(rebuilt, k) == answer(live, k)


def test_malformed_group_specs_are_refused_before_any_write():
    """kvbus_apply refuses a kind 5 event whose spec is not "<kind>,<window>,<block_size>", kvbus_restore a
    group spec that is not "<kind>,<window>,<bmax>,<bmin>"; nothing is written."""
    import redis

    from kvbus.sinks.view.protocol import EVENT_HEADER, STORED_WITH_SPEC

    with RedisServer() as srv:
        store = RedisStore(srv.client(), f"m{uuid.uuid4().hex[:8]}:")
        spec = b"full attention,,16"
        blob = EVENT_HEADER.pack(STORED_WITH_SPEC, 1, 1, 1, 0, 0, 1.0, 1, 1) + bytes([len(spec)]) + spec + H[0]
        with pytest.raises(redis.ResponseError, match="malformed group spec"):
            store.transport.call("kvbus_apply", store.prefix, 1, "a", 0, 1, "tb", 1, "GPU||0", "0", blob)
        with pytest.raises(redis.ResponseError, match="malformed group spec"):
            store.transport.call("kvbus_restore", store.prefix, "a", 0, "", "", 0, 0, "", 1, 0, "full_attention,16")
        assert not srv.client().keys(store.prefix + "H:*") and not srv.client().keys(store.prefix + "B:*")


def test_an_answer_without_hybrid_holders_has_no_trailing_part():
    """One-group holders answer as before, byte for byte: no trailing part in head, no "groups" key,
    even in a view that has hybrid holders (here: candidates without them)."""
    with RedisServer() as srv:
        _no_trailing_part(RedisStore(srv.client(), f"t{uuid.uuid4().hex[:8]}:"))


def _no_trailing_part(store: RedisStore) -> None:
    from kvbus.schemas.lookup import lookup_args

    store.apply([_stored("a", 0, H[:8], 0, "full_attention"), _stored("a", 1, H[5:8], 1, "sliding_window", 48),
                 _stored("p", 0, H[:6], 0, "full_attention"),
                 ("tb", BlockEvent(replica="q", dp_rank=0, epoch=1, seq=0, index=0, ts=1.0,
                                   event=BlockStored(block_hashes=H[:3], medium="GPU")))])
    for cands, hybrid in (((), True), (("p", "q"), False)):
        head, blobs, descs = store.r.fcall_ro("kvbus_lookup", 0, *lookup_args(store.prefix, H, "GPU=1", cands))
        groups = len(blobs)
        k = 0
        for _ in range(groups):
            k += 3 + 2 * head[k + 2]
        assert (len(head) > k) == hybrid and groups == (3 if hybrid else 2)
    got = store.lookup(H, candidates=["p", "q"])
    assert {n: m.to_json() for n, m in got.items()} == {
        "p": {"matched": 6, "tiers": {"GPU": 6}, "score": 6.0, "replica": "p", "dp_rank": 0},
        "q": {"matched": 3, "tiers": {"GPU": 3}, "score": 3.0, "replica": "q", "dp_rank": 0}}
