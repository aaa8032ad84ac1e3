"""kvbus.client against real views: a private Redis and a private 3-master Redis Cluster (with a
replica each), written by the sink's own stores. The client's answers equal the store's lookups
and ``kvbus lookup --json``; its tie-breaks reorder only tied holders; its errors name the cause."""
from __future__ import annotations

import argparse
import json
import random
import time
import uuid
from collections import Counter

import pytest
import redis
from redis.exceptions import RedisClusterException

from kvbus.client import (
    BY_NAME,
    ByLoad,
    FunctionsMissing,
    HolderMatch,
    LayoutMismatch,
    Shuffle,
    UnmatchableSeed,
    ViewClient,
    lookup_cli as cli,
    rank,
)
from kvbus.infra.scratch_cluster import RedisClusterServer, wait_replicas_in_sync
from kvbus.infra.scratch_redis import RedisServer
from kvbus.runtime.settings import Settings
from kvbus.schemas.events import canonical_hash
from kvbus.schemas.lookup import tie_key
from kvbus.schemas.topics import Topics
from kvbus.sinks.view.redis_store import RedisStore
from kvbus.sinks.view.refcounts import Weights
from kvbus.sinks.view.sharded_store import ShardedRedisStore
from tests.histories import random_streams
from tests.lookup_cli import lookup_args, lookup_json
from tests.test_lookup_protocol import CASES, CHAIN, EMPTY_CASES, TOKENS_B, _records, _spec_and_cands

T = Topics(blocks="tb")


@pytest.fixture(autouse=True)
def _no_hash_seed(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)


@pytest.fixture(scope="module")
def servers():
    with RedisServer() as srv, RedisClusterServer(3) as cl:
        yield srv, cl


@pytest.fixture(scope="module")
def views(servers):
    """The same records in a single-node view and in the sharded view: (url, prefix, store) each."""
    srv, cl = servers
    prefix = f"k{uuid.uuid4().hex[:8]}:"
    records = _records()
    single = RedisStore(srv.client(), prefix)
    sharded = ShardedRedisStore(cl.url, prefix)
    single.apply(records)
    sharded.apply(records)
    return {"single": (srv.url, prefix, single), "cluster": (cl.url, prefix, sharded)}


def _kvbus_lookup_json(url: str, prefix: str, argv: list[str], capsys) -> str:
    return lookup_json(argv, Settings(redis_url=url), prefix, capsys)


def _client_kwargs(argv: list[str]) -> dict:
    """ViewClient.lookup's arguments for kvbus lookup's flags."""
    a = lookup_args(argv)
    cands = [c.strip() for c in (a.replicas or "").split(",") if c.strip()] or None
    if a.hashes:
        return {"hashes": [int(h, 0) for h in a.hashes.split(",")], "weights": a.weights, "candidates": cands,
                "model": a.model, "predicted": a.predicted}
    return {"tokens": [int(t) for t in a.tokens.split(",")], "block_size": a.block_size, "algo": a.algo,
            "seed": a.hash_seed, "weights": a.weights, "candidates": cands, "model": a.model, "predicted": a.predicted}


def _json(matches: list[HolderMatch]) -> str:
    return json.dumps({m.name: m.to_json() for m in matches})


STORE_CASES = sorted(c for c, argv in CASES.items() if "--predicted" not in argv)
"""The cases the stores' own lookup answers too (it counts no predicted entries: those cases run in
tests/test_lookup_protocol.py, on a view with predictions)."""


@pytest.mark.parametrize("where", ["single", "cluster"])
@pytest.mark.parametrize("case", STORE_CASES)
def test_answers_equal_kvbus_lookup_json_and_the_stores_lookup(views, capsys, where, case):
    url, prefix, store = views[where]
    with ViewClient(url, prefix, tie_break=BY_NAME) as view:
        got = view.lookup(**_client_kwargs(CASES[case]))
    assert _json(got) + "\n" == _kvbus_lookup_json(url, prefix, CASES[case], capsys)
    chain, _, cands, options = _spec_and_cands(CASES[case])
    argv = CASES[case]
    weights = Weights.parse(argv[argv.index("--weights") + 1] if "--weights" in argv else None)
    want = store.lookup(chain, weights=weights, candidates=cands or None, model=options["model"])
    assert {m.name: m for m in got} == want
    if case not in EMPTY_CASES:
        assert got, "the case finds holders"


def test_the_cluster_view_answers_as_the_single_node_view(views):
    with ViewClient(views["single"][0], views["single"][1], tie_break=BY_NAME) as one, \
            ViewClient(views["cluster"][0], views["cluster"][1], tie_break=BY_NAME) as sharded:
        assert sharded.cluster and not one.cluster
        for case in CASES:
            kw = _client_kwargs(CASES[case])
            assert sharded.lookup(**kw) == one.lookup(**kw)


