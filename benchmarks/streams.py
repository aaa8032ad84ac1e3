"""Throughput of the streams stage: worker reports/s that ONE Faust worker process aggregates.

    .venv/bin/python benchmarks/streams.py [--replicas 16] [--steps 400] [--events 8] [--tp 2 4]

Needs the stack (``infra/stack status``). For each tensor-parallel degree it

1. writes a synthetic trace (tests/trace.py: every worker of a replica reports the same
   ``--events`` events per engine step) to a fresh raw topic, before the worker starts;
2. starts one ``python -m kvbus.streams worker`` subprocess and scrapes its Prometheus endpoint:
   the rate is reports applied / time from the first applied report until every consolidated
   event has been produced and acknowledged (decode, aggregate, encode, produce, state writes);
3. runs the same trace (already decoded) through the in-process aggregation module alone, and
   through a plain ``collections.Counter`` per engine step like vLLM's KVEventAggregator
   (the baseline), and reports faust/baseline as a ratio.

With ``--latency N`` it then measures freshness at low load: a fresh worker, one engine step
(every worker's record) every 50 ms for N steps, each produced at once (no linger); the latency
of a step is from producing its last worker record to consuming its first consolidated event
from ``kvbus.blocks`` (worker batch wait, aggregation, output linger and delivery included).

The last line is one JSON object with all figures.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections import Counter, defaultdict
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from confluent_kafka import Producer  # noqa: E402

from kvbus.children import free_port  # noqa: E402
from kvbus.schemas.events import BlockRemoved, BlockStored, holder_key  # noqa: E402
from kvbus.schemas.serde import RecordSerde, registry_client  # noqa: E402
from kvbus.schemas.settings import Settings  # noqa: E402
from kvbus.schemas.topics import Topics  # noqa: E402
from kvbus.streams.aggregation import Aggregator  # noqa: E402
from tests.trace import TraceSpec, batches  # noqa: E402

TARGET = 100_000


def vllm_key(e) -> tuple:
    """vLLM's KVCacheEvent.__hash__ input: every field but lora_name (BlockStored)."""
    if type(e) is BlockStored:
        return (tuple(e.block_hashes), e.parent_block_hash, tuple(e.token_ids), e.block_size,
                e.lora_id, e.medium, e.extra_keys, e.group_idx, e.kv_cache_spec_kind,
                e.kv_cache_spec_sliding_window, e.locality, e.ownership)
    if type(e) is BlockRemoved:
        return (tuple(e.block_hashes), e.medium, e.group_idx, e.locality, e.ownership)
    return (type(e).__name__,)


def counter_baseline(trace: list, workers: int) -> tuple[float, int]:
    """vLLM's rule in-process: per (holder, step) a Counter over all workers' events; keep
    those whose count equals the worker count. Returns (seconds, common events)."""
    steps: dict[tuple, list] = defaultdict(list)
    for b in trace:
        steps[(b.replica, b.dp_rank, b.seq)].append(b.events)
    groups = list(steps.values())
    t0 = time.perf_counter()
    common = 0
    for per_worker in groups:
        counter: Counter = Counter()
        for events in per_worker:
            counter.update(vllm_key(e) for e in events)
        common += sum(1 for e in per_worker[0] if counter[vllm_key(e)] == workers)
    return time.perf_counter() - t0, common


def aggregator_only(trace: list, topics: Topics) -> tuple[float, int]:
    """The streams aggregation module alone on decoded batches (no Kafka, no codec)."""
    agg = Aggregator(topics, window=3600)
    out: list = []
    t0 = time.perf_counter()
    for b in trace:
        agg.apply(b, 0, 0.0, out)
    return time.perf_counter() - t0, len(out)




