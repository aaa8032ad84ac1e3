"""Apply throughput of the sink's write path next to llm-d's Redis writes, on one private Redis.

    .venv/bin/python benchmarks/sink.py                     # 400k events over 256 replicas
    .venv/bin/python benchmarks/sink.py --events 2000000
    .venv/bin/python benchmarks/sink.py --cluster 3          # also the sharded view on a 3-master Redis Cluster

``--cluster N``: the same batches, with a view id and offsets as the sink writes them, applied to a
single Redis with one replica and to the sharded view on N masters with one replica each; the apply
work per master is its main-thread CPU (``INFO cpu``), next to FCALL usec (``INFO commandstats``),
which on a shared 2-core machine also counts the time a master waits for a core.

The event stream imitates what vLLM publishes per engine step, per replica (protocol doc §6):
BlockStored of 1 block (a decode step fills a block) or of a prompt's 2-32 new blocks (prefill),
one BlockRemoved per evicted hash, OffloadingConnector CPU stores, and kv_cache_report_mode=full
re-announcements of cached prefixes. Removals only name blocks the replica holds, so the view stays
at a steady size.

kvbus: ``RedisStore.apply`` on batches of ``--batch`` records (what the sink does per poll: one FCALL
per batch for all replicas; exactly-once positions and the per-replica index included); the time spent
inside Redis (``server_seconds``, from INFO commandstats) is reported next to the end-to-end time.
llm-d: the same events as ``redis.go`` writes them: HSET <block> <PodEntry JSON> "" per stored hash;
HDEL + its delete-if-empty Lua script per removed hash; pipelined per batch (no dedup, no positions,
no per-pod index). Both timed end to end from the same Python client. Also reported: memory per
(replica, block, tier) entry after the run (``used_memory`` delta; the view has seen removes and
re-adds, unlike benchmarks/lookup.py's bulk load), and Avro decoding cost per record
(``kvbus.schemas.codec``, and confluent's ``kvbus.schemas.serde`` path), the other half of the sink's
per-record work: of block layout 1 (a ``BlockEvent`` record per event) and of layout 2, what the worker
writes (a ``BlockEvents`` record per engine batch and holder: ``--packed-events`` events each), per
record and per event.

The last line printed is one JSON object with the figures.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from kvbus.infra.scratch_redis import RedisServer, main_thread_cpu, wait_replica_synced  # noqa: E402
from kvbus.schemas.codec import FastSerde  # noqa: E402
from kvbus.schemas.events import BlockEvent, BlockEvents, BlockRemoved, BlockStored, PositionedEvent  # noqa: E402
from kvbus.schemas.serde import RecordSerde, registry_client  # noqa: E402
from kvbus.sinks.view.redis_store import RedisStore  # noqa: E402
from lookup import pod_entry  # noqa: E402  (the llm-d layout lives in benchmarks/lookup.py)

TOPIC = "kvbus.blocks"
"""The track the events are applied under (:meth:`kvbus.schemas.topics.Topics.track`), and the topic of
the layout 1 records decoded."""
PACKED_TOPIC = "kvbus.blocks-packed"
"""The topic of the layout 2 records decoded (the registry subject is named after it)."""
LLMD_EVICT = """
if redis.call('HLEN', KEYS[1]) == 0 then return redis.call('DEL', KEYS[1]) end
return 0
"""


def event_stream(n: int, replicas: int, seed: int, capacity: int = 2000) -> list[tuple[str, BlockEvent]]:
    """``n`` events over ``replicas``, each replica keeping about ``capacity`` GPU and 2x that CPU blocks."""
    rng = random.Random(seed)
    gpu: list[list[bytes]] = [[] for _ in range(replicas)]
    cpu: list[list[bytes]] = [[] for _ in range(replicas)]
    fresh: list[list[bytes]] = [[] for _ in range(replicas)]  # stored on GPU, not offloaded yet
    seq = [0] * replicas
    out: list[tuple[str, BlockEvent]] = []
    ts = time.time()

    def evict(blocks: list[bytes]) -> bytes:
        i = rng.randrange(len(blocks))
        blocks[i], blocks[-1] = blocks[-1], blocks[i]
        return blocks.pop()

    while len(out) < n:
        r = rng.randrange(replicas)
        x = rng.random()
        mine = gpu[r]
        if len(mine) > capacity or (x < 0.40 and mine):  # vLLM: one BlockRemoved per evicted hash
            h = evict(mine)
            if h in fresh[r]:
                fresh[r].remove(h)
            ev = BlockRemoved(block_hashes=[h], medium="GPU")
        elif x < 0.75:  # decode fills one block, or a prefill stores a prompt's new blocks
            k = 1 if rng.random() < 0.7 else rng.randint(2, 32)
            new = [rng.getrandbits(64).to_bytes(8, "big") for _ in range(k)]
            mine.extend(new)
            fresh[r].extend(new)
            ev = BlockStored(block_hashes=new, medium="GPU", block_size=16)
        elif x < 0.85 and fresh[r]:  # OffloadingConnector copies new blocks to CPU
            k = min(len(fresh[r]), rng.randint(1, 16))
            new, fresh[r] = fresh[r][:k], fresh[r][k:]
            cpu[r].extend(new)
            ev = BlockStored(block_hashes=new, medium="CPU", block_size=16)
        elif x < 0.92 and len(cpu[r]) > 2 * capacity:
            ev = BlockRemoved(block_hashes=[evict(cpu[r])], medium="CPU")
        elif mine:  # kv_cache_report_mode=full: a cache hit re-announces a held prefix
            ev = BlockStored(block_hashes=mine[: rng.randint(1, min(len(mine), 16))], medium="GPU", block_size=16)
        else:
            continue
        out.append((TOPIC, BlockEvent(replica=f"r{r}", epoch=1, seq=seq[r], index=0, ts=ts, event=ev)))
        seq[r] += 1
    return out


def apply_llmd(r, sha: str, batch: list[tuple[str, BlockEvent]]) -> None:
    pipe = r.pipeline(transaction=False)
    for _, ev in batch:
        e = ev.event
        field = pod_entry(int(ev.replica[1:]), e.medium)
        for h in e.block_hashes:
            key = str(int.from_bytes(h, "big"))
            if isinstance(e, BlockStored):
                pipe.hset(key, field, "")
            else:
                pipe.hdel(key, field)
                pipe.evalsha(sha, 1, key)
    pipe.execute()


def used_memory(r) -> int:
    """The server's ``used_memory`` in bytes."""
    return int(r.info("memory")["used_memory"])