def test_random_histories_single_sharded_and_replicas(servers):
    """Random multi-holder histories (stores, removes, clears, restarts, several tiers): the
    client's answers equal the stores' on both views, and read from replicas once they caught up."""
    srv, cl = servers
    prefix = f"r{uuid.uuid4().hex[:8]}:"
    records = random_streams(5, T, holders=12, batches=150, pool=30)
    single, sharded = RedisStore(srv.client(), prefix), ShardedRedisStore(cl.url, prefix)
    single.apply(records)
    sharded.apply(records)
    stored = [list(ev.event.block_hashes) for _, ev in records if getattr(ev.event, "block_hashes", None)]
    rng = random.Random(5)
    pool = sorted({h for c in stored for h in c})
    chains = stored[::4] + [rng.sample(pool, rng.randint(1, 8)) for _ in range(30)]
    names = sorted({ev.replica for _, ev in records})
    one = ViewClient(srv.url, prefix)
    many = ViewClient(cl.url, prefix)
    replicas = ViewClient(cl.url, prefix, read_from="replica", migration_check=0.0)
    wait_replicas_in_sync(cl, replicas._cluster_client())
    nodes = {n.port: cl.node_client(n.port) for n in cl.nodes}
    for r in nodes.values():
        r.config_resetstat()
    for chain in chains:
        w = rng.choice([None, "GPU=2,CPU=1,*=0.25", {"cpu": 3, "kvcr": 0.5}])
        cands = rng.choice([None, rng.sample(names, 2) + [f"{names[0]}#1"]])
        want = single.lookup(chain, weights=Weights.parse(w) if isinstance(w, str) else
                             Weights.over(w) if w else None, candidates=cands)
        assert want == sharded.lookup(chain, weights=Weights.parse(w) if isinstance(w, str) else
                                      Weights.over(w) if w else None, candidates=cands)
        for client in (one, many, replicas):
            got = client.lookup(hashes=chain, weights=w, candidates=cands)
            assert {m.name: m for m in got} == want
            assert [tie_key(m) for m in got] == sorted((tie_key(m) for m in got), reverse=True)
    fcalls = {p: int(r.info("commandstats").get("cmdstat_fcall_ro", {}).get("calls", 0)) for p, r in nodes.items()}
    on_replicas = sum(fcalls[n.port] for n in cl.nodes if not n.master)
    assert on_replicas == len(chains) * 16, "the replica reader read every shard of every lookup from a replica"
    for c in (one, many, replicas):
        c.close()


def test_tokens_hashes_and_digests_name_the_same_chain(views):
    url, prefix, _ = views["single"]
    view = ViewClient(url, prefix, tie_break=BY_NAME)
    by_tokens = view.lookup(tokens=[int(t) for t in TOKENS_B.split(",")], algo="sha256_cbor")
    assert [m.name for m in by_tokens] == ["vllm-sha256-cbor"] and by_tokens[0].matched == 3
    unsigned = [int.from_bytes(h, "big") for h in CHAIN]
    signed = [int.from_bytes(h, "big", signed=True) for h in CHAIN]
    digests = [bytes(24) + h for h in CHAIN]  # a 32-byte digest's last 8 bytes are the hash
    assert view.lookup(hashes=unsigned) == view.lookup(hashes=signed) == view.lookup(hashes=digests) \
        == view.lookup(hashes=CHAIN)
    assert view.lookup(hashes=CHAIN, candidates=[]) == [], "no candidate: nobody"
    assert view.lookup(hashes=[]) == [] and view.lookup(tokens=list(range(15))) == [], "no full block: no answer"
    with pytest.raises(ValueError, match="not both or neither"):
        view.lookup(tokens=[1], hashes=[1])
    with pytest.raises(ValueError, match="not both or neither"):
        view.lookup()
    with pytest.raises(UnmatchableSeed, match="random"):
        view.lookup(tokens=list(range(32)), algo="xxhash")
    with pytest.raises(ValueError, match="unknown hash algorithm"):
        view.lookup(tokens=list(range(32)), algo="md5")
    with pytest.raises(ValueError, match="not a number"):
        view.lookup(hashes=CHAIN, weights="GPU=lots")
    with pytest.raises(TypeError, match="tie_break"):
        view.lookup(hashes=CHAIN, tie_break="random")


def test_status_single_and_sharded(servers):
    srv, cl = servers
    for url, store in ((srv.url, lambda p: RedisStore(srv.client(), p)),
                       (cl.url, lambda p: ShardedRedisStore(cl.url, p))):
        prefix = f"s{uuid.uuid4().hex[:8]}:"
        view = ViewClient(url, prefix)
        assert view.status().state == "missing" and not view.status().ready
        st = store(prefix)
        st.apply(_records()[:2])
        assert view.status().state == "ready" and view.status().ready
        st.set_status(state="rebuilding", since=12.5, phase="replaying")
        s = view.status()
        assert (s.state, s.since, s.phase, s.ready) == ("rebuilding", 12.5, "replaying", False)
        assert s.as_dict() == st.status()
        view.close()


