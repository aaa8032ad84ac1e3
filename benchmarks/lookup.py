"""Lookup latency and memory per entry: kvbus's Redis layout next to llm-d's, on one private Redis.

    .venv/bin/python benchmarks/lookup.py                  # 10 M entries, 256 replicas, 128-block chains
    .venv/bin/python benchmarks/lookup.py --entries 1000000 --queries 500

What it does, in one run on one throw-away ``redis-server`` (free port, ``--save ''``, temp dir,
``--maxmemory 4gb``):

1. generates a fleet residency (``kvbus.simulator.view_workload``): conversations = one of 64 shared
   system prompts + their own blocks, each cached on ``--copies`` random replicas on GPU and, with
   probability ``--cpu-frac``, on CPU too, until ``--entries`` (replica, block, tier) entries;
2. loads it into kvbus's layout through ``RedisStore.apply`` (the sink's write path: one FCALL per
   replica per batch, exactly-once positions included), and measures ``used_memory`` before/after;
3. loads the same entries into the llm-d layout in database 1 of the same server, as llm-d's
   ``redis.go`` does: one HASH per block key (the decimal uint64 hash, no prefix), one field per pod
   entry holding the JSON ``PodEntry`` and an empty value, written with pipelined HSET (its
   engine->request ``engine:<h>`` ZSETs are left out, which favours llm-d);
4. runs ``--queries`` lookups of 128-block chains, alternating layouts: kvbus = one
   ``FCALL_RO kvbus_lookup``; llm-d = one pipeline of 128 ``HKEYS`` + JSON decoding (memoised) + its
   LongestPrefixScorer (active-pod intersection, max tier weight per block); both timed end to end
   in the same Python client, and both answers compared (they must agree). Two query sets:
   "shared" = a cached conversation with its system prompt (the prompt is cached by most replicas,
   so an answer lists ~all 256 of them), "private" = a conversation without shared prefix (1-2
   holders). Then ``--server-queries`` of each set again with SLOWLOG at 0 us, for the Redis-side
   time (kvbus: the FCALL_RO; llm-d: the sum of its HKEYS, without their per-command dispatch).

``--cluster``: the same data in the single Redis and in the sharded view on a private 3-master
Redis Cluster (``kvbus.sinks.view.sharded_store``, started by ``infra/redis_cluster.py``; ``--shards`` virtual
shards, a comma list measures several), no llm-d; default 1 M entries instead of 10 M (six more
servers on this box). Reports lookup p50/p99 client-side for both (answers compared: they must be
identical) and the apply work per master: FCALL calls and Redis-side us from ``INFO commandstats``
on each node during the load, and each master's main-thread CPU (``INFO cpu``: the work done,
not counting time spent waiting for one of the 2 cores), the single node's next to them; and the
lookups of the largest shard count once more from the replicas (``?read_from=replica``).

    .venv/bin/python benchmarks/lookup.py --cluster                    # 1 M entries, 16 shards
    .venv/bin/python benchmarks/lookup.py --cluster --shards 3,16 --entries 2000000

``--baseline REV``: the lookups of this tree's ``kvbus_lookup`` next to those of git revision ``REV``'s
(its ``sinks/view/lua/kvbus.lua`` loaded into the same server as library ``kvbusbase``), alternating, on the
same view and queries: client-side and Redis-side p50/p99 of each raw ``FCALL_RO`` and their ratios
(this tree over ``REV``), answers compared. Only for revisions of the same key layout.

``--hybrid-window W``: every replica serves a hybrid model: each store also goes to a sliding-window KV
cache group (group 1, window ``W`` tokens, blocks of 16) as its last ``ceil(W / 16)`` blocks, and every
event names its group's kind, so every lookup answers with vLLM's hybrid rule (implies ``--skip-llmd``).

    .venv/bin/python benchmarks/lookup.py --entries 1000000 --queries 200 --skip-llmd --baseline main

The last line printed is one JSON object with the figures.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import redis

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.fleet_view import load_kvbus, pct, queries as query_set, used_memory  # noqa: E402
from kvbus.infra.scratch_cluster import RedisClusterServer, wait_replicas_in_sync  # noqa: E402
from kvbus.infra.scratch_redis import RedisServer, main_thread_cpu  # noqa: E402
from kvbus.schemas.lookup import LAYOUT, lookup_args, parse_reply  # noqa: E402
from kvbus.simulator.view_workload import FleetStore, fleet_workload  # noqa: E402
from kvbus.sinks.view.cluster import cluster_client  # noqa: E402
from kvbus.sinks.view.redis_store import RedisStore  # noqa: E402
from kvbus.sinks.view.refcounts import Weights  # noqa: E402
from kvbus.sinks.view.sharded_store import ShardedRedisStore  # noqa: E402

LLMD_WEIGHTS = {"gpu": 1.0, "cpu": 0.8}


# ---------------------------------------------------------------------- llm-d baseline layout


def pod_identifier(replica: int) -> str:
    """llm-d's pod id for replica index ``replica``: ``<pod-ip>:8000``."""
    return f"10.0.{replica // 250}.{replica % 250 + 1}:8000"