def apply_with_offsets(store, batches: list) -> float:
    """Apply ``batches`` as the sink does (a view id, each batch's offsets stored with it); seconds."""
    store.set_view_id("bench")
    t = time.perf_counter()
    for k, b in enumerate(batches):
        store.apply(b, view_id="bench", offsets={(TOPIC, 0): k + 1})
    return time.perf_counter() - t


def apply_cluster(batches: list, events: int, hashes: int, masters: int, shards: int) -> dict:
    """The same batches, applied as the sink does (view id and offsets with every batch), to a single
    Redis with one replica and then to the sharded view on a fresh Redis Cluster of ``masters``
    masters with one replica each. Per server: FCALL usec (``INFO commandstats``, wall time inside
    the calls) and main-thread CPU seconds (``INFO cpu``). On this 2-core machine every server and
    the client share the same cores, so a call's wall time includes time spent descheduled while
    another master runs; the CPU seconds are the work each master did, and the busiest master's
    CPU over the single node's is the scale-out figure. Also measured, on one server without a
    replica: the same calls' CPU on a plain server, on a one-node cluster (cluster mode's own cost),
    and with the batches split into ``shards`` shards there (the sharding's cost)."""
    from kvbus.infra.scratch_cluster import OneNodeCluster, RedisClusterServer
    from kvbus.sinks.view.sharded_store import ShardedRedisStore

    cost: dict[str, float] = {}  # where the cluster's extra work comes from, on one server, no replica
    with RedisServer() as srv:
        cpu0 = main_thread_cpu(srv.client())
        apply_with_offsets(RedisStore(srv.client(), "kvbus:"), batches)
        cost["plain"] = round(main_thread_cpu(srv.client()) - cpu0, 2)
    for s in sorted({1, shards}):
        with OneNodeCluster() as one:
            cpu0 = main_thread_cpu(one.client())
            apply_with_offsets(ShardedRedisStore(one.cluster_client(), "kvbus:", shards=s), batches)
            cost[f"cluster_mode_{s}_shards"] = round(main_thread_cpu(one.client()) - cpu0, 2)
    print(f"one server, main-thread CPU s: plain {cost['plain']}, in cluster mode (all slots) with 1 shard "
          f"{cost['cluster_mode_1_shards']}, with {shards} shards {cost[f'cluster_mode_{shards}_shards']}", flush=True)
    with RedisServer(["--maxmemory", "4gb"]) as srv, RedisServer() as rep:
        rep.client().replicaof("127.0.0.1", srv.port)
        wait_replica_synced(rep.client())
        store = RedisStore(srv.client(), "kvbus:")
        store.r.config_resetstat()
        cpu0 = main_thread_cpu(store.r)
        secs1 = apply_with_offsets(store, batches)
        single = {"events_per_s": round(events / secs1), "seconds": round(secs1, 2),
                  "cpu_seconds": round(main_thread_cpu(store.r) - cpu0, 2),
                  "fcall_seconds": round(store.r.info("commandstats").get("cmdstat_fcall", {}).get("usec", 0) / 1e6, 2)}
    with RedisClusterServer(masters) as cluster:
        store = ShardedRedisStore(cluster.client(), "kvbus:", shards=shards)
        prim = {node.name: node.redis_connection for node in cluster.client().get_primaries()}
        for r in prim.values():
            r.config_resetstat()
        cpu0s = {name: main_thread_cpu(r) for name, r in prim.items()}
        secs = apply_with_offsets(store, batches)
        cpu = {name: round(main_thread_cpu(r) - cpu0s[name], 2) for name, r in prim.items()}
        fcall = {name: round(cmd.get("fcall", {}).get("usec", 0) / 1e6, 2)
                 for name, cmd in store.commandstats().items()}
        calls = {name: cmd.get("fcall", {}).get("calls", 0) for name, cmd in store.commandstats().items()}
    out = {"masters": masters, "shards": shards, "single_with_replica": single, "one_server_cpu_seconds": cost,
           "events_per_s": round(events / secs), "hashes_per_s": round(hashes / secs), "seconds": round(secs, 2),
           "cpu_seconds_per_master": cpu, "fcall_seconds_per_master": fcall, "fcalls_per_master": calls,
           "busiest_master_cpu_over_single": round(max(cpu.values()) / max(single["cpu_seconds"], 1e-9), 3),
           "total_cpu_over_single": round(sum(cpu.values()) / max(single["cpu_seconds"], 1e-9), 3),
           "busiest_master_fcall_over_single": round(max(fcall.values()) / max(single["fcall_seconds"], 1e-9), 3)}
    print(f"single Redis + replica: {events / secs1:,.0f} events/s, main-thread CPU {single['cpu_seconds']} s, "
          f"FCALL {single['fcall_seconds']} s", flush=True)
    print(f"cluster ({masters} masters + replicas, {shards} shards): {events / secs:,.0f} events/s, CPU s per master "
          f"{sorted(cpu.values(), reverse=True)} (busiest {out['busiest_master_cpu_over_single']} "
          f"of the single node's, total {out['total_cpu_over_single']}x), "
          f"FCALL s per master {sorted(fcall.values(), reverse=True)}", flush=True)
    return out