def test_a_view_of_another_layout_is_refused_by_name(servers, capsys):
    srv, _ = servers
    prefix = f"o{uuid.uuid4().hex[:8]}:"
    RedisStore(srv.client(), prefix).apply(_records()[:1])
    srv.client().hset(prefix + "meta", "layout", "2")
    with pytest.raises(LayoutMismatch, match="has layout 2; this client speaks 3"):
        ViewClient(srv.url, prefix).lookup(hashes=CHAIN)
    p = argparse.ArgumentParser()
    cli.add_lookup_args(p)
    assert cli.run_lookup(p.parse_args(["--hashes", "1", "--prefix", prefix]), Settings(redis_url=srv.url)) == 2
    assert "has layout 2" in capsys.readouterr().err


def test_a_server_without_the_functions_is_named_not_loaded(servers, capsys):
    """The client only reads: on a server that lost the library it says so (a sink loads it), on a
    single node and on every shard of a cluster."""
    _, cl = servers
    with RedisServer() as bare:
        bare.client().hset("x:meta", "layout", "3")
        with pytest.raises(FunctionsMissing, match="not loaded on this server"):
            ViewClient(bare.url, "x:").lookup(hashes=CHAIN)
        assert bare.client().function_list() == [], "the client did not load the library"
        p = argparse.ArgumentParser()
        cli.add_lookup_args(p)
        assert cli.run_lookup(p.parse_args(["--hashes", "1", "--prefix", "x:"]), Settings(redis_url=bare.url)) == 2
        assert "a sink loads them" in capsys.readouterr().err
    prefix = f"f{uuid.uuid4().hex[:8]}:"
    store = ShardedRedisStore(cl.url, prefix)
    store.apply(_records()[:3])
    masters = [cl.node_client(n.port) for n in cl.nodes if n.master]
    try:
        for m in masters:
            m.function_flush()
        with pytest.raises(FunctionsMissing):
            ViewClient(cl.url, prefix).lookup(hashes=CHAIN)
    finally:
        store.load_library(replace=True)
    assert ViewClient(cl.url, prefix).lookup(hashes=CHAIN)


# ---------------------------------------------------------------- ties

TIED = ["a", "c", "pod#x"] + [f"shared-{k}" for k in range(24)]
"""The holders tied on CHAIN[:2] (score 2.0, matched 2) in the module's view."""


def test_tied_holders_are_what_the_view_says(views):
    url, prefix, _ = views["single"]
    got = ViewClient(url, prefix, tie_break=BY_NAME).lookup(hashes=CHAIN[:2])
    assert [m.name for m in got if tie_key(m) == (2.0, 2)] == sorted(TIED)
    assert [m.name for m in got if tie_key(m) != (2.0, 2)] == ["b#1", "b#0"]


@pytest.mark.parametrize("where", ["single", "cluster"])
def test_the_default_spreads_tied_holders_and_keeps_the_ranking(views, where):
    url, prefix, _ = views[where]
    view = ViewClient(url, prefix)  # default tie-break: Shuffle seeded from the OS
    canonical = ViewClient(url, prefix, tie_break=BY_NAME).lookup(hashes=CHAIN[:2])
    firsts = Counter()
    for _ in range(200):
        got = view.lookup(hashes=CHAIN[:2])
        assert [tie_key(m) for m in got] == [tie_key(m) for m in canonical], "only tied holders move"
        assert sorted(m.name for m in got) == sorted(m.name for m in canonical)
        firsts[got[0].name] += 1
    assert set(firsts) <= set(TIED)
    # 27 tied holders, 200 draws: one holder always first has probability 27 * 27**-200
    assert len(firsts) > 1, f"the default always picked {firsts}"


def test_a_seeded_shuffle_repeats_its_sequence(views):
    url, prefix, _ = views["single"]
    a, b = ViewClient(url, prefix, tie_break=Shuffle(seed=7)), ViewClient(url, prefix)
    seq_a = [[m.name for m in a.lookup(hashes=CHAIN[:2])] for _ in range(5)]
    tb = Shuffle(seed=7)
    seq_b = [[m.name for m in b.lookup(hashes=CHAIN[:2], tie_break=tb)] for _ in range(5)]
    assert seq_a == seq_b
    assert len({tuple(s) for s in seq_a}) == 5, "each lookup draws a new order"
    firsts = {ViewClient(url, prefix, tie_break=Shuffle(seed=s)).lookup(hashes=CHAIN[:2])[0].name for s in range(40)}
    assert len(firsts) > 10, firsts