def pod_entry(replica: int, medium: str) -> str:
    """llm-d's JSON ``PodEntry`` field (Go json.Marshal field order)."""
    return json.dumps(
        {"PodIdentifier": pod_identifier(replica), "DeviceTier": medium.lower(), "Speculative": False,
         "HasGroup": False, "GroupIdx": 0},
        separators=(",", ":"),
    )


class LlmdIndex:
    """llm-d-kv-cache's Redis index (``pkg/kvcache/kvblock/redis.go``): HASH per block key, field =
    JSON PodEntry, value ""; Add = pipelined HSET; Lookup = pipelined HKEYS, cut at the first empty key."""

    def __init__(self, r: redis.Redis):
        self.r = r
        self._entries: dict[bytes, tuple[str, str]] = {}

    @staticmethod
    def key(h: bytes) -> str:
        return str(int.from_bytes(h, "big"))

    def add(self, stores: list[FleetStore]) -> None:
        pipe = self.r.pipeline(transaction=False)
        for s in stores:
            field = pod_entry(s.replica, s.medium)
            for h in s.hashes:
                pipe.hset(self.key(h), field, "")
        pipe.execute()

    def _entry(self, raw: bytes) -> tuple[str, str]:
        e = self._entries.get(raw)
        if e is None:
            d = json.loads(raw)
            e = self._entries[raw] = (d["PodIdentifier"], d["DeviceTier"])
        return e

    def lookup(self, chain: list[bytes]) -> dict[str, tuple[int, float]]:
        """pod -> (leading blocks held, score) as llm-d's LongestPrefixScorer computes them."""
        pipe = self.r.pipeline(transaction=False)
        for h in chain:
            pipe.hkeys(self.key(h))
        active: set[str] | None = None
        matched: dict[str, int] = {}
        score: dict[str, float] = {}
        for i, fields in enumerate(pipe.execute(), start=1):
            if not fields:
                break
            best: dict[str, float] = {}
            for f in fields:
                pod, tier = self._entry(f)
                if active is None or pod in active:
                    w = LLMD_WEIGHTS.get(tier, 0.0)
                    if w > best.get(pod, -1.0):
                        best[pod] = w
            if not best:
                break
            active = set(best)
            for pod, w in best.items():
                matched[pod] = i
                score[pod] = score.get(pod, 0.0) + w
        return {p: (matched[p], score[p]) for p in matched}


# ---------------------------------------------------------------------- helpers


BASELINE_LIBRARY = "kvbusbase"
CPU_ROUNDS = 5
"""--baseline: rounds of all the queries per side for the CPU figure."""


def load_baseline(r: redis.Redis, rev: str) -> None:
    """Load git revision ``rev``'s function library into ``r`` as library :data:`BASELINE_LIBRARY` (its
    functions ``kvbusbase_*``), with this tree's key layout version."""
    root = Path(__file__).resolve().parent.parent
    code = subprocess.run(["git", "show", f"{rev}:sinks/view/lua/kvbus.lua"], cwd=root, capture_output=True, text=True,
                          check=True).stdout
    renamed = (code.replace("#!lua name=kvbus", f"#!lua name={BASELINE_LIBRARY}", 1)
               .replace("register_function('kvbus_", f"register_function('{BASELINE_LIBRARY}_")
               .replace("function_name = 'kvbus_", f"function_name = '{BASELINE_LIBRARY}_")
               .replace("@VERSION@", f"{BASELINE_LIBRARY}-{rev}").replace("@LAYOUT@", LAYOUT))
    r.function_load(renamed, replace=True)


