"""Whole-pipeline speed on the real stack: offered load, sustained capacity, freshness, CPU per process.

    .venv/bin/python benchmarks/pipeline.py                          # TP=1, one worker, one sink
    .venv/bin/python benchmarks/pipeline.py --tp 2 --rates 1000,5000,12500,25000
    .venv/bin/python benchmarks/pipeline.py --workers-procs 2 --sinks 2
    .venv/bin/python benchmarks/pipeline.py --streams-per-bridge 8   # one node-level bridge for 8 engines

Path, every part a real process: ``kvbus fleet`` (synthetic vLLM 0.33 replicas, ZMQ PUB + replay)
-> ``kvbus bridge`` processes, each serving ``--streams-per-bridge`` engine streams (default 1: one
per stream, as sidecars; more: ``kvbus bridge --streams``, as node-level bridges) -> ``<run>.raw``
-> W ``kvbus worker`` processes (Faust)
-> ``<run>.blocks-packed*`` (block layout 2; ``<run>.blocks*`` with ``KVBUS_STREAMS_BLOCK_LAYOUT=events``)
-> S ``kvbus sink`` processes -> Redis, under fresh topics, consumer groups and
Redis prefix per run (all deleted at the end; ``--keep`` leaves them).

**Generator.** The fleet generates and encodes its whole schedule before the ladder starts
(``kvbus fleet --pregenerate``) and then only sends pre-encoded frames (each restamped with the
time it is sent), so that the ladder measures kvbus, not the simulator; ``--live-generator``
generates while playing (costs ~20-40 µs of CPU per event on the same cores). The ground truth
and the probes are the same either way.

**Load ladder.** The fleet plays a schedule: an idle rung, then each ``--rates`` rung (engine
events/s offered by the whole fleet; the fleet paces its steps by the events they publish) for
``--warmup + --window`` seconds, each followed by ``--gap`` idle seconds. Figures of a rung come
from its steady window: offered events/s (bridge acknowledgements / TP), consolidated (worker)
and applied (sink) events/s, consumer lag of both hops (committed offsets, sampled each second).
A rung *sustains* its load when neither hop's lag grows by more than ``--lag-growth`` of the records
written to that hop during the window, and freshness p99 stays under 1 s (lag that a growing
backlog would hide in committed offsets shows here). The ladder stops after the first rung that
does not (``--keep-going`` plays all). **Sustained capacity** = the highest offered rate sustained.

**Freshness, in band.** The fleet publishes a probe every ``--probe-every`` seconds: a one-block
``BlockStored`` of a fresh random hash, sent to the next replica in turn through the same ZMQ
stream, bridge, topics, worker and sink as the load. This process polls ``RedisStore.lookup`` (one
``FCALL_RO``, as a router calls it) for every outstanding probe, and a probe's freshness is the time
from its publication (the fleet's ``time.monotonic()`` after sending; one clock for both processes)
to the reply of the first lookup that finds it. Resolution: the polling period (~1 ms when few
probes are outstanding) plus one lookup round trip.

**CPU.** User + system seconds of every process over the window (``/proc/<pid>/stat``), per kind:
fleet (the generator), bridge, worker, sink, kafka, registry, redis, lookups and bench (this process's
probe lookups and sampling). ``lookups`` is the time Redis spent running the probes' ``FCALL_RO``
lookups (``INFO commandstats``, ``cmdstat_fcall_ro``), taken out of ``redis``: a router's reads, not
the cost of carrying events (~700 lookups/s at 15,000 events/s, polled every ~1 ms while probes are
outstanding; Redis's network and parsing for them stay in ``redis``). All are given per 1,000
offered engine events (``cpu_s_per_1k_events``) and
in µs per offered engine event (``us_per_event``); ``kvbus_us_per_event`` is the sum over the kvbus
path alone (bridge, worker, sink, kafka, redis: :data:`KVBUS_KINDS`), without the generator, the
registry and this process. ``--workers-procs 2 --sinks 2`` also prints each
process's share of records and CPU (on 2 cores this shows the work spread, not a speed-up).

**Exactness.** After the last rung the pipeline drains and the view is compared, holder by holder
and tier by tier, with the fleet's ground truth (its manifest): ``view_exact``.

Each rung prints one line; the last line is one JSON object with every figure.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import re
import statistics
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Optional

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import redis  # noqa: E402

from block_topics import block_events, record_schema, written_topic  # noqa: E402  (benchmarks/block_topics.py)
from kvbus.children import Children, cpu_seconds, free_port, free_port_block, wait_for  # noqa: E402
from kvbus.demo_progress import GroupLag, scrape_all  # noqa: E402
from kvbus.runtime.settings import Settings  # noqa: E402
from kvbus.schemas.topics import Topics  # noqa: E402
from kvbus.sinks.view.redis_store import RedisStore  # noqa: E402
from kvbus.sinks.view.store_url import open_store  # noqa: E402

log = logging.getLogger("kvbus.bench")

KINDS = ("fleet", "bridge", "worker", "sink", "kafka", "registry", "redis", "lookups", "bench")
"""Process kinds whose CPU is reported (``bench``: this process, probe lookups and sampling;
``lookups``: the time Redis spent running the probes' lookups, taken out of ``redis``)."""
KVBUS_KINDS = ("bridge", "worker", "sink", "kafka", "redis")
"""The kinds that make up the kvbus path (``kvbus_us_per_event``): not the load generator, the
benchmark's probes and sampling, nor the registry (asked once per schema at start)."""


# -- options -----------------------------------------------------------------------------

def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replicas", type=int, default=8, help="engine replicas (default 8)")
    p.add_argument("--tp", type=int, default=1, choices=(1, 2, 4),
                   help="tensor-parallel workers per replica (default 1)")
    p.add_argument("--workers-procs", type=int, default=1, help="Faust worker processes W (default 1)")
    p.add_argument("--sinks", type=int, default=1, help="sink processes S (default 1)")
    p.add_argument("--rates", default="2000,5000,10000,20000,35000,50000",
                   help="offered engine events/s of each rung, comma-separated (default 2000,...,50000)")
    p.add_argument("--idle", type=float, default=6.0, help="seconds of the first, idle rung (probes only; default 6)")
    p.add_argument("--warmup", type=float, default=3.0, help="seconds of each rung before its window (default 3)")
    p.add_argument("--window", type=float, default=10.0, help="seconds of each rung's steady window (default 10)")
    p.add_argument("--gap", type=float, default=4.0, help="idle seconds after each rung (default 4)")
    p.add_argument("--probe-every", type=float, default=0.02, help="seconds between probes (default 0.02)")
    p.add_argument("--lag-growth", type=float, default=0.05,
                   help="largest lag growth, as a share of the window's records, that counts as bounded (default 0.05)")
    p.add_argument("--streams-per-bridge", type=int, default=1,
                   help="engine streams each bridge process serves (default 1: one bridge per stream, as "
                        "sidecars; more: node-level bridges, kvbus bridge --streams)")
    p.add_argument("--live-generator", action="store_true",
                   help="generate the fleet's steps while playing (default: kvbus fleet --pregenerate, "
                        "encoded before the ladder, so that the generator's CPU stays out of the way)")
    p.add_argument("--keep-going", action="store_true", help="play every rung, even after one is not sustained")
    p.add_argument("--partitions", type=int, default=None,
                   help="partitions of the run's topics (default KVBUS_PARTITIONS)")
    p.add_argument("--drain-timeout", type=float, default=120.0,
                   help="seconds to wait for the pipeline to drain at the end")
    p.add_argument("--keep", action="store_true", help="leave the run's topics and Redis keys (default: delete them)")
    p.add_argument("--seed", type=int, default=11, help="fleet seed (default 11)")
    p.add_argument("--hops", action="store_true",
                   help="after the run, split each probe's freshness into hops by the Kafka timestamps of its raw "
                        "and consolidated records (reads both topics back)")
    p.add_argument("--probes-out", type=Path, default=None,
                   help="write every probe as a CSV line: published (s since the first), holder, freshness ms")
    args = p.parse_args(argv)
    for name in ("idle", "gap", "window"):
        if getattr(args, name) <= 0:  # every rung of the fleet's schedule must last (kvbus fleet --schedule)
            p.error(f"--{name} must be > 0 seconds")
    return args


# -- the processes -------------------------------------------------------------------------

@dataclass
class Run:
    """One benchmark run: its names, its processes and where their metrics are."""

    run_id: str
    settings: Settings
    prefix: str
    children: Children
    bridge_ports: list[int] = field(default_factory=list)
    worker_ports: list[int] = field(default_factory=list)
    sink_ports: list[int] = field(default_factory=list)
    pids: dict[str, list[int]] = field(default_factory=dict)
    """Process kind -> pids (see KINDS)."""

    @property
    def worker_group(self) -> str:
        return f"{self.run_id}.streams"

    @property
    def sink_group(self) -> str:
        return f"{self.run_id}.sink"

    def block_topic(self, ownership: Optional[str] = None) -> str:
        """The block topic the run's workers write tier ``ownership``'s events to (None: the framework-owned
        one): layout 2's unless the run's environment says ``KVBUS_STREAMS_BLOCK_LAYOUT=events``."""
        return written_topic(self.settings.topics, ownership, self.children.env)


def new_run(args: argparse.Namespace, base: Settings, log_dir: Path) -> Run:
    """Fresh names for topics, groups and the Redis prefix; topics created."""
    from kvbus.infra.dev_topics import ensure_topics

    run_id = f"bench{uuid.uuid4().hex[:8]}"
    topics = Topics(raw=f"{run_id}.raw", blocks=f"{run_id}.blocks", incomplete=f"{run_id}.incomplete",
                    dlq=f"{run_id}.dlq")
    settings = replace(base, topics=topics, partitions=args.partitions or base.partitions)
    replication = cluster_replication(settings.bootstrap)
    # the worker creates its changelog and tier topics with KVBUS_REPLICATION
    env = {**os.environ, **settings.to_env(), "KVBUS_REPLICATION": str(replication)}
    blocks = [written_topic(topics, tier, env) for tier in (None, "kvcr")]  # the block layout the workers write
    ensure_topics(settings.bootstrap, [topics.raw, *blocks, topics.incomplete, topics.dlq], settings.partitions,
                  replication)
    children = Children(log_dir=log_dir, env=env, log_prefix=f"{run_id}-")
    return Run(run_id, settings, f"{run_id}:", children)


def cluster_replication(bootstrap: str) -> int:
    """Replication factor of a run's topics: 3 on a cluster of three or more brokers (min ISR 2,
    kvbus.schemas.topics.min_insync), else the number of brokers."""
    from kvbus.infra.dev_topics import admin_client

    return min(3, len(admin_client(bootstrap).list_topics(timeout=10).brokers))


def start_stages(run: Run, args: argparse.Namespace, sink_args: tuple[str, ...] = ()) -> None:
    """Sinks, workers and bridges, then wait until both consumer groups are stable. ``sink_args``:
    extra ``kvbus sink`` arguments (``{i}`` in one: the sink's number)."""
    workdir = run.children.log_dir / run.run_id
    for i in range(args.sinks):
        port = free_port()
        run.sink_ports.append(port)
        run.children.start(f"sink-{i}", "sink", "--group", run.sink_group, "--prefix", run.prefix,
                           "--stale-after", "0", "--metrics-port", str(port), *(a.format(i=i) for a in sink_args))
    for i in range(args.workers_procs):
        port = free_port()
        run.worker_ports.append(port)
        run.children.start(f"worker-{i}", "worker", "--app-id", run.worker_group, "--metrics-port", str(port),
                           "--workdir", str(workdir), "--datadir", str(workdir / f"worker-{i}"))
    streams = [(i, w) for i in range(args.replicas) for w in range(args.tp)]
    per = max(1, args.streams_per_bridge)
    for b in range(0, len(streams), per):
        port = free_port()
        run.bridge_ports.append(port)
        group = [{"endpoint": f"tcp://127.0.0.1:{pub}", "replay_endpoint": f"tcp://127.0.0.1:{pub + 1}",
                  "replica": f"replica-{i}", "worker_rank": w, "workers": args.tp}
                 for i, w in streams[b:b + per]
                 for pub in [args.base_port + 2 * (i * args.tp + w)]]  # kvbus.simulator.fleet's port rule (1 dp)
        if per == 1:
            (s,) = group
            run.children.start(f"bridge-{streams[b][0]}-w{streams[b][1]}", "bridge", "--endpoint", s["endpoint"],
                               "--replay-endpoint", s["replay_endpoint"], "--replica", s["replica"],
                               "--worker-rank", str(s["worker_rank"]), "--workers", str(args.tp),
                               "--metrics-port", str(port))
            continue
        streams_file = workdir / f"bridge-{b // per}-streams.json"
        streams_file.parent.mkdir(parents=True, exist_ok=True)
        streams_file.write_text(json.dumps(group))
        run.children.start(f"bridge-{b // per}", "bridge", "--streams", str(streams_file),
                           "--metrics-port", str(port))
    for kind in ("sink", "worker", "bridge"):
        run.pids[kind] = [c.proc.pid for c in run.children.started if c.name.startswith(kind)]
    ok = wait_for(lambda: check_alive(run) is None  # a stage that exits fails the wait at once
                  and group_stable(run.settings.bootstrap, run.worker_group, args.workers_procs)
                  and group_stable(run.settings.bootstrap, run.sink_group, args.sinks), 120, 1.0)
    check_alive(run)
    if not ok:
        raise SystemExit("benchmark: the worker and sink consumer groups did not become stable in 120 s")


def group_stable(bootstrap: str, group: str, members: int) -> bool:
    """Whether consumer group ``group`` is Stable with ``members`` members, each with partitions."""
    from confluent_kafka import ConsumerGroupState
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": bootstrap})  # held: the future dies with its client
    try:
        desc = admin.describe_consumer_groups([group])[group].result(10)
    except Exception as e:  # noqa: BLE001 - not there yet
        log.debug("group %s not described yet: %s", group, e)
        return False
    return (desc.state == ConsumerGroupState.STABLE and len(desc.members) == members
            and all(m.assignment.topic_partitions for m in desc.members))


def start_fleet(run: Run, args: argparse.Namespace, rungs: list[tuple[float, float]], probe_log: Path,
                manifest: Path, extra: tuple[str, ...] = ()) -> None:
    """The load generator, playing ``rungs`` ((fleet events/s, seconds)) with probes; ``extra``: more
    ``kvbus fleet`` options."""
    schedule = ",".join(f"{r:g}:{s:g}" for r, s in rungs)
    child = run.children.start("fleet", "fleet", "--replicas", str(args.replicas), "--workers", str(args.tp),
                               "--base-port", str(args.base_port), "--schedule", schedule, "--seed", str(args.seed),
                               "--clear-rate", "0", "--probe-every", str(args.probe_every),
                               "--probe-log", str(probe_log), "--manifest", str(manifest),
                               *(() if args.live_generator else ("--pregenerate",)), *extra)
    run.pids["fleet"] = [child.proc.pid]


def service_pids(redis_url: str) -> dict[str, list[int]]:
    """Pids of the stack's Kafka brokers and registry (infra's pid files) and of Redis (INFO)."""
    from kvbus.infra.procs import read_pid
    from kvbus.infra.stack_env import Paths

    run_dir = Paths().run
    pids: dict[str, list[int]] = {"kafka": [], "registry": [], "redis": []}
    for pf in sorted(run_dir.glob("*.pid")):
        rec = read_pid(pf)
        if rec is None:
            continue
        if pf.name.startswith("kafka"):
            pids["kafka"].append(rec.pid)
        elif pf.name.startswith("registry"):
            pids["registry"].append(rec.pid)
    if "+cluster://" in redis_url:  # a Redis Cluster: every node's server
        from kvbus.sinks.view.cluster import cluster_client

        pids["redis"] = sorted(int(info["process_id"]) for info in
                               cluster_client(redis_url).info("server", target_nodes="all").values())
    else:
        pids["redis"] = [int(redis.Redis.from_url(redis_url).info("server")["process_id"])]
    return pids


FRESH_BROKER_S = 300.0
"""A broker younger than this is still compiling its hot paths (C2): its CPU per event is 1.5-1.8x a warm
one's in the first run after ``infra/stack up`` (docs/performance.md, "The collector, lz4 weighed, and
where the rest goes"), so a comparison across runs must not start with a fresh one."""


def fresh_broker_warning(kafka_pids: list[int]) -> tuple[Optional[float], Optional[str]]:
    """(seconds the youngest broker of ``kafka_pids`` has run, a warning if under :data:`FRESH_BROKER_S`)."""
    from kvbus.infra.procs import proc_age

    ages = [a for a in (proc_age(p) for p in kafka_pids) if a is not None]
    if not ages:
        return None, None
    age = min(ages)
    if age >= FRESH_BROKER_S:
        return age, None
    return age, (f"warning: a Kafka broker started {age:.0f} s ago and is still compiling: its CPU figures run "
                 "high for minutes; discard this run when comparing runs")


SCRAPE_TIMEOUT = 1.0
"""Seconds a sample waits for a Redis server's counters (a paused or restarting Redis, as in
benchmarks/faults.py, must not stall the sampler)."""


def redis_clients(redis_url: str) -> list[redis.Redis]:
    """A client of every Redis server of the view: the one server, or every node of a Redis Cluster."""
    if "+cluster://" in redis_url:
        from kvbus.sinks.view.cluster import cluster_client

        cluster = cluster_client(redis_url)
        return [redis.Redis(host=node.host, port=node.port, socket_timeout=SCRAPE_TIMEOUT,
                            socket_connect_timeout=SCRAPE_TIMEOUT) for node in cluster.get_nodes()]
    return [redis.Redis.from_url(redis_url, socket_timeout=SCRAPE_TIMEOUT, socket_connect_timeout=SCRAPE_TIMEOUT)]


def lookup_seconds(clients: list[redis.Redis]) -> float:
    """Seconds the servers have spent running ``FCALL_RO`` calls (the lookups) since they started."""
    return sum(c.info("commandstats").get("cmdstat_fcall_ro", {}).get("usec", 0) for c in clients) / 1e6


def check_alive(run: Run) -> None:
    report = run.children.stopped_report(ignore=("fleet",), tail=2000)
    if report:
        raise SystemExit(f"benchmark: a stage stopped unexpectedly\n{report}")


def cleanup(run: Run) -> None:
    """Delete the run's topics (changelog included) and Redis keys."""
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": run.settings.bootstrap})
    ours = [t for t in admin.list_topics(timeout=10).topics if t.startswith(run.run_id)]
    for fut in admin.delete_topics(ours, operation_timeout=30).values() if ours else ():
        try:
            fut.result(30)
        except Exception:  # noqa: BLE001 - a leftover topic is harmless
            pass
    if "+cluster://" in run.settings.redis_url:  # the sharded view: every shard's keys
        from kvbus.sinks.view.sharded_store import ShardedRedisStore

        for shard in ShardedRedisStore(run.settings.redis_url, run.prefix, load=False).shards:
            shard.wipe(keep=())
        return
    r = redis.Redis.from_url(run.settings.redis_url)
    batch = []
    for key in r.scan_iter(match=f"{run.prefix}*", count=1000):
        batch.append(key)
        if len(batch) >= 1000:
            r.unlink(*batch)
            batch.clear()
    if batch:
        r.unlink(*batch)


# -- measuring --------------------------------------------------------------------------

@dataclass
class Sample:
    """Counters at one instant (monotonic time ``t``)."""

    t: float
    acked: float
    """Events in raw records Kafka acknowledged to the bridges (worker reports)."""
    raw_records: float
    """Raw records acknowledged."""
    consolidated: float
    applied: float
    cpu: dict[str, float]
    """Kind -> CPU seconds so far (sum over its processes)."""
    per_proc: dict[str, tuple[float, float]]
    """``worker-i`` -> (worker reports applied, CPU seconds); ``sink-i`` -> (records read, CPU seconds)."""
    lag_raw: Optional[int] = None
    """Raw records the workers' group has not committed."""
    lag_blocks: Optional[int] = None
    """Records of the block topics (both layouts) the sinks' group has not committed."""
    block_records: Optional[int] = None
    """Records written to the run's block topics so far (their end offsets: fresh topics); a layout 2
    record holds an engine batch's events of one holder and tier."""


class Sampler(threading.Thread):
    """Reads every stage's counters, consumer lag and CPU once a second."""

    def __init__(self, run: Run, every: float = 1.0) -> None:
        super().__init__(name="sampler", daemon=True)
        self.run_ = run
        self.every = every
        self.samples: list[Sample] = []
        self.stop = threading.Event()
        t = run.settings.topics
        self.raw_lag = GroupLag(run.settings.kafka(), run.worker_group, re.escape(t.raw))
        self.blocks_lag = GroupLag(run.settings.kafka(), run.sink_group, t.blocks_pattern()[1:])
        self._pool = ThreadPoolExecutor(32, thread_name_prefix="scrape")
        self._redis = redis_clients(run.settings.redis_url)
        self._lookups = 0.0
        self._counters: dict[tuple[int, str], float] = {}
        """(port, pattern) -> the counter's highest value read so far."""

    def _counters_at(self, port: int, patterns: tuple[str, ...]) -> list[float]:
        """The counters ``patterns`` at ``port``, from one scrape: each what it reads now, or the last
        value read when the scrape failed (``scrape_all`` gives 0 when an endpoint does not answer
        within its timeout, as a process starved of CPU may not; counters only grow)."""
        out = []
        for pattern, value in zip(patterns, scrape_all(port, patterns)):
            value = max(self._counters.get((port, pattern), 0.0), value)
            self._counters[(port, pattern)] = value
            out.append(value)
        return out

    def _lookup_seconds(self) -> float:
        """:func:`lookup_seconds` now, or the last value read when Redis did not answer (a counter
        that only grows; a restarted Redis starts it again from 0, and its CPU time with it)."""
        try:
            self._lookups = lookup_seconds(self._redis)
        except redis.RedisError:
            pass
        return self._lookups

    def take(self) -> Sample:
        """One sample: CPU first (at ``t``), then every metrics endpoint and both lags at once, each in
        a thread of its own (on a loaded machine one scrape may take a second; one after the other
        they would leave seconds between samples)."""
        run = self.run_
        pool = self._pool

        def scraped(ports: list[int], *patterns: str) -> list[Any]:
            """Per port, a future of its counters ``patterns`` (one scrape each)."""
            return [pool.submit(self._counters_at, port, patterns) for port in ports]

        t = time.monotonic()
        cpu = {kind: sum(cpu_seconds(p) for p in run.pids.get(kind, [])) for kind in KINDS if kind != "bench"}
        cpu["bench"] = cpu_seconds(os.getpid())
        cpu["lookups"] = self._lookup_seconds()
        cpu["redis"] -= cpu["lookups"]
        worker_cpu = [cpu_seconds(pid) for pid in run.pids.get("worker", [])]
        sink_cpu = [cpu_seconds(pid) for pid in run.pids.get("sink", [])]
        workers = scraped(run.worker_ports, r"kvbus_streams_reports_total",
                          r"kvbus_streams_(consolidated|passthrough)_total")
        sinks = scraped(run.sink_ports, r"kvbus_sink_records_total", r"kvbus_sink_events_applied_total")
        bridges = scraped(run.bridge_ports, r"kvbus_bridge_events_acked_total", r"kvbus_bridge_batches_acked_total")
        lags = [pool.submit(self.raw_lag.lag), pool.submit(self.blocks_lag.partitions)]
        per_proc = {}
        workers_read, sinks_read, bridges_read = ([f.result() for f in fs] for fs in (workers, sinks, bridges))
        for i, (w, c) in enumerate(zip(workers_read, worker_cpu)):
            per_proc[f"worker-{i}"] = (w[0], c)
        for i, (k, c) in enumerate(zip(sinks_read, sink_cpu)):
            per_proc[f"sink-{i}"] = (k[0], c)
        s = Sample(
            t=t,
            acked=sum(b[0] for b in bridges_read),
            raw_records=sum(b[1] for b in bridges_read),
            consolidated=sum(w[1] for w in workers_read),
            applied=sum(k[1] for k in sinks_read),
            cpu=cpu, per_proc=per_proc,
        )
        try:
            s.lag_raw, blocks = (f.result() for f in lags)
            s.lag_blocks = sum(max(0, end - done) for _t, _p, done, end in blocks)
            s.block_records = sum(end for _t, _p, _done, end in blocks)
        except Exception:  # noqa: BLE001 - coordinator moving: this sample has no lag
            pass
        return s

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                t0 = time.monotonic()
                try:
                    self.samples.append(self.take())
                except Exception:  # noqa: BLE001 - one lost sample, never a dead sampler
                    log.exception("sample lost")
                self.stop.wait(max(0.0, self.every - (time.monotonic() - t0)))
        finally:
            self._pool.shutdown(wait=True)
            self.raw_lag.close()
            self.blocks_lag.close()

    def between(self, t0: float, t1: float) -> list[Sample]:
        return [s for s in self.samples if t0 <= s.t <= t1]


class Prober:
    """Follows the fleet's probe log and finds each probe in the view with lookups."""

    def __init__(self, path: Path, store: RedisStore) -> None:
        self.path = path
        self.store = store
        self.rungs: list[dict[str, Any]] = []
        """Rung starts as the fleet logged them."""
        self.ended = False
        self.published: dict[bytes, float] = {}
        """Probe hash -> publication time."""
        self.holders: dict[bytes, str] = {}
        """Probe hash -> the holder it was sent to."""
        self.wall: dict[bytes, float] = {}
        """Probe hash -> publication time, ``time.time()`` (to compare with Kafka timestamps)."""
        self.seen: dict[bytes, float] = {}
        """Probe hash -> time the first lookup that found it returned."""
        self.events: list[tuple[float, int]] = []
        """(time, engine events the fleet had published by then), one per log line."""
        self.withdrawn = 0
        """Probes forgotten unseen because their holder's cache was cleared right after them."""
        self._outstanding: list[bytes] = []
        self._offset = 0
        self._partial = b""

    def _read_log(self) -> None:
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return
        self._offset += len(data)
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        for line in lines:
            rec = json.loads(line)
            if "events" in rec:
                self.events.append((rec["t"], rec["events"]))
            if "probe" in rec:
                h = bytes.fromhex(rec["probe"])
                self.published[h] = rec["t"]
                self.holders[h] = rec["holder"]
                self.wall[h] = rec["wall"]
                self._outstanding.append(h)
            elif "cleared" in rec:
                self._withdraw(rec["cleared"])
            elif "rung" in rec:
                self.rungs.append(rec)
            elif rec.get("end"):
                self.ended = True

    def _withdraw(self, holder: str) -> None:
        """Holder ``holder``'s cache was cleared (AllBlocksCleared): its probes not seen yet are gone
        from the truth before they could show, so they are no one's freshness (forgotten, counted)."""
        gone = [h for h in self._outstanding if self.holders[h] == holder and h not in self.seen]
        for h in gone:
            del self.published[h], self.holders[h], self.wall[h]
        self._outstanding = [h for h in self._outstanding if h in self.published]
        self.withdrawn += len(gone)

    def poll(self, limit: int = 32) -> None:
        """One pass: read new log lines, look up (at most ``limit`` of) the oldest outstanding probes."""
        self._read_log()
        try:
            for h in self._outstanding[:limit]:
                if self.store.lookup([h]):
                    self.seen[h] = time.monotonic()
        except (redis.RedisError, RuntimeError) as e:  # Redis down or restarted without the functions
            log.debug("probe lookups failed: %s", e)
        if self.seen:
            self._outstanding = [h for h in self._outstanding if h not in self.seen]

    def write_csv(self, path: Path) -> None:
        """Every probe: seconds since the first was published, holder, freshness in ms (empty: never seen)."""
        first = min(self.published.values(), default=0.0)
        with open(path, "w", encoding="utf-8") as f:
            f.write("published_s,holder,freshness_ms\n")
            for h, tp in sorted(self.published.items(), key=lambda kv: kv[1]):
                ts = self.seen.get(h)
                fresh = f"{(ts - tp) * 1000.0:.2f}" if ts is not None else ""
                f.write(f"{tp - first:.4f},{self.holders.get(h, '')},{fresh}\n")

    def freshness(self, t0: float, t1: float, deadline: float) -> dict[str, Any]:
        """Freshness (ms) of probes published in [t0, t1); probes not seen by ``deadline`` count as
        at least ``deadline - publication``."""
        values, unseen = [], 0
        for h, tp in self.published.items():
            if not t0 <= tp < t1:
                continue
            ts = self.seen.get(h)
            if ts is None:
                unseen += 1
                ts = deadline
            values.append((ts - tp) * 1000.0)
        if not values:
            return {"probes": 0}
        values.sort()
        return {"probes": len(values), "unseen": unseen, "p50_ms": round(quantile(values, 0.5), 1),
                "p99_ms": round(quantile(values, 0.99), 1), "max_ms": round(values[-1], 1)}


def quantile(sorted_values: list[float], q: float) -> float:
    """The ``q`` quantile of sorted values (nearest rank)."""
    i = min(len(sorted_values) - 1, max(0, int(round(q * len(sorted_values) + 0.5)) - 1))
    return sorted_values[i]


# -- one rung's figures -------------------------------------------------------------------

def rung_figures(samples: list[Sample], fresh: dict[str, Any], tp: int, lag_growth: float) -> dict[str, Any]:
    """Rates, lag, CPU per 1,000 events and the sustained verdict of one steady window."""
    if len(samples) < 2:
        return {"error": "fewer than 2 samples in the window"}
    a, b = samples[0], samples[-1]
    dt = b.t - a.t
    offered = (b.acked - a.acked) / tp / dt
    out: dict[str, Any] = {
        "offered_ev_s": round(offered),
        "reports_s": round((b.acked - a.acked) / dt),
        "consolidated_ev_s": round((b.consolidated - a.consolidated) / dt),
        "applied_ev_s": round((b.applied - a.applied) / dt),
        "freshness": fresh,
    }
    bounded = True
    blocks_written = [s.block_records for s in samples if s.block_records is not None]  # records, as the lag
    for hop, written in (("raw", b.raw_records - a.raw_records),
                         ("blocks", blocks_written[-1] - blocks_written[0] if blocks_written else 0.0)):
        lags = [getattr(s, f"lag_{hop}") for s in samples if getattr(s, f"lag_{hop}") is not None]
        if len(lags) < 3:
            out[f"lag_{hop}"] = None
            bounded = False
            continue
        third = max(1, len(lags) // 3)
        first, last = statistics.mean(lags[:third]), statistics.mean(lags[-third:])
        growth = (last - first) / max(written, 1.0)
        out[f"lag_{hop}"] = {"start": round(first), "end": round(last), "max": max(lags), "growth": round(growth, 3)}
        bounded = bounded and growth <= lag_growth
    p99 = fresh.get("p99_ms")
    out["sustained"] = bool(bounded and p99 is not None and p99 < 1000.0 and not fresh.get("unseen"))
    events = max((b.acked - a.acked) / tp, 1.0)
    out["cpu_s_per_1k_events"] = {k: round((b.cpu[k] - a.cpu[k]) / events * 1000.0, 4) for k in KINDS}
    us = {k: (b.cpu[k] - a.cpu[k]) / events * 1e6 for k in KINDS}
    out["us_per_event"] = {k: round(v, 2) for k, v in us.items()}
    out["kvbus_us_per_event"] = round(sum(us[k] for k in KVBUS_KINDS), 2)
    out["cpu_cores"] = {k: round((b.cpu[k] - a.cpu[k]) / dt, 3) for k in KINDS}
    shares: dict[str, Any] = {}
    for name in a.per_proc:
        (r0, c0), (r1, c1) = a.per_proc[name], b.per_proc.get(name, a.per_proc[name])
        shares[name] = {"records_s": round((r1 - r0) / dt), "cpu_cores": round((c1 - c0) / dt, 3)}
    out["per_process"] = shares
    return out


def rung_line(name: str, fig: dict[str, Any]) -> str:
    f = fig.get("freshness", {})
    lr, lb = fig.get("lag_raw") or {}, fig.get("lag_blocks") or {}
    cpu = fig.get("cpu_cores", {})
    return (f"{name:>8} | offered {fig.get('offered_ev_s', 0):>7} ev/s"
            f" | consolidated {fig.get('consolidated_ev_s', 0):>7}"
            f" | applied {fig.get('applied_ev_s', 0):>7}"
            f" | fresh p50/p99/max {f.get('p50_ms', '-')}/{f.get('p99_ms', '-')}"
            f"/{f.get('max_ms', '-')} ms ({f.get('probes', 0)} probes, {f.get('unseen', 0)} unseen)"
            f" | lag raw {lr.get('end', '?')} blocks {lb.get('end', '?')}"
            f" | cores " + " ".join(f"{k}={v:.2f}" for k, v in cpu.items() if v >= 0.005)
            + (f" | kvbus {fig['kvbus_us_per_event']} us/ev ("
               + " ".join(f"{k}={fig['us_per_event'][k]}" for k in KVBUS_KINDS)
               + f") fleet {fig['us_per_event']['fleet']}" if fig.get("offered_ev_s") and "us_per_event" in fig else "")
            + {True: " | SUSTAINED", False: " | not sustained", None: ""}[fig.get("sustained")])


# -- hops -------------------------------------------------------------------------------------

HOPS = ("bridge", "kafka_worker", "kafka_sink_lookup")
"""The parts of a probe's freshness, split by Kafka's record timestamps (CreateTime, ms, set when
the producer is called): engine -> raw record produced (bridge: ZMQ, decode, encode); raw produced
-> consolidated record produced (linger, Kafka, the worker's fetch, batch wait and processing);
consolidated produced -> visible (linger, Kafka, the sink's poll, decode and apply, the lookup)."""


def probe_timestamps(settings: Settings, topic: str, probes: set[bytes]) -> dict[bytes, float]:
    """Probe hash -> Kafka timestamp (s) of the first record of ``topic`` (the raw topic: EventBatch
    records; a block topic of either layout: BlockEvent or BlockEvents records) that carries it as a
    one-block BlockStored."""
    from confluent_kafka import Consumer, TopicPartition

    from kvbus.schemas.codec import FastSerde
    from kvbus.schemas.serde import registry_client

    raw = topic == settings.topics.raw
    kind = "EventBatch" if raw else record_schema(settings.topics, topic)
    serde = FastSerde(registry_client(settings), kind, auto_register=False)
    c = Consumer({"bootstrap.servers": settings.bootstrap, "group.id": f"hops-{uuid.uuid4().hex}",
                  "enable.auto.commit": False})
    out: dict[bytes, float] = {}
    try:
        parts = c.list_topics(topic, timeout=10).topics[topic].partitions
        tps = [TopicPartition(topic, p, 0) for p in parts]
        ends = {p: c.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1] for p in parts}
        c.assign(tps)
        done = {p for p, end in ends.items() if end == 0}
        while len(done) < len(parts):
            for m in c.consume(5000, 1.0):
                if m.error():
                    continue
                if m.offset() + 1 >= ends[m.partition()]:
                    done.add(m.partition())
                v = serde.loads(m.value(), topic)
                for e in (v.events if raw else [ev.event for ev in block_events(v)]):
                    hs = getattr(e, "block_hashes", None)
                    if hs is not None and len(hs) == 1 and hs[0] in probes and hs[0] not in out:
                        out[hs[0]] = m.timestamp()[1] / 1000.0
    finally:
        c.close()
    return out


def hop_figures(run: Run, prober: Prober, windows: dict[str, tuple[float, float]]) -> dict[str, Any]:
    """Per rung: p50 / p90 / p99 ms of each hop (HOPS) over the probes published in its window."""
    probes = set(prober.seen)
    raw = probe_timestamps(run.settings, run.settings.topics.raw, probes)
    blocks = probe_timestamps(run.settings, run.block_topic(), probes)
    out: dict[str, Any] = {}
    for name, (t0, t1) in windows.items():
        parts: dict[str, list[float]] = {h: [] for h in HOPS}
        for h in probes:
            tp = prober.published[h]
            if not t0 <= tp < t1 or h not in raw or h not in blocks:
                continue
            pub, total = prober.wall[h], prober.seen[h] - tp
            parts["bridge"].append(raw[h] - pub)
            parts["kafka_worker"].append(blocks[h] - raw[h])
            parts["kafka_sink_lookup"].append(total - (blocks[h] - pub))
        out[name] = {hop: {f"p{int(q * 100)}_ms": round(quantile(sorted(v), q) * 1000, 1) for q in (0.5, 0.9, 0.99)}
                     for hop, v in parts.items() if v}
        print(f"{name:>8} hops (ms, p50/p90/p99): " + " | ".join(
            f"{hop} " + "/".join(str(x) for x in fig.values()) for hop, fig in out[name].items()), flush=True)
    return out


# -- exactness ------------------------------------------------------------------------------

def view_matches_truth(store: RedisStore, manifest: Path) -> tuple[bool, list[str]]:
    """Compare the view with the fleet's ground truth: (exact, differences)."""
    data = json.loads(manifest.read_text())
    want: dict[str, dict[str, int]] = {}
    for holder, rep in data["replicas"].items():
        name = holder[:-2] if holder.endswith("#0") else holder
        tiers = {}
        for key, n in rep["tiers"].items():
            medium, owner = key.split("/", 1)
            if n:
                tiers[medium if owner == "None" else f"{medium}@{owner}"] = n
        if tiers:
            want[name] = tiers
    got = {h: {t: n for t, n in tiers.items() if n} for h, tiers in store.reader().summary().items()}
    got = {h: t for h, t in got.items() if t}
    diffs = [f"{h}: view {got.get(h)} truth {want.get(h)}" for h in sorted(set(want) | set(got))
             if got.get(h) != want.get(h)]
    return not diffs, diffs


# -- main ----------------------------------------------------------------------------------

def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    args.base_port = free_port_block(2 * args.replicas * args.tp)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from kvbus.infra import stack

    started_stack = not stack.status().get("ready")
    if started_stack:
        print("bringing the stack up ...", flush=True)
        stack.up()
    base = Settings.from_env()
    state_dir = Path(os.environ.get("KVBUS_STATE_DIR", REPO / ".infra"))
    run = new_run(args, base, state_dir / "logs")
    rates = [float(r) for r in args.rates.split(",") if r.strip()]
    rungs = [(0.0, args.idle)]
    for r in rates:
        rungs += [(r, args.warmup + args.window), (0.0, args.gap)]
    probe_log = state_dir / "logs" / f"{run.run_id}-probes.jsonl"
    manifest = state_dir / "logs" / f"{run.run_id}-manifest.json"
    print(f"run {run.run_id}: {args.replicas} replicas x TP {args.tp}, {args.workers_procs} worker process(es), "
          f"{args.sinks} sink process(es), {run.settings.partitions} partitions; "
          f"logs {run.children.log_dir}/{run.run_id}-*",
          flush=True)
    result: dict[str, Any] = {"run": run.run_id, "replicas": args.replicas, "tp": args.tp,
                              "workers_procs": args.workers_procs, "sinks": args.sinks,
                              "streams_per_bridge": args.streams_per_bridge,
                              "bridges": -(-args.replicas * args.tp // max(1, args.streams_per_bridge)),
                              "generator": "live" if args.live_generator else "pregenerated",
                              "partitions": run.settings.partitions, "window_s": args.window, "rungs": {}}
    sampler: Optional[Sampler] = None
    try:
        from kvbus.schemas.registry import register

        register(run.settings.registry_url, run.settings.topics, ("kvcr",), run.settings.security.registry)
        start_stages(run, args)
        run.pids.update(service_pids(run.settings.redis_url))
        result["kafka_age_s"], warning = fresh_broker_warning(run.pids["kafka"])
        if warning:
            print(warning, flush=True)
        time.sleep(2.0)  # bridges connected before the first batch (replay would cover the rest)
        store = open_store(run.settings.redis_url, run.prefix, load=False)  # sharded on a redis+cluster:// URL
        prober = Prober(probe_log, store)
        start_fleet(run, args, rungs, probe_log, manifest)
        sampler = Sampler(run)
        sampler.start()
        windows: dict[str, tuple[float, float]] = {}
        capacity = play(run, args, rates, rungs, prober, sampler, result, windows)
        result["sustained_capacity_ev_s"] = capacity
        drained = drain(run, args, prober, sampler)
        exact, diffs = view_matches_truth(store, manifest) if manifest.exists() else (False, ["no manifest"])
        result["drained"] = drained
        if args.probes_out:
            prober.write_csv(args.probes_out)
        if args.hops:
            result["hops"] = hop_figures(run, prober, windows)
        result["view_exact"] = exact
        print(f"drained: {drained}; view equals the fleet's ground truth: {exact}"
              + ("" if exact else "\n  " + "\n  ".join(diffs[:10])), flush=True)
        print(f"sustained capacity: {capacity} offered engine events/s (TP={args.tp}, W={args.workers_procs}, "
              f"S={args.sinks})", flush=True)
    finally:
        if sampler is not None:
            sampler.stop.set()
        run.children.stop_all()
        if not args.keep:
            cleanup(run)
        if started_stack:
            stack.down()
    print(json.dumps(result))
    return 0


def play(run: Run, args: argparse.Namespace, rates: list[float], rungs: list[tuple[float, float]],
         prober: Prober, sampler: Sampler, result: dict[str, Any],
         windows: dict[str, tuple[float, float]]) -> Optional[int]:
    """Follow the fleet through its rungs, probing all along; returns the sustained capacity and
    fills ``windows`` (rung name -> steady window)."""
    capacity: Optional[int] = None
    done = 0  # rungs reported
    fleet = next(c for c in run.children.started if c.name == "fleet")
    last_check = 0.0
    while done < len(rungs):
        prober.poll()
        now = time.monotonic()
        if now - last_check > 1.0:
            last_check = now
            check_alive(run)
            if fleet.proc.poll() is not None and not prober.ended:
                raise SystemExit(f"benchmark: the fleet exited with {fleet.proc.returncode} (log {fleet.log_path})")
        time.sleep(0.001)  # the probes' resolution: about a millisecond plus one lookup
        # a rung is reported once the next rung has started and its probes had the gap to show up
        if done + 1 < len(prober.rungs) or (prober.ended and done < len(prober.rungs)):
            start = prober.rungs[done]["t"]
            rate, seconds = rungs[done]
            end = start + seconds
            settle = end + (args.gap if rate > 0 else 0.5)
            if now < settle:
                continue
            is_idle = rate == 0
            t0 = start + min(args.warmup, seconds / 2)
            name = "idle" if is_idle else f"{rates[(done - 1) // 2]:g}"
            if is_idle and done > 0:
                done += 1  # the gap after a rung: its probes belong to the rung before
                continue
            fresh = prober.freshness(t0, end, now)
            fig = rung_figures(sampler.between(t0, end), fresh, args.tp, args.lag_growth)
            fig["target_ev_s"] = 0 if is_idle else rates[(done - 1) // 2]
            windows[name] = (t0, end)
            if is_idle:
                fig["sustained"] = None  # nothing offered: lag growth is noise on a handful of records
            result["rungs"][name] = fig
            print(rung_line(name, fig), flush=True)
            if not is_idle:
                if fig.get("sustained"):
                    capacity = max(capacity or 0, fig["offered_ev_s"])
                elif not args.keep_going:
                    print("  not sustained: stopping the ladder (--keep-going plays every rung)", flush=True)
                    run.children.stop(fleet)
                    return capacity
            done += 1
    return capacity


def drain(run: Run, args: argparse.Namespace, prober: Prober, sampler: Sampler) -> bool:
    """Wait for the fleet's end and for both hops to commit everything; returns whether they did."""
    fleet = next(c for c in run.children.started if c.name == "fleet")
    try:
        fleet.proc.wait(timeout=60)
    except Exception:  # noqa: BLE001
        run.children.stop(fleet)

    def settled() -> bool:
        check_alive(run)
        recent = sampler.samples[-3:]
        return (len(recent) == 3 and all(s.lag_raw == 0 and s.lag_blocks == 0 for s in recent)
                and recent[0].applied == recent[-1].applied)

    return wait_for(settled, args.drain_timeout, 1.0)


if __name__ == "__main__":
    sys.exit(main())
