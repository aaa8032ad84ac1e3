"""How long a lost view takes to come back: snapshot to Kafka, then rebuild from it, at 10 M entries.

    .venv/bin/python benchmarks/rebuild.py                     # 10 M entries, 256 replicas
    .venv/bin/python benchmarks/rebuild.py --entries 1000000

What it does, on the real Kafka and registry (``infra/stack up``; started if not running) and a
throw-away ``redis-server`` (free port, no persistence):

1. loads a fleet residency into the view through the sink's write path (``benchmarks/lookup.py``'s
   ``load_kvbus``: ``kvbus.simulator.view_workload``, GPU and offloaded CPU tiers);
2. takes one snapshot (``kvbus.sinks.snapshot.SnapshotWriter``, what ``kvbus sink --snapshot-every`` runs)
   into a fresh snapshot topic;
3. rebuilds the view under a second prefix of the same server with ``kvbus.sinks.rebuild.rebuild`` (what
   a sink does when the view is gone): read the snapshot from Kafka, restore every holder;
4. checks the rebuilt view: same size, same per-holder summary, and the same answers to
   ``--queries`` lookups of cached chains.

The replay that follows a rebuild in production is the sink's normal work (its apply rate,
``benchmarks/sink.py``) on the records since the snapshot: at most ``--snapshot-every`` seconds of
traffic. The last line printed is one JSON object with the figures.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from confluent_kafka.admin import AdminClient  # noqa: E402

from kvbus.infra.scratch_redis import RedisServer  # noqa: E402
from kvbus.runtime.settings import Settings  # noqa: E402
from kvbus.simulator.view_workload import fleet_workload  # noqa: E402
from kvbus.sinks.rebuild import rebuild  # noqa: E402
from kvbus.sinks.snapshot import SnapshotReader, SnapshotWriter  # noqa: E402
from kvbus.sinks.view.redis_store import RedisStore  # noqa: E402
from lookup import load_kvbus, used_memory  # noqa: E402


def ensure_stack() -> Settings:
    """The running stack's settings (``infra/stack up`` first when it is not running)."""
    from kvbus.infra import stack

    if not stack.status().get("ready"):
        print("bringing the stack up ...", flush=True)
        stack.up()
    return Settings.from_env()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--entries", type=int, default=10_000_000, help="(replica, block, tier) entries in the view")
    ap.add_argument("--replicas", type=int, default=256)
    ap.add_argument("--cpu-frac", type=float, default=0.5, help="share of caches also offloaded to CPU")
    ap.add_argument("--queries", type=int, default=500, help="lookups compared between the view and its rebuild")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args(argv)

    base = ensure_stack()
    tag = uuid.uuid4().hex[:8]
    settings = dataclasses.replace(base, topics=dataclasses.replace(base.topics, snapshots=f"bench{tag}.snapshots"))
    admin = AdminClient({"bootstrap.servers": settings.bootstrap})
    try:
        with RedisServer(["--maxmemory", "8gb", "--maxmemory-policy", "noeviction"]) as srv:
            live = RedisStore(srv.client(), "live:")
            stores, chains, _ = fleet_workload(args.entries, replicas=args.replicas, cpu_frac=args.cpu_frac,
                                               seed=args.seed, min_chain=16)
            n, load_s = load_kvbus(live, stores, batch=2000)
            live.set_view_id("bench")
            size = live.reader().size()
            mem0 = used_memory(srv.client())
            print(f"view: {n:,} entries, {size['blocks']:,} blocks, {size['holders']} holders, loaded in "
                  f"{load_s:.1f} s; {mem0 / 2**20:.0f} MB in Redis", flush=True)

            t0 = time.perf_counter()
            stats = SnapshotWriter(settings, live).take()
            snap_s = time.perf_counter() - t0
            print(f"snapshot: {stats.holders} holders, {stats.entries:,} entries, {stats.bytes / 1e6:.1f} MB "
                  f"in {snap_s:.1f} s ({stats.entries / snap_s:,.0f} entries/s)", flush=True)

            rebuilt = RedisStore(srv.client(), "rebuilt:")
            reader = SnapshotReader(settings, "live:")  # the snapshot records are keyed by the live view
            t0 = time.perf_counter()
            rebuild(rebuilt, reader, lambda: {})
            rebuild_s = time.perf_counter() - t0
            st = rebuilt.status()
            read_s = float(st.get("read_in", 0))
            print(f"rebuild: {rebuild_s:.1f} s (snapshot read from Kafka in {read_s:.1f} s, restore "
                  f"{rebuild_s - read_s:.1f} s): {n / rebuild_s:,.0f} entries/s", flush=True)

            same_size = rebuilt.reader().size() == size
            same_summary = rebuilt.reader().summary() == live.reader().summary()
            queries = chains[: args.queries]
            same_answers = all(rebuilt.lookup(c) == live.lookup(c) for c in queries)
            print(f"check: size {same_size}, summary {same_summary}, {len(queries)} lookups {same_answers}")
            result = {
                "entries": n, "blocks": size["blocks"], "holders": size["holders"],
                "snapshot_s": round(snap_s, 2), "snapshot_mb": round(stats.bytes / 1e6, 1),
                "snapshot_entries_per_s": round(stats.entries / snap_s),
                "rebuild_s": round(rebuild_s, 2), "snapshot_read_s": round(read_s, 2),
                "restore_s": round(rebuild_s - read_s, 2), "rebuild_entries_per_s": round(n / rebuild_s),
                "rebuilt_equal": same_size and same_summary and same_answers,
            }
    finally:
        admin.delete_topics([settings.topics.snapshots])
    print(json.dumps(result))
    return 0 if result["rebuilt_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