def test_a_load_callback_sends_tied_prompts_to_the_least_loaded(views):
    url, prefix, _ = views["cluster"]
    load = {name: 5 for name in TIED} | {"shared-17": 1, "shared-3": 1, "pod#x": 0.5, "b": 0}
    view = ViewClient(url, prefix)
    calls = []

    def by_replica(m: HolderMatch) -> float:
        calls.append(m.name)
        return load[m.replica]

    got = view.lookup(hashes=CHAIN[:2], tie_break=by_replica)
    assert [m.name for m in got[:3]] in (["pod#x", "shared-17", "shared-3"], ["pod#x", "shared-3", "shared-17"])
    assert got[-2:][0].name == "b#1", "a less loaded holder with a lower score stays behind"
    assert sorted(calls) == sorted(TIED), "the callback is asked about tied holders only"
    seconds = {view.lookup(hashes=CHAIN[:2], tie_break=ByLoad(lambda m: load[m.replica], Shuffle(seed=s)))[1].name
               for s in range(30)}
    assert seconds == {"shared-17", "shared-3"}, "equal loads are shuffled"


def test_rank_orders_within_ties_only():
    def m(name, score, matched):
        return HolderMatch(name, 0, matched, {"GPU": matched}, score)

    ms = [m("d", 2.0, 2), m("a", 2.0, 2), m("z", 3.0, 3), m("b", 2.0, 3), m("c", 2.0, 2), m("e", 1.0, 1)]
    assert [x.name for x in rank(ms)] == ["z", "b", "a", "c", "d", "e"]
    load = {"a": 3, "c": 2, "d": 1}
    assert [x.name for x in rank(ms, ByLoad(lambda x: load[x.name]))] == ["z", "b", "d", "c", "a", "e"]
    shuffled = rank(ms, Shuffle(seed=1))
    assert [x.name for x in shuffled][:2] == ["z", "b"] and shuffled[-1].name == "e"
    assert {x.name for x in shuffled[2:5]} == {"a", "c", "d"}


def test_no_io_before_the_first_call_and_password_redacted():
    view = ViewClient("redis+cluster://u:secret@127.0.0.1:1/0?read_from=replica", "p:")
    assert view.cluster and view.read_from == "replica"
    assert "secret" not in repr(view)
    with pytest.raises((redis.RedisError, RedisClusterException), match="127.0.0.1:1"):  # I/O at the first lookup
        view.lookup(hashes=[1])
    with pytest.raises(ValueError, match="read_from"):
        ViewClient("redis+cluster://127.0.0.1:1?read_from=nearest")
    with pytest.raises(ValueError, match="shards"):
        ViewClient("redis+cluster://127.0.0.1:1?shards=0")


def test_holders_added_after_the_names_were_read_are_named(views, servers):
    """Holder ids are cached; a reply naming a new one makes the client read the names again (and
    display names follow: a replica that gains a second rank is shown with ranks)."""
    srv, _ = servers
    prefix = f"n{uuid.uuid4().hex[:8]}:"
    store = RedisStore(srv.client(), prefix)
    records = _records()
    store.apply(records[:1])  # a#0
    view = ViewClient(url=srv.url, prefix=prefix, names_ttl=3600)
    assert [m.name for m in view.lookup(hashes=CHAIN)] == ["a"]
    from kvbus.schemas.events import BlockEvent, BlockStored

    store.apply([("kvbus.blocks", BlockEvent(replica="a", dp_rank=1, epoch=1, seq=0, index=0, ts=time.time(),
                                             event=BlockStored(block_hashes=[canonical_hash(CHAIN[0])])))])
    assert sorted(m.name for m in view.lookup(hashes=CHAIN)) == ["a#0", "a#1"]


def test_the_routing_policy_weighs_reuse_against_relative_load():
    from kvbus.client.routing import choose, score

    assert score(8, 10, 0, 0) == 0.8 and score(8, 10, 5, 10, beta=0.5) == 0.8 - 0.25
    # the holder of the prefix wins while its load is light, loses once beta x relative load outweighs reuse
    assert choose(10, {"a": 10, "b": 2}, {"a": 5, "b": 0}, ["a", "b", "c"]) == "a"
    assert choose(10, {"a": 10}, {"a": 10, "b": 0}, ["a", "b"], beta=2) == "b"
    # equal scores: the longer prefix, then the lower load, then the tie-break's order
    assert choose(10, {}, {}, ["x", "y"]) == "x"
    assert choose(10, {}, {"x": 1, "y": 1}, ["y", "x"]) == "y"
    assert choose(10, {"x": 5, "y": 5}, {"x": 1}, ["x", "y"], beta=0) == "y"
    with pytest.raises(ValueError):
        choose(1, {}, {}, [])