def packed(sample: list[tuple[str, BlockEvent]], per_record: int) -> list[BlockEvents]:
    """``sample`` as block layout 2 records of ``per_record`` events of one replica each (the events of a
    record take the position ``(epoch, seq, i)`` of its first event's seq)."""
    by_replica: dict[str, list[BlockEvent]] = {}
    for _, ev in sample:
        by_replica.setdefault(ev.replica, []).append(ev)
    out = []
    for evs in by_replica.values():
        for i in range(0, len(evs), per_record):
            chunk, first = evs[i:i + per_record], evs[i]
            out.append(BlockEvents(replica=first.replica, epoch=first.epoch, seq=first.seq, ts=first.ts,
                                   events=[PositionedEvent(index=j, event=e.event) for j, e in enumerate(chunk)]))
    return out


def decode_figures(sample: list[tuple[str, BlockEvent]], per_record: int) -> dict[str, float]:
    """Avro decoding cost of ``sample``'s events, per record and per event, in both block layouts:
    FastSerde (schemas/codec.py, what the sink decodes with) and RecordSerde (confluent's path)."""
    registry = registry_client("mock://bench-sink")
    layouts = {"BlockEvent": (TOPIC, [ev for _, ev in sample]),
               "BlockEvents": (PACKED_TOPIC, packed(sample, per_record))}
    result: dict[str, float] = {}
    for kind, (topic, values) in layouts.items():
        blobs = [RecordSerde(registry, kind).dumps(v, topic) for v in values]
        label = "" if kind == "BlockEvent" else "packed_"
        for name, serde in ((f"{label}avro_decode_us_per_record", FastSerde(registry, kind, auto_register=False)),
                            (f"{label}confluent_avro_decode_us_per_record", RecordSerde(registry, kind))):
            t = time.perf_counter()
            for blob in blobs:
                serde.loads(blob, topic)
            secs = time.perf_counter() - t
            per = secs / len(blobs)
            result[name] = round(per * 1e6, 2)
            result[name.replace("per_record", "per_event")] = round(secs / len(sample) * 1e6, 2)
            print(f"{name}: {per * 1e6:.1f} us/record ({1 / per:,.0f} records/s on one core), "
                  f"{secs / len(sample) * 1e6:.2f} us/event")
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, default=400_000)
    ap.add_argument("--replicas", type=int, default=256)
    ap.add_argument("--batch", type=int, default=2000, help="records per apply (the sink's poll batch)")
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--packed-events", type=int, default=20,
                    help="events per block layout 2 record in the decode figures (default 20: ~a vLLM step)")
    ap.add_argument("--cluster", type=int, default=0, metavar="MASTERS",
                    help="also apply the same events to the sharded view on a Redis Cluster of this many masters "
                         "(each with a replica; all on this machine): events/s and the apply work per master")
    ap.add_argument("--shards", type=int, default=16, help="virtual shards of the sharded view (default 16)")
    args = ap.parse_args(argv)

    t = time.perf_counter()
    events = event_stream(args.events, args.replicas, args.seed)
    hashes = sum(len(ev.event.block_hashes) for _, ev in events)
    print(f"generated {len(events):,} events ({hashes:,} block hashes) in {time.perf_counter() - t:.1f}s", flush=True)
    batches = [events[i:i + args.batch] for i in range(0, len(events), args.batch)]
    result: dict = {"events": len(events), "hashes": hashes, "replicas": args.replicas, "batch": args.batch}

    with RedisServer(["--maxmemory", "4gb", "--maxmemory-policy", "noeviction"]) as srv:
        store = RedisStore(srv.client(), "kvbus:")
        store.r.config_resetstat()
        mem0 = used_memory(store.r)
        t = time.perf_counter()
        applied = 0
        for b in batches:
            applied += store.apply(b).applied
        secs = time.perf_counter() - t
        assert applied == len(events)
        fcall = store.r.info("commandstats").get("cmdstat_fcall", {})
        mem1 = used_memory(store.r)
        entries = store.reader().size()["entries"]
        again = store.apply(batches[0])
        assert again.applied == 0 and again.skipped == len(batches[0])
        result["kvbus"] = {"events_per_s": round(len(events) / secs), "hashes_per_s": round(hashes / secs),
                           "seconds": round(secs, 2), "entries_after": entries,
                           # memory after this churn (removes, re-adds): used_memory delta per entry
                           "bytes_per_entry": round((mem1 - mem0) / entries, 1),
                           # Redis-side share: time inside kvbus_apply (INFO commandstats), per event and per hash
                           "server_seconds": round(fcall.get("usec", 0) / 1e6, 2), "fcalls": fcall.get("calls", 0),
                           "server_us_per_hash": round(fcall.get("usec", 0) / hashes, 2)}
        print(f"kvbus: {len(events) / secs:,.0f} events/s ({hashes / secs:,.0f} hashes/s), {secs:.1f}s", flush=True)

        r1 = srv.client(db=1)
        sha = r1.script_load(LLMD_EVICT)
        t = time.perf_counter()
        for b in batches:
            apply_llmd(r1, sha, b)
        secs = time.perf_counter() - t
        result["llmd"] = {"events_per_s": round(len(events) / secs), "hashes_per_s": round(hashes / secs),
                          "seconds": round(secs, 2), "bytes_per_entry": round((used_memory(r1) - mem1) / entries, 1)}
        print(f"llm-d: {len(events) / secs:,.0f} events/s ({hashes / secs:,.0f} hashes/s), {secs:.1f}s", flush=True)
        result["ratio_kvbus_over_llmd"] = round(result["kvbus"]["events_per_s"] / result["llmd"]["events_per_s"], 2)

    if args.cluster:
        result["cluster"] = apply_cluster(batches, len(events), hashes, args.cluster, args.shards)

    result.update(decode_figures(events[:20000], args.packed_events))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