def scrape(port: int) -> dict[str, float]:
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        m = re.match(r"^(kvbus_streams_\w+_total)(\{[^}]*\})? ([0-9.e+]+)$", line)
        if m:
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds process ``pid`` has used (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def ensure_topics(settings: Settings, names: list[str]) -> None:
    from kvbus.infra.dev_topics import ensure_topics as create

    create(settings.bootstrap, names, settings.partitions, 1)


def faust_worker(settings: Settings, spec: TraceSpec, trace: list, workdir: Path) -> dict:
    suffix = uuid.uuid4().hex[:8]
    topics = Topics(raw=f"bench{suffix}.raw", blocks=f"bench{suffix}.blocks",
                    incomplete=f"bench{suffix}.incomplete", dlq=f"bench{suffix}.dlq")
    ensure_topics(settings, [topics.raw, topics.blocks, topics.incomplete, topics.dlq])
    serde = RecordSerde(registry_client(settings), "EventBatch")
    # idempotent like every kvbus producer: a retried request must not land after a later one, or the
    # worker reads a worker's seq 1 before its seq 0, ignores seq 0 as a redelivery, and its
    # aggregates never complete (the run then waits for a consolidated count it cannot reach)
    producer = Producer({"bootstrap.servers": settings.bootstrap, "linger.ms": 20, "compression.type": "lz4",
                         "queue.buffering.max.messages": 2_000_000, "enable.idempotence": True})
    t0 = time.perf_counter()
    for b in trace:
        producer.produce(topics.raw, serde.dumps(b, topics.raw), holder_key(b.replica, b.dp_rank).encode())
        producer.poll(0)
    producer.flush()
    print(f"  produced {len(trace)} raw records in {time.perf_counter() - t0:.1f}s", flush=True)

    port = free_port()
    profile = os.environ.get("KVBUS_BENCH_PROFILE")  # write a cProfile of the worker there
    proc = start_worker(settings, topics, workdir, suffix, port,
                        profile=f"{profile}.tp{spec.workers}" if profile else None)
    total_reports = sum(len(b.events) for b in trace)
    want = total_reports // spec.workers
    first = None
    try:
        deadline = time.time() + 600
        while time.time() < deadline:
            m = scrape(port)
            reports = m.get("kvbus_streams_reports_total", 0.0)
            now = time.perf_counter()
            if first is None and reports > 0:
                first = (now, reports)
                cpu_first = cpu_seconds(proc.pid)
            if m.get("kvbus_streams_consolidated_total", 0.0) >= want:
                break
            if proc.poll() is not None:
                raise RuntimeError(f"worker exited (exit code {proc.returncode}): "
                                   "see its log worker-*.log in the work directory")
            time.sleep(0.1)
        else:
            raise RuntimeError("timed out")
        end = time.perf_counter()
        cpu = cpu_seconds(proc.pid) - cpu_first
        t_first, r_first = first
        elapsed = end - t_first
        # the scrape that saw the first reports missed up to one poll of work: count from there
        rate = (total_reports - r_first) / elapsed if elapsed > 0 else float("inf")
        records = (total_reports - r_first) / (total_reports / len(trace))
        return {"reports": total_reports, "seconds": round(elapsed, 3), "reports_per_s": round(rate),
                "consolidated": want, "cpu_us_per_raw_record": round(1e6 * cpu / records, 1)}
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()


def start_worker(settings: Settings, topics: Topics, workdir: Path, suffix: str, port: int,
                 profile: str | None = None) -> subprocess.Popen:
    """One ``python -m kvbus.streams worker`` on ``topics`` with metrics on ``port`` (``profile``: write a
    cProfile of it to this path)."""
    env = {**os.environ, **replace(settings, topics=topics).to_env(),
           "KVBUS_STREAMS_APP_ID": f"bench-{suffix}", "KVBUS_STREAMS_DATADIR": str(workdir / suffix),
           "KVBUS_STREAMS_WINDOW": "600", "KVBUS_STREAMS_METRICS_PORT": str(port)}
    log = open(workdir / f"worker-{suffix}.log", "w")
    prefix = [sys.executable] + (["-m", "cProfile", "-o", profile] if profile else [])
    return subprocess.Popen(prefix + ["-m", "kvbus.streams", "worker", "-l", "info"], cwd=REPO, env=env,
                            stdout=log, stderr=subprocess.STDOUT)


def latency(settings: Settings, steps: int, workers: int, workdir: Path) -> dict:
    """Freshness at low load (module doc): milliseconds from a step's last raw record to its
    first consolidated event, as p50 / p90 / p99 / max over ``steps`` steps."""
    from confluent_kafka import Consumer

    suffix = uuid.uuid4().hex[:8]
    topics = Topics(raw=f"lat{suffix}.raw", blocks=f"lat{suffix}.blocks",
                    incomplete=f"lat{suffix}.incomplete", dlq=f"lat{suffix}.dlq")
    ensure_topics(settings, [topics.raw, topics.blocks, topics.incomplete, topics.dlq])
    spec = TraceSpec(replicas=1, workers=workers, steps=steps + 20, events_per_batch=8, tier=None,
                     prefix=f"lat{suffix}", seed=1)
    by_step: dict[int, list] = defaultdict(list)
    for b in batches(spec):
        by_step[b.seq].append(b)
    registry = registry_client(settings)
    serde, out_serde = RecordSerde(registry, "EventBatch"), RecordSerde(registry, "BlockEvent")
    producer = Producer({"bootstrap.servers": settings.bootstrap, "linger.ms": 0, "enable.idempotence": True})
    consumer = Consumer({"bootstrap.servers": settings.bootstrap, "group.id": f"lat-{suffix}",
                         "auto.offset.reset": "earliest", "fetch.wait.max.ms": 5})
    consumer.subscribe([topics.blocks])
    port = free_port()
    proc = start_worker(settings, topics, workdir, suffix, port)
    sent: dict[int, float] = {}
    seen: dict[int, float] = {}
    try:
        for warm in range(20):  # until the worker consolidates (group join, recovery)
            for b in by_step[warm]:
                producer.produce(topics.raw, serde.dumps(b, topics.raw), holder_key(b.replica, b.dp_rank).encode())
            producer.flush()
        deadline = time.time() + 120
        while time.time() < deadline and scrape(port).get("kvbus_streams_consolidated_total", 0) < 8 * 20:
            consumer.poll(0.1)
        for step in range(20, steps + 20):
            next_at = time.perf_counter() + 0.05
            for b in by_step[step]:
                producer.produce(topics.raw, serde.dumps(b, topics.raw), holder_key(b.replica, b.dp_rank).encode())
            producer.poll(0)
            sent[step] = time.perf_counter()
            producer.flush()
            while (left := next_at - time.perf_counter()) > 0:
                msg = consumer.poll(left)
                if msg is not None and msg.error() is None:
                    seq = out_serde.loads(msg.value(), msg.topic()).seq
                    seen.setdefault(seq, time.perf_counter())
        end = time.time() + 5
        while time.time() < end and not set(sent) <= set(seen):
            msg = consumer.poll(0.1)
            if msg is not None and msg.error() is None:
                seen.setdefault(out_serde.loads(msg.value(), msg.topic()).seq, time.perf_counter())
    finally:
        consumer.close()
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
    ms = sorted(1000 * (seen[k] - t) for k, t in sent.items() if k in seen)
    if not ms:
        raise RuntimeError("no consolidated event seen")
    pick = lambda q: round(ms[min(len(ms) - 1, int(q * len(ms)))], 1)  # noqa: E731
    return {"steps": len(sent), "seen": len(ms), "p50_ms": pick(0.5), "p90_ms": pick(0.9), "p99_ms": pick(0.99),
            "max_ms": round(ms[-1], 1)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replicas", type=int, default=16)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--events", type=int, default=8, help="events per engine step (per worker batch)")
    p.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    p.add_argument("--workdir", help="keep worker logs and data here (default: a temporary directory)")
    p.add_argument("--latency", type=int, default=0, metavar="STEPS",
                   help="also measure freshness at low load over this many steps (TP of the first --tp)")
    args = p.parse_args(argv)
    settings = Settings.from_env()
    results: dict = {"target_reports_per_s": TARGET, "events_per_batch": args.events, "replicas": args.replicas,
                     "partitions": settings.partitions, "cpus": os.cpu_count(),
                     "loadavg_1m_at_start": round(os.getloadavg()[0], 2)}
    with tempfile.TemporaryDirectory(prefix="kvbus-bench-streams-") as tmp:
        if args.workdir:
            tmp = args.workdir
            Path(tmp).mkdir(parents=True, exist_ok=True)
        for tp in args.tp:
            spec = TraceSpec(replicas=args.replicas, workers=tp, steps=args.steps // (tp // 2 or 1),
                             events_per_batch=args.events, prefix=f"bench{tp}", seed=tp)
            trace = list(batches(spec))
            print(f"TP={tp}: {len(trace)} raw records, {sum(len(b.events) for b in trace)} worker reports", flush=True)
            c_s, common = counter_baseline(trace, tp)
            reports = sum(len(b.events) for b in trace)
            a_s, outs = aggregator_only(trace, Topics())
            assert outs == common, (outs, common)
            f = faust_worker(settings, spec, trace, Path(tmp))
            r = {
                "faust_worker_reports_per_s": f["reports_per_s"],
                "faust_worker_seconds": f["seconds"],
                "faust_worker_cpu_us_per_raw_record": f["cpu_us_per_raw_record"],
                "aggregation_module_reports_per_s": round(reports / a_s),
                "vllm_counter_reports_per_s": round(reports / c_s),
                "faust_over_counter": round(f["reports_per_s"] / (reports / c_s), 4),
                "reports": reports,
                "consolidated": common,
                "meets_target": f["reports_per_s"] >= TARGET,
            }
            results[f"tp{tp}"] = r
            print(f"  faust worker {r['faust_worker_reports_per_s']:,} reports/s "
                  f"({r['faust_worker_cpu_us_per_raw_record']} CPU us per raw record); aggregation module alone "
                  f"{r['aggregation_module_reports_per_s']:,}/s; vLLM Counter {r['vllm_counter_reports_per_s']:,}/s; "
                  f"ratio faust/counter {r['faust_over_counter']}", flush=True)
        if args.latency:
            lat = latency(settings, args.latency, args.tp[0], Path(tmp))
            results[f"latency_tp{args.tp[0]}"] = lat
            print(f"  low load, TP={args.tp[0]}: last raw record -> first consolidated event p50 {lat['p50_ms']} ms, "
                  f"p99 {lat['p99_ms']} ms, max {lat['max_ms']} ms ({lat['seen']} of {lat['steps']} steps)", flush=True)
    results["loadavg_1m_at_end"] = round(os.getloadavg()[0], 2)
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