def measure_baseline(store: RedisStore, queries, args) -> dict:
    """This tree's kvbus_lookup next to the baseline's on ``queries``, raw FCALL_RO each, both on every query
    (which goes first alternates: the second runs on keys the first brought into the CPU's caches):
    client side, then Redis side (SLOWLOG: wall time in the call), then the server's main-thread CPU per
    lookup (``INFO cpu``: only the work done, whatever else runs on the machine) over alternating rounds
    of all the queries, the median round; their answers (decoded replies) compared."""
    spec = Weights({"GPU": 1.0, "CPU": 0.8, "*": 0.0}).spec()
    r = store.r
    names = {"this": "kvbus_lookup", "baseline": f"{BASELINE_LIBRARY}_lookup"}

    def call(side: str, q) -> list:
        return r.fcall_ro(names[side], 0, *lookup_args(store.prefix, q, spec))

    def decoded(reply) -> list:
        return sorted((g.matched, g.score_micro, sorted(g.tiers.items()), sorted(g.hids)) for g in parse_reply(reply))

    lat: dict[str, list[float]] = {"this": [], "baseline": []}
    differ = 0
    for j, q in enumerate(queries):
        replies = {}
        for side in ("this", "baseline")[:: 1 if j % 2 else -1]:
            t = time.perf_counter()
            replies[side] = call(side, q)
            lat[side].append(time.perf_counter() - t)
        differ += decoded(replies["this"]) != decoded(replies["baseline"])
    out: dict = {side: {"p50_ms": round(pct(v, 0.5) * 1e3, 3), "p99_ms": round(pct(v, 0.99) * 1e3, 3)}
                 for side, v in lat.items()}
    r.config_set("slowlog-max-len", 400_000)
    r.config_set("slowlog-log-slower-than", 0)
    try:
        r.slowlog_reset()
        for j, q in enumerate(queries[: args.server_queries]):
            for side in ("this", "baseline")[:: 1 if j % 2 else -1]:
                call(side, q)
        entries = r.slowlog_get(len(queries) * 8)
        for side, fn in names.items():
            durs = [e["duration"] for e in entries if e["command"].startswith(b"FCALL_RO " + fn.encode() + b" ")]
            out[side].update(server_p50_ms=round(pct(durs, 0.5) / 1e3, 3),
                             server_p99_ms=round(pct(durs, 0.99) / 1e3, 3))
    finally:
        r.config_set("slowlog-log-slower-than", 10_000)
        r.slowlog_reset()
    cpu: dict[str, list[float]] = {"this": [], "baseline": []}
    for j in range(2 * CPU_ROUNDS):
        side = ("this", "baseline")[j % 2]
        c0 = main_thread_cpu(r)
        for q in queries:
            call(side, q)
        cpu[side].append((main_thread_cpu(r) - c0) / len(queries) * 1e6)
    for side, v in cpu.items():
        out[side]["server_cpu_us"] = round(pct(v, 0.5), 1)
    out["ratio_this_over_baseline"] = {k: round(out["this"][k] / out["baseline"][k], 3) for k in out["this"]}
    out["answers_differ"] = differ
    return out


def load_llmd(index: LlmdIndex, stores, batch: int) -> tuple[int, float]:
    n = 0
    buf: list[FleetStore] = []
    t0 = time.perf_counter()
    for s in stores:
        buf.append(s)
        n += len(s.hashes)
        if len(buf) >= batch:
            index.add(buf)
            buf = []
    if buf:
        index.add(buf)
    return n, time.perf_counter() - t0


def server_side(r: redis.Redis, store: RedisStore, llmd: "LlmdIndex | None", queries, weights) -> dict:
    """Redis-side execution time per lookup, from SLOWLOG with a 0 us threshold (no client, no network)."""
    r.config_set("slowlog-max-len", 400_000)
    r.config_set("slowlog-log-slower-than", 0)
    out: dict = {}
    try:
        r.slowlog_reset()
        for q in queries:
            store.lookup(q, weights=weights)
        durs = [e["duration"] for e in r.slowlog_get(len(queries) * 4) if e["command"].startswith(b"FCALL_RO")]
        out["kvbus"] = {"server_p50_ms": round(pct(durs, 0.5) / 1e3, 3),
                        "server_p99_ms": round(pct(durs, 0.99) / 1e3, 3)}
        if llmd is not None:
            r.slowlog_reset()
            for q in queries:
                llmd.lookup(q)
            entries = sorted((e for e in r.slowlog_get(len(queries) * (len(queries[0]) + 4))
                              if e["command"].startswith(b"HKEYS")), key=lambda e: e["id"])
            per = len(queries[0])
            sums = [sum(e["duration"] for e in entries[i:i + per]) for i in range(0, len(entries), per)]
            out["llmd"] = {"server_p50_ms": round(pct(sums, 0.5) / 1e3, 3),
                           "server_p99_ms": round(pct(sums, 0.99) / 1e3, 3)}
    finally:
        r.config_set("slowlog-log-slower-than", 10_000)
        r.slowlog_reset()
    return out


