"""Throughput of the streams stage: worker reports/s that ONE Faust worker process aggregates.

    .venv/bin/python benchmarks/streams.py [--replicas 16] [--steps 400] [--events 8] [--tp 2 4]

Needs the stack (``infra/stack status``). For each tensor-parallel degree it

1. writes a synthetic trace (simulator/tp_trace.py: every worker of a replica reports the same
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
from the block topic the worker writes (``kvbus.blocks-packed``; ``kvbus.blocks`` with
``KVBUS_STREAMS_BLOCK_LAYOUT=events``; worker batch wait, aggregation, output linger and delivery included).

With ``--paced R1,R2,...`` it measures instead what one worker costs at a steady load, as in the
pipeline but without the fleet, bridges and sink: for each rate (events/s) a fresh worker on fresh
topics, single-worker replicas (TP=1, pass-through) whose records a producer configured as a bridge's
(:func:`kvbus.runtime.kafka_clients.producer_conf`) writes at that rate, one engine step of every
replica at a time; over ``--window`` seconds after ``--warmup`` it reports the worker's and the
Kafka brokers' CPU (user + system, ``/proc``) per offered event (and the worker's per event it
produced in the window: the two differ when the worker falls behind), and, up to 5,000 events/s, the freshness of
each step: from producing its record to consuming its first consolidated event.

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

from block_topics import record_schema, written_topic  # noqa: E402  (benchmarks/block_topics.py)
from kvbus.children import free_port  # noqa: E402
from kvbus.runtime.settings import Settings  # noqa: E402
from kvbus.schemas.events import BlockRemoved, BlockStored, holder_key  # noqa: E402
from kvbus.schemas.serde import RecordSerde, registry_client  # noqa: E402
from kvbus.schemas.topics import Topics  # noqa: E402
from kvbus.simulator.tp_trace import TraceSpec, batches  # noqa: E402
from kvbus.streams.aggregation import Aggregator  # noqa: E402

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


def fresh_topics(settings: Settings, prefix: str) -> tuple[Topics, str]:
    """A run's topics (``<prefix>.raw``, ...), created, and the block topic its worker writes (the
    framework-owned one of the block layout ``KVBUS_STREAMS_BLOCK_LAYOUT`` says)."""
    topics = Topics(raw=f"{prefix}.raw", blocks=f"{prefix}.blocks", incomplete=f"{prefix}.incomplete",
                    dlq=f"{prefix}.dlq")
    blocks = written_topic(topics)
    ensure_topics(settings, [topics.raw, blocks, topics.incomplete, topics.dlq])
    return topics, blocks


def faust_worker(settings: Settings, spec: TraceSpec, trace: list, workdir: Path) -> dict:
    suffix = uuid.uuid4().hex[:8]
    topics, _ = fresh_topics(settings, f"bench{suffix}")
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
        if r_first >= total_reports or elapsed <= 0:
            # a trace short enough for the worker to apply all of it between two scrapes: nothing left to
            # time (the figures below would divide by zero), so no rate and no CPU figure
            print(f"  all {total_reports} reports applied before the first scrape that saw any: too short a "
                  "trace to time (more --steps)", flush=True)
            return {"reports": total_reports, "seconds": round(elapsed, 3), "reports_per_s": None,
                    "consolidated": want, "cpu_us_per_raw_record": None}
        # the scrape that saw the first reports missed up to one poll of work: count from there
        rate = (total_reports - r_first) / elapsed
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
    topics, blocks = fresh_topics(settings, f"lat{suffix}")
    spec = TraceSpec(replicas=1, workers=workers, steps=steps + 20, events_per_batch=8, tier=None,
                     prefix=f"lat{suffix}", seed=1)
    by_step: dict[int, list] = defaultdict(list)
    for b in batches(spec):
        by_step[b.seq].append(b)
    registry = registry_client(settings)
    serde, out_serde = RecordSerde(registry, "EventBatch"), RecordSerde(registry, record_schema(topics, blocks))
    producer = Producer({"bootstrap.servers": settings.bootstrap, "linger.ms": 0, "enable.idempotence": True})
    consumer = Consumer({"bootstrap.servers": settings.bootstrap, "group.id": f"lat-{suffix}",
                         "auto.offset.reset": "earliest", "fetch.wait.max.ms": 5})
    consumer.subscribe([blocks])
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


def broker_pids() -> list[int]:
    """Pids of the stack's Kafka brokers (infra's pid files)."""
    from kvbus.infra.procs import read_pid
    from kvbus.infra.stack_env import Paths

    recs = [read_pid(pf) for pf in sorted(Paths().run.glob("kafka*.pid"))]
    return [r.pid for r in recs if r is not None]


def paced(settings: Settings, rate: float, events: int, replicas: int, warmup: float, window: float,
          workdir: Path) -> dict:
    """One worker at ``rate`` events/s (module doc): CPU per event of the worker and of Kafka, and the
    freshness of steps up to 5,000 events/s."""
    from confluent_kafka import Consumer

    from kvbus.runtime.kafka_clients import producer_conf

    suffix = uuid.uuid4().hex[:8]
    topics, blocks = fresh_topics(settings, f"paced{suffix}")
    steps = int(rate * (warmup + window + 2) / (events * replicas)) + 20
    spec = TraceSpec(replicas=replicas, workers=1, steps=steps, events_per_batch=events, tier=None,
                     prefix=f"paced{suffix}", seed=3)
    registry = registry_client(settings)
    serde, out_serde = RecordSerde(registry, "EventBatch"), RecordSerde(registry, record_schema(topics, blocks))
    records = [(serde.dumps(b, topics.raw), holder_key(b.replica, b.dp_rank).encode(), b.seq) for b in batches(spec)]
    producer = Producer(producer_conf(settings.kafka(), {"client.id": "paced-bridge"}))
    measure_fresh = rate <= 5000
    consumer = None
    if measure_fresh:
        consumer = Consumer({"bootstrap.servers": settings.bootstrap, "group.id": f"paced-{suffix}",
                             "auto.offset.reset": "earliest", "fetch.wait.max.ms": 5})
        consumer.subscribe([blocks])
    port = free_port()
    proc = start_worker(settings, topics, workdir, suffix, port)
    kafka = broker_pids()
    sent: dict[int, float] = {}
    seen: dict[int, float] = {}
    try:
        for value, key, _ in records[:replicas * 20]:  # until the worker consolidates (group join)
            producer.produce(topics.raw, value, key)
        producer.flush()
        deadline = time.time() + 120
        want = replicas * 20 * events
        while time.time() < deadline and scrape(port).get("kvbus_streams_passthrough_total", 0) < want:
            time.sleep(0.2)
        i = replicas * 20
        per_step = events * replicas
        start = time.perf_counter()
        marks: dict[str, tuple] = {}
        step = 0
        while i + replicas <= len(records):
            now = time.perf_counter()
            if "a" not in marks and now - start >= warmup:
                marks["a"] = (now, cpu_seconds(proc.pid), sum(cpu_seconds(p) for p in kafka),
                              scrape(port).get("kvbus_streams_passthrough_total", 0))
            if now - start >= warmup + window:
                marks["b"] = (now, cpu_seconds(proc.pid), sum(cpu_seconds(p) for p in kafka),
                              scrape(port).get("kvbus_streams_passthrough_total", 0))
                break
            due = start + step * per_step / rate
            if now >= due:
                seq = records[i][2]
                for value, key, _ in records[i:i + replicas]:
                    producer.produce(topics.raw, value, key)
                if measure_fresh and "a" in marks:
                    sent[seq] = time.perf_counter()
                i += replicas
                step += 1
                producer.poll(0)
                continue
            if consumer is not None:
                for msg in consumer.consume(1000, min(0.001, max(0.0, due - now))):
                    if msg.error() is None:
                        seen.setdefault(out_serde.loads(msg.value(), msg.topic()).seq, time.perf_counter())
            else:
                time.sleep(min(0.001, max(0.0, due - now)))
        end = time.time() + 3
        while consumer is not None and time.time() < end and not set(sent) <= set(seen):
            for msg in consumer.consume(1000, 0.05):
                if msg.error() is None:
                    seen.setdefault(out_serde.loads(msg.value(), msg.topic()).seq, time.perf_counter())
        producer.flush(10)
    finally:
        if consumer is not None:
            consumer.close()
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
    if "b" not in marks:
        raise RuntimeError(f"the trace ran out before the window ended ({len(records)} records)")
    (t0, w0, k0, e0), (t1, w1, k1, e1) = marks["a"], marks["b"]
    offered = (t1 - t0) * rate
    r = {"rate": rate, "offered_events": round(offered), "worker_events_s": round((e1 - e0) / (t1 - t0)),
         "worker_us_per_event": round(1e6 * (w1 - w0) / offered, 2),
         "kafka_us_per_event": round(1e6 * (k1 - k0) / offered, 2),
         "worker_us_per_event_out": round(1e6 * (w1 - w0) / max(1.0, e1 - e0), 2),
         "worker_cores": round((w1 - w0) / (t1 - t0), 3), "kafka_cores": round((k1 - k0) / (t1 - t0), 3)}
    if measure_fresh:
        print(f"  freshness: {len(sent)} steps sent, {len(seen)} seen", flush=True)
        ms = sorted(1000 * (seen[k] - t) for k, t in sent.items() if k in seen)
        if ms:
            pick = lambda q: round(ms[min(len(ms) - 1, int(q * len(ms)))], 1)  # noqa: E731
            r.update({"fresh_steps": len(sent), "fresh_seen": len(ms), "fresh_p50_ms": pick(0.5),
                      "fresh_p99_ms": pick(0.99), "fresh_max_ms": round(ms[-1], 1)})
    return r


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replicas", type=int, default=16)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--events", type=int, default=8, help="events per engine step (per worker batch)")
    p.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    p.add_argument("--workdir", help="keep worker logs and data here (default: a temporary directory)")
    p.add_argument("--latency", type=int, default=0, metavar="STEPS",
                   help="also measure freshness at low load over this many steps (TP of the first --tp)")
    p.add_argument("--paced", metavar="RATES",
                   help="events/s, comma-separated: measure a worker's and Kafka's CPU per event at each (module doc)")
    p.add_argument("--paced-replicas", type=int, default=8, help="replicas of --paced (default 8)")
    p.add_argument("--paced-events", type=int, default=16, help="events per engine step of --paced (default 16)")
    p.add_argument("--warmup", type=float, default=3.0, help="seconds of each --paced rate before its window")
    p.add_argument("--window", type=float, default=10.0, help="seconds of each --paced rate's window")
    args = p.parse_args(argv)
    settings = Settings.from_env()
    if args.paced:
        out: dict = {"cpus": os.cpu_count(), "loadavg_1m_at_start": round(os.getloadavg()[0], 2),
                     "events_per_record": args.paced_events, "replicas": args.paced_replicas}
        with tempfile.TemporaryDirectory(prefix="kvbus-bench-streams-") as tmp:
            for rate in (float(x) for x in args.paced.split(",")):
                r = paced(settings, rate, args.paced_events, args.paced_replicas, args.warmup, args.window,
                          Path(args.workdir or tmp))
                out[f"paced_{rate:g}"] = r
                fresh = (f"; freshness p50 {r['fresh_p50_ms']} ms, p99 {r['fresh_p99_ms']} ms"
                         if "fresh_p50_ms" in r else "")
                print(f"  {rate:g} events/s: worker {r['worker_us_per_event']} us/event ({r['worker_cores']} cores, "
                      f"{r['worker_events_s']} events/s out), kafka {r['kafka_us_per_event']} us/event{fresh}",
                      flush=True)
        out["loadavg_1m_at_end"] = round(os.getloadavg()[0], 2)
        print(json.dumps(out))
        return 0
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
                "faust_over_counter": (None if f["reports_per_s"] is None
                                       else round(f["reports_per_s"] / (reports / c_s), 4)),
                "reports": reports,
                "consolidated": common,
                "meets_target": None if f["reports_per_s"] is None else f["reports_per_s"] >= TARGET,
            }
            results[f"tp{tp}"] = r
            rate = r["faust_worker_reports_per_s"]
            print(f"  faust worker {'(not timed)' if rate is None else f'{rate:,}'} reports/s "
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