def measure(kind: str, store: RedisStore, llmd: "LlmdIndex | None", queries, args) -> dict:
    """Client-side latency of both layouts on ``queries`` (alternating), then Redis-side latency."""
    weights = Weights({"GPU": 1.0, "CPU": 0.8, "*": 0.0})
    lat_kv: list[float] = []
    lat_ll: list[float] = []
    holders: list[int] = []
    disagree = 0
    for q in queries:
        t = time.perf_counter()
        got = store.lookup(q, weights=weights)
        lat_kv.append(time.perf_counter() - t)
        holders.append(len(got))
        if llmd is not None:
            t = time.perf_counter()
            base_ans = llmd.lookup(q)
            lat_ll.append(time.perf_counter() - t)
            mine = {pod_identifier(int(h.replica[1:])): (h.matched, round(h.score, 4)) for h in got.values()}
            theirs = {p: (m, round(s, 4)) for p, (m, s) in base_ans.items()}
            disagree += mine != theirs
    out: dict = {"queries": len(queries), "holders_per_answer": round(sum(holders) / len(holders), 1),
                 "kvbus": {"p50_ms": round(pct(lat_kv, 0.5) * 1e3, 3), "p99_ms": round(pct(lat_kv, 0.99) * 1e3, 3)}}
    if llmd is not None:
        out["llmd"] = {"p50_ms": round(pct(lat_ll, 0.5) * 1e3, 3), "p99_ms": round(pct(lat_ll, 0.99) * 1e3, 3)}
        out["answers_disagree"] = disagree
    server = server_side(store.r, store, llmd, queries[: args.server_queries], weights)
    for side in server:
        out[side].update(server[side])
    if llmd is not None:
        out["ratio"] = {k: round(out["llmd"][k] / out["kvbus"][k], 2)
                        for k in ("p50_ms", "p99_ms", "server_p50_ms", "server_p99_ms")}
    print(f"{kind}-prefix lookups ({len(queries)}, {out['holders_per_answer']} holders per answer): "
          f"kvbus {out['kvbus']}; llm-d {out.get('llmd')}; answers that differ: {disagree}", flush=True)
    return out


def _fcall_stats(r: redis.Redis) -> dict[str, float]:
    """FCALL and FCALL_RO calls and usec from one node's INFO commandstats."""
    info = r.info("commandstats")
    out = {}
    for cmd in ("fcall", "fcall_ro"):
        st = info.get(f"cmdstat_{cmd}", {})
        out[cmd] = {"calls": int(st.get("calls", 0)), "usec": int(st.get("usec", 0))}
    return out


def _lat(store, queries, weights) -> tuple[list[float], list]:
    lat, answers = [], []
    for q in queries:
        t = time.perf_counter()
        answers.append(store.lookup(q, weights=weights))
        lat.append(time.perf_counter() - t)
    return lat, answers


def run_cluster(args) -> dict:
    """``--cluster``: single node vs the sharded view on 3 masters, same data, same queries."""
    weights = Weights({"GPU": 1.0, "CPU": 0.8, "*": 0.0})
    shard_counts = [int(x) for x in str(args.shards).split(",")]
    result: dict = {"mode": "cluster", "entries": None, "replicas": args.replicas, "chain": args.chain, "masters": 3}
    with RedisServer(["--maxmemory", args.maxmemory, "--maxmemory-policy", "noeviction"]) as srv, \
            RedisClusterServer(3) as cl:
        r0 = srv.client()
        single = RedisStore(r0, "kvbus:")
        stores, chains, bodies = fleet_workload(args.entries, replicas=args.replicas, copies=args.copies,
                                                cpu_frac=args.cpu_frac, seed=args.seed, min_chain=args.chain)
        stores = list(stores)  # loaded twice
        r0.config_resetstat()
        cpu0 = main_thread_cpu(r0)
        n, secs = load_kvbus(single, stores, batch=2000)
        result["entries"] = n
        result["single"] = {"load_entries_per_s": round(n / secs), "apply": _fcall_stats(r0)["fcall"],
                            "apply_cpu_seconds": round(main_thread_cpu(r0) - cpu0, 2)}
        print(f"single: loaded {n:,} entries in {secs:.1f}s; apply {result['single']['apply']}", flush=True)
        rc = cl.client()
        masters = [node for node in rc.get_primaries()]
        sharded_stores = {}
        for S in shard_counts:
            st = ShardedRedisStore(rc, f"kv{S}:", shards=S)
            for node in masters:
                node.redis_connection.config_resetstat()
            cpu0s = {node.name: main_thread_cpu(node.redis_connection) for node in masters}
            n2, secs2 = load_kvbus(st, stores, batch=2000)
            assert n2 == n
            per = {node.name: _fcall_stats(node.redis_connection)["fcall"] for node in masters}
            cpu = {node.name: round(main_thread_cpu(node.redis_connection) - cpu0s[node.name], 2) for node in masters}
            tot = sum(v["usec"] for v in per.values())
            busiest = max(v["usec"] for v in per.values())
            result[f"sharded_{S}"] = {
                "shards": S, "load_entries_per_s": round(n / secs2), "apply_per_master": per,
                "apply_cpu_seconds_per_master": cpu,
                "apply_max_master_cpu_over_single":
                    round(max(cpu.values()) / max(result["single"]["apply_cpu_seconds"], 1e-9), 3),
                "apply_usec_total": tot,
                "apply_max_master_share": round(busiest / max(tot, 1), 3),
                "apply_max_master_over_single": round(busiest / max(result["single"]["apply"]["usec"], 1), 3),
            }
            print(f"sharded S={S}: loaded in {secs2:.1f}s; apply us per master "
                  f"{ {k: v['usec'] for k, v in per.items()} } (single {result['single']['apply']['usec']}); "
                  f"main-thread CPU s per master {cpu} (single {result['single']['apply_cpu_seconds']})", flush=True)
            sharded_stores[S] = st
        S0 = shard_counts[-1]  # the largest count is also read from the replicas
        replica_reader = ShardedRedisStore(cluster_client(f"{cl.url}?read_from=replica"), f"kv{S0}:", shards=S0,
                                           load=False, read_from="replica")
        wait_replicas_in_sync(cl, replica_reader.rc)
        for kind, sample in (("shared", chains), ("private", bodies)):
            queries = query_set(sample, args.queries, args.chain)
            single.lookup(queries[0], weights=weights)
            out: dict = {"queries": len(queries)}
            lat1, ans1 = _lat(single, queries, weights)
            out["single"] = {"p50_ms": round(pct(lat1, 0.5) * 1e3, 3), "p99_ms": round(pct(lat1, 0.99) * 1e3, 3)}
            out["holders_per_answer"] = round(sum(map(len, ans1)) / len(ans1), 1)
            for S, st in sharded_stores.items():
                st.lookup(queries[0], weights=weights)
                for node in masters:
                    node.redis_connection.config_resetstat()
                lat2, ans2 = _lat(st, queries, weights)
                ro = {node.name: _fcall_stats(node.redis_connection)["fcall_ro"] for node in masters}
                out[f"sharded_{S}"] = {"p50_ms": round(pct(lat2, 0.5) * 1e3, 3),
                                       "p99_ms": round(pct(lat2, 0.99) * 1e3, 3),
                                       "answers_differ": sum(a != b for a, b in zip(ans1, ans2)),
                                       "redis_us_per_lookup_per_master": {k: round(v["usec"] / len(queries), 1)
                                                                          for k, v in ro.items()}}
            lat3, ans3 = _lat(replica_reader, queries, weights)
            out[f"sharded_{S0}_from_replicas"] = {"p50_ms": round(pct(lat3, 0.5) * 1e3, 3),
                                                  "p99_ms": round(pct(lat3, 0.99) * 1e3, 3),
                                                  "answers_differ": sum(a != b for a, b in zip(ans1, ans3))}
            print(f"{kind}-prefix lookups ({out['holders_per_answer']} holders per answer): {out}", flush=True)
            result[kind] = out
        rc.close()
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--entries", type=int, default=10_000_000, help="(replica, block, tier) entries to load")
    ap.add_argument("--replicas", type=int, default=256)
    ap.add_argument("--chain", type=int, default=128, help="blocks per lookup chain")
    ap.add_argument("--queries", type=int, default=2000)
    ap.add_argument("--server-queries", type=int, default=400, help="lookups timed Redis-side through SLOWLOG")
    ap.add_argument("--copies", type=int, default=1, help="replicas caching each conversation")
    ap.add_argument("--cpu-frac", type=float, default=0.5, help="share of caches also offloaded to CPU")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--maxmemory", default="4gb")
    ap.add_argument("--skip-llmd", action="store_true", help="kvbus layout only")
    ap.add_argument("--cluster", action="store_true",
                    help="single node vs the sharded view on a private 3-master Redis Cluster (default 1 M entries)")
    ap.add_argument("--shards", default="16", help="--cluster: virtual shards, or a comma list of counts to compare")
    ap.add_argument("--baseline", metavar="REV", help="also time git revision REV's kvbus_lookup on the same view")
    ap.add_argument("--hybrid-window", type=int, default=0, metavar="W",
                    help="every replica a hybrid model: a sliding-window group of W tokens too (implies --skip-llmd)")
    args = ap.parse_args(argv)
    if args.hybrid_window:
        args.skip_llmd = True
    if args.cluster:
        if args.entries == ap.get_default("entries"):
            args.entries = 1_000_000
        print(json.dumps(run_cluster(args)))
        return 0

    with RedisServer(["--maxmemory", args.maxmemory, "--maxmemory-policy", "noeviction"]) as srv:
        r0 = srv.client()
        store = RedisStore(r0, "kvbus:")
        base = used_memory(r0)
        stores, chains, bodies = fleet_workload(args.entries, replicas=args.replicas, copies=args.copies,
                                        cpu_frac=args.cpu_frac, seed=args.seed, min_chain=args.chain)
        n, secs = load_kvbus(store, stores, batch=2000, hybrid_window=args.hybrid_window)
        size = store.reader().size()
        assert size["entries"] == n, (size, n)
        kv_bytes = used_memory(r0) - base
        print(f"kvbus: loaded {n:,} entries ({size['blocks']:,} blocks) in {secs:.1f}s "
              f"({n / secs:,.0f} entries/s), {kv_bytes / n:.1f} bytes/entry", flush=True)
        result: dict = {
            "entries": n, "blocks": size["blocks"], "replicas": args.replicas, "chain": args.chain,
            "copies": args.copies, "cpu_frac": args.cpu_frac, "hybrid_window": args.hybrid_window,
            "kvbus": {"bytes_per_entry": round(kv_bytes / n, 2), "load_entries_per_s": round(n / secs)},
        }
        if args.baseline:
            load_baseline(r0, args.baseline)
        llmd = None
        if not args.skip_llmd:
            r1 = srv.client(db=1)
            llmd = LlmdIndex(r1)
            before = used_memory(r0)
            stores2, _, _ = fleet_workload(args.entries, replicas=args.replicas, copies=args.copies,
                                        cpu_frac=args.cpu_frac, seed=args.seed, min_chain=args.chain)
            n2, secs2 = load_llmd(llmd, stores2, batch=200)
            ll_bytes = used_memory(r0) - before
            print(f"llm-d: loaded {n2:,} entries in {secs2:.1f}s ({n2 / secs2:,.0f} entries/s), "
                  f"{ll_bytes / n2:.1f} bytes/entry", flush=True)
            result["llmd"] = {"bytes_per_entry": round(ll_bytes / n2, 2), "load_entries_per_s": round(n2 / secs2)}
            result["bytes_ratio_llmd_over_kvbus"] = round(ll_bytes / n2 / (kv_bytes / n), 2)

        for kind, sample in (("shared", chains), ("private", bodies)):
            queries = query_set(sample, args.queries, args.chain)
            result[kind] = measure(kind, store, llmd, queries, args)
            if args.baseline:
                result[kind]["baseline"] = {"rev": args.baseline, **measure_baseline(store, queries, args)}
                print(f"{kind}-prefix lookups, this tree next to {args.baseline}: {result[kind]['baseline']}",
                      flush=True)
        result["redis_used_memory_mb"] = round(used_memory(r0) / 2**20, 1)
        mem = r0.info("memory")
        result["lua_functions_heap_mb"] = round(int(mem.get("used_memory_vm_functions", 0)) / 2**20, 1)
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
