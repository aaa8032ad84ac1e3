"""Fault suite on a three-broker cluster: one fault at a time under steady load, the view checked after each.

    .venv/bin/python benchmarks/faults.py                       # every fault
    .venv/bin/python benchmarks/faults.py --list                # the faults and what each does
    .venv/bin/python benchmarks/faults.py --faults sink,bridge --repeat 3

**The cluster.** Its own state directory and ports, never the dev stack's: ``infra/stack`` with
``KVBUS_STATE_DIR=/tmp/kvbus-faults``, brokers on ``127.0.0.1:29092,:29094,:29096`` (each KRaft
controller on its broker port + 1), registry ``:28081`` (management ``:29001``), Redis ``:26379``
(CLUSTER_ENV). It is brought up with ``--brokers 3`` (topics replication 3, min ISR 2) if it is
not running, and stopped at the end if this run started it (``--keep-cluster`` leaves it); the command
that stops it is printed either way. ``--use-env`` takes the caller's ``KVBUS_*`` stack instead (brought
up with 3 brokers too if it is not running), and if it runs, as it runs: on a one-broker stack the faults
that kill or pause a broker are refused (``Fault.brokers``) and the others run (the test suite's smoke
run, tests/test_benchmarks_start.py: one short fault on the test stack).

**Sinks restarted in their group.** A sink killed with SIGKILL stays a member of its consumer group
until its session times out (``kvbus sink --session-timeout``, 10 s), and its successor gets no
partitions before that: fault ``sink`` measures exactly that; ``sink-static`` runs the sink with
static membership (``kvbus sink --instance-id``: Kafka's ``group.instance.id``), whose
successor takes the dead member's place and partitions at once.

**Pauses (gray faults).** A ``pause-*`` fault SIGSTOPs a process for ``--pause-for`` s (15), past
the timeout that makes the others give up on it: a sink of two or a worker (their groups' session
timeouts, 10 s: the group moves its partitions), a broker leading partitions
(``broker.session.timeout.ms``: the controller fences it and elects other leaders), Redis (every
call of the sink hangs). Then SIGCONT, and the woken process is watched: ``woken_did`` says what its
log shows it did (``WOKEN_SIGNS``: ``fenced``, the group or the controller had given up on it;
``rejoined``, partitions assigned again, flow resumed, broker unfenced; ``carried on``, neither) or
``crashed (restarted)``: it exited, and was started again with the same command.

**Faults of Redis and Kafka besides crashes.** ``redis-full``: maxmemory just above what Redis uses,
under ``noeviction``, for ``--down-for`` s: the sink must stop applying with an ERROR naming the
cause (``notes.sink_error``), lose nothing and catch up once maxmemory is raised. ``redis-evict``:
an eviction policy set under the running sink, with maxmemory half the view: the sink counts the
evictions, marks the view not ready (``notes.not_ready_after_s``) and rebuilds it.
``broker-lost``: a leading broker killed for good; the flow goes on on the two left (min ISR 2)
and must be fresh again there (the broker is started again after the fault's figures).

**A fresh pipeline first.** Each fault waits, after the fleet starts, until the pipeline is fresh:
the last ``--steady-probes`` (40) probes each visible within ``--late-ms``; ``steady_after_s`` is
how long that took, then ``--before`` s of steady flow give ``steady_fresh_p50_ms`` /
``_p99_ms``, and only then the fault runs. A pipeline never fresh within ``--steady-timeout`` s
(180) fails the fault with what the last probes showed (``NeverSteady``), no fault injected: a fault
injected into a pipeline still seconds behind measures the start-up, not the fault. Why a freshly
started three-broker pipeline is behind, as ``--hops`` and the stages' logs show it: the first
records wait for each producer's idempotent producer id and the first metadata of the new topics,
the bridges' engine connections (the worker's first record 3-7 s after the fleet started, on a
loaded machine), the worker registers the block topics' schemas on its first outputs and the sink
fetches them on its first records (a registry round trip each), and the Faust worker's first
commits overrun their interval (1-4 s each): in the first 10 s the worker's hop is 1.3-2.0 s at the
median, 0.6-0.8 s later, the sink's 0.8-1.7 s, 0.5 s later (``--hops``). The brokers' JIT added
to it: with C2 their compiler threads took ~0.3 core for minutes after the start, and a pipeline
became fresh 5-84 s after the fleet started; a cluster's brokers now run C1 only, 5-18 s
(docs/benchmarks.md, "C1-only brokers"). On a machine loaded far past its cores, a group coordinator
that does not answer a heartbeat within the session (librdkafka's ``SESSTMOUT``: the member leaves
and rejoins under a new member id, and the coordinator waits out the old one) costs each sink ~25 s
without partitions, again and again: the pipeline is then never fresh.

**Broker crashes.** A broker killed with SIGKILL still leads its partitions, and still coordinates
its consumer groups, until the controller fences it (``broker.session.timeout.ms``; the dev stack's
brokers: 5 s, Kafka's default 9 s): nothing is written to or read from those partitions until
then. Then the clients find the new leaders on their next metadata refresh (librdkafka and aiokafka
both refresh at once after a failed connection) and the group members the new coordinator: a sink
whose session ran out meanwhile rejoins under a new member id, which costs a rebalance (~20 s);
the sink heartbeats every tenth of its session so that it reaches the new coordinator first. When
the broker comes back, librdkafka clients reconnect within ``reconnect.backoff.max.ms`` (1 s,
``kvbus.runtime.kafka_clients.RECOVERY_CONF``); its partitions' leadership returns to it at the
controller's next preferred-leader check (``leader.imbalance.check.interval.seconds``, 300 s), a
short move of its own, usually after the fault's figures. Killing the active controller (a broker
too) takes longer: the quorum elects a new controller first (~5 s), whose session timer for the
dead broker starts then (5 s more), ~12 s leaderless in all on a loaded machine; longer than the
sinks' 10 s session, so each sink rejoins under a new member id and waits out its old one (~18 s
more). A sink session above the cluster's failover time, or static membership (``--instance-id``),
avoids that rebalance.

**One fault.** Fresh topics (replication 3), consumer groups and Redis prefix
(``pipeline.new_run``), then the real processes of ``benchmarks/pipeline.py``: ``kvbus sink``, W
``kvbus worker``, one ``kvbus bridge`` per engine and ``kvbus fleet`` publishing ``--rate`` engine
events/s with a freshness probe every ``--probe-every`` s. Once the pipeline is fresh and after
``--before`` s of steady flow, the fault function runs (kill -9 / stop, hold ``--down-for`` s,
restart), the benchmark follows until the view is fresh again, stops the fleet, waits for both hops
to drain and compares the view with the fleet's ground truth (``pipeline.view_matches_truth``: every
holder, every tier) and every holder's stored position with the last batch the fleet published
(nothing acknowledged missing, nothing past it). Everything is deleted afterwards, so faults do not
see each other's records.

**Figures per fault.**
- ``in_flight``: engine events the fleet published between the fault and the restart.
- re-read: ``worker_reread`` (worker reports read, ``kvbus_streams_reports_total`` +
  ``_duplicates_total``, minus the events the bridges had acknowledged: raw events read twice),
  ``worker_dups`` (reports the worker itself recognised as redelivered), ``sink_dups`` (events the
  sink skipped as already applied, ``kvbus_sink_duplicates_skipped_total``: what the worker
  re-emitted, or the sink re-read), ``sink_reread`` (records the sink read minus records in its
  topics), ``bridge_recovered`` (batches the bridges recovered through the engines' replay, the
  start-up's included); each summed over every incarnation of the process (a killed one is scraped
  just before the kill).
- ``converge``: from the fault (and from the restart) until the view is fresh again: the moment
  the last *late* probe (published after the fault, not visible within ``--late-ms``) became
  visible; from then on every probe was visible in time (the view held everything published up to
  then: a probe goes through its holder's stream, in order). ``max_stale_ms``: the worst probe's
  freshness (what a router saw). ``lag_back_s``: from the restart until both hops' consumer lag is
  back within its pre-fault range.
- ``view_exact`` / ``positions_ok`` after draining; ``ok`` = both, drained, and no stage died.

Each fault prints its line; then a table of all, a README-ready markdown table, and as the last
line one JSON object with every figure. A fault is one registered function (``@fault``).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Optional

CLUSTER_ENV = {
    "KVBUS_STATE_DIR": "/tmp/kvbus-faults",
    "KVBUS_BOOTSTRAP": "127.0.0.1:29092,127.0.0.1:29094,127.0.0.1:29096",
    "KVBUS_REGISTRY_URL": "http://127.0.0.1:28081/apis/ccompat/v7",
    "KVBUS_REGISTRY_MANAGEMENT_PORT": "29001",
    "KVBUS_REDIS_URL": "redis://127.0.0.1:26379/0",
}
"""The fault cluster's settings (controllers on each broker port + 1, hence ports 2 apart)."""

if "--use-env" not in sys.argv:
    os.environ.update(CLUSTER_ENV)

import redis  # noqa: E402

import pipeline as pl  # noqa: E402  (benchmarks/pipeline.py: the processes, probes, lag, the truth check)
from kvbus.children import Child, free_port, free_port_block  # noqa: E402
from kvbus.demo_progress import scrape  # noqa: E402
from kvbus.runtime.settings import Settings  # noqa: E402
from kvbus.sinks.view.store import ResidencyStore  # noqa: E402
from kvbus.sinks.view.store_url import open_store  # noqa: E402

log = logging.getLogger("kvbus.faults")


# -- the fault table -------------------------------------------------------------------

@dataclass
class Fault:
    name: str
    run: Callable[["Ctx"], None]
    doc: str
    workers: int = 1
    """Faust worker processes of the run."""
    sinks: int = 1
    """``kvbus sink`` processes of the run (one consumer group: each takes some partitions)."""
    redis: Optional[str] = None
    """None: the cluster's Redis; "aof" / "none": a redis-server of the benchmark's own with an
    append-only file (appendfsync everysec) / with no persistence at all."""
    sink_args: tuple[str, ...] = ()
    """Extra ``kvbus sink`` arguments (pipeline.start_stages)."""
    exact: bool = True
    """Whether ``ok`` requires the view to equal the fleet's truth (False: the fault destroys
    records, e.g. a topic deleted; the view's exactness is reported, and the fault says what it needs)."""
    brokers: int = 1
    """Kafka brokers the fault needs (3: it kills, pauses or loses one of them and the flow goes on on the
    others). A ``--use-env`` run on a smaller stack refuses it (:func:`cluster_fits`)."""


FAULTS: dict[str, Fault] = {}


def fault(name: str, **kw: Any) -> Callable[[Callable[["Ctx"], None]], Callable[["Ctx"], None]]:
    """Register ``fn`` as fault ``name`` (its docstring's first paragraph is its description)."""
    def deco(fn: Callable[["Ctx"], None]) -> Callable[["Ctx"], None]:
        FAULTS[name] = Fault(name, fn, " ".join((fn.__doc__ or "").strip().split("\n\n")[0].split()), **kw)
        return fn
    return deco


@fault("broker-leader", brokers=3)
def broker_leader(ctx: "Ctx") -> None:
    """kill -9 the broker leading most of the run's raw/blocks partitions (not the active controller), restart it."""
    from kvbus.infra import stack

    leaders = ctx.partition_leaders()
    ctl = stack.controller()
    ranked = sorted(leaders, key=lambda b: (b == ctl, -len(leaders[b])))
    node = ranked[0]
    ctx.notes.update(broker=node, leads=sorted(leaders[node]), controller=ctl)
    ctx.kill_broker(node)
    ctx.follow(ctx.args.down_for)
    ctx.restart_broker(node)


@fault("controller", brokers=3)
def controller(ctx: "Ctx") -> None:
    """kill -9 the active KRaft controller (combined mode: a broker too), restart it."""
    from kvbus.infra import stack

    node = stack.controller()
    ctx.notes.update(controller=node, leads=sorted(ctx.partition_leaders().get(node, [])))
    ctx.kill_broker(node)
    t0 = time.monotonic()
    ctx.follow(ctx.args.down_for, until=lambda: stack.controller() not in (None, node))
    new = stack.controller()
    ctx.notes.update(new_controller=new, elected_s=round(time.monotonic() - t0, 2) if new != node else None)
    ctx.follow(ctx.args.down_for - (time.monotonic() - t0))
    ctx.restart_broker(node)


@fault("worker-of-two", workers=2)
def worker_of_two(ctx: "Ctx") -> None:
    """kill -9 one of two Faust workers (the other takes its partitions), restart it."""
    ctx.kill_restart("worker-1")


@fault("worker-only")
def worker_only(ctx: "Ctx") -> None:
    """kill -9 the only Faust worker, restart it."""
    ctx.kill_restart("worker-0")


@fault("sink")
def sink(ctx: "Ctx") -> None:
    """kill -9 the sink, restart it (same consumer group)."""
    ctx.kill_restart("sink-0")


@fault("sink-static", sink_args=("--instance-id", "sink-{i}"))
def sink_static(ctx: "Ctx") -> None:
    """kill -9 the sink, restart it; static group membership (group.instance.id): no session timeout wait."""
    ctx.kill_restart("sink-0")


@fault("bridge")
def bridge(ctx: "Ctx") -> None:
    """kill -9 one bridge, restart it (it resumes its epoch from Kafka and replays the gap)."""
    ctx.kill_restart("bridge-0-w0")


@fault("registry")
def registry(ctx: "Ctx") -> None:
    """stop the schema registry for --registry-down s (20), start it again."""
    from kvbus.infra import stack

    ctx.mark("fault")
    ctx.during(stack.stop_registry)
    ctx.follow(ctx.args.registry_down - (time.monotonic() - ctx.marks["fault"]))
    ctx.mark("restart")
    ctx.notes["start_s"] = ctx.during(stack.start_registry)["seconds"]


@fault("redis-aof", redis="aof")
def redis_aof(ctx: "Ctx") -> None:
    """kill -9 Redis (appendonly, appendfsync everysec), restart it on its AOF."""
    ctx.kill_redis()
    ctx.follow(ctx.args.down_for)
    ctx.restart_redis()


@fault("redis-lost", redis="none")
def redis_lost(ctx: "Ctx") -> None:
    """kill -9 Redis without persistence, restart it empty (the whole view and its functions lost);
    no snapshot yet: the sink rebuilds the view by replaying the block topics from their start."""
    ctx.kill_redis()
    ctx.follow(ctx.args.down_for)
    ctx.restart_redis()


@fault("redis-master", redis="cluster", sinks=2)
def redis_master(ctx: "Ctx") -> None:
    """kill -9 the Redis Cluster master serving most of the sharded view's shards (3 masters, 3
    replicas; its replica is promoted; two sinks write the view), then start it again (it rejoins as a replica)."""
    ctx.kill_redis()
    ctx.follow(ctx.args.down_for)
    ctx.restart_redis()


@fault("redis-lost-snapshot", redis="none", sink_args=("--snapshot-every", "4"))
def redis_lost_snapshot(ctx: "Ctx") -> None:
    """As redis-lost, with the sink snapshotting the view to Kafka every 4 s: the view is rebuilt
    from the latest snapshot and replayed from its offsets only."""
    ctx.kill_redis()
    ctx.follow(ctx.args.down_for)
    ctx.restart_redis()


@fault("pause-sink", sinks=2)
def pause_sink(ctx: "Ctx") -> None:
    """SIGSTOP one of two sinks for --pause-for s, SIGCONT; past the sinks' session timeout (10 s)
    the other sink takes its partitions."""
    ctx.pause("sink-0", ctx.args.pause_for)


@fault("pause-worker-only")
def pause_worker_only(ctx: "Ctx") -> None:
    """SIGSTOP the only Faust worker for --pause-for s (past its session timeout), SIGCONT."""
    ctx.pause("worker-0", ctx.args.pause_for)


@fault("pause-worker-of-two", workers=2)
def pause_worker_of_two(ctx: "Ctx") -> None:
    """SIGSTOP one of two Faust workers for --pause-for s, SIGCONT; past the workers' session
    timeout (10 s) the other takes its partitions."""
    ctx.pause("worker-1", ctx.args.pause_for)


@fault("pause-broker", brokers=3)
def pause_broker(ctx: "Ctx") -> None:
    """SIGSTOP the broker leading most raw/blocks partitions (not the controller) for --pause-for s, SIGCONT;
    past broker.session.timeout.ms (the dev stack's: 5 s) the controller fences it, its partitions get new leaders."""
    from kvbus.infra import stack

    leaders = ctx.partition_leaders()
    ctl = stack.controller()
    node = sorted(leaders, key=lambda b: (b == ctl, -len(leaders[b])))[0]
    ctx.notes.update(broker=node, leads=sorted(leaders[node]), controller=ctl)
    ctx.pause_broker(node, ctx.args.pause_for)


@fault("pause-redis", redis="aof")
def pause_redis(ctx: "Ctx") -> None:
    """SIGSTOP Redis for --pause-for s (the sink's and the probes' calls hang), SIGCONT."""
    own = ctx.own_redis
    assert isinstance(own, OwnRedis)

    pid = own.rec.pid
    ctx.pause_pid("redis", pid, ctx.args.pause_for, own.log_path, lambda: pid_alive(pid),
                  lambda: ctx.during(own.start))


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (a zombie of ours counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@fault("broker-lost", brokers=3)
def broker_lost(ctx: "Ctx") -> None:
    """kill -9 the broker leading most raw/blocks partitions (not the controller), never restarted;
    the flow goes on on the two left (min ISR 2). It is started again after the fault's figures."""
    from kvbus.infra import stack

    leaders = ctx.partition_leaders()
    ctl = stack.controller()
    node = sorted(leaders, key=lambda b: (b == ctl, -len(leaders[b])))[0]
    ctx.notes.update(broker=node, leads=sorted(leaders[node]), controller=ctl)
    ctx.kill_broker(node)
    ctx.lost_broker = node


@fault("redis-full", redis="none")
def redis_full(ctx: "Ctx") -> None:
    """Redis full (maxmemory just above its use, noeviction) for --down-for s, then maxmemory raised;
    the sink stops applying with an ERROR naming the cause, and catches up."""
    assert isinstance(ctx.own_redis, OwnRedis)
    r = redis.Redis.from_url(ctx.own_redis.url)
    used = int(r.info("memory")["used_memory"])
    r.config_set("maxmemory", str(used + 256 * 1024))
    ctx.mark("fault")
    ctx.notes["maxmemory"] = used + 256 * 1024
    port = ctx.ports["sink-0"]
    t0 = time.monotonic()
    ctx.follow(ctx.args.down_for + 20, until=lambda: scrape(port, "kvbus_sink_redis_oom") >= 1)
    full = scrape(port, "kvbus_sink_redis_oom") >= 1
    ctx.notes["full_after_s"] = round(time.monotonic() - t0, 2) if full else None
    ctx.follow(ctx.args.down_for)
    text = tail_text(ctx.child("sink-0").log_path, 0)
    errors = [ln for ln in text.splitlines() if " ERROR " in ln and "memory" in ln.lower()]
    ctx.notes["sink_error"] = errors[0][-240:] if errors else None
    ctx.notes["refusals"] = scrape(port, "kvbus_sink_redis_oom_refusals_total")
    r.config_set("maxmemory", "0")
    ctx.mark("restart")


@fault("redis-evict", redis="none")
def redis_evict(ctx: "Ctx") -> None:
    """maxmemory-policy allkeys-random set under the running sink, maxmemory half the view: Redis evicts
    keys; the sink notices, marks the view not ready and rebuilds it once the policy is noeviction again.

    The fault lasts until the sink counted the evictions (kvbus_sink_redis_evicted_keys_total); then
    the policy and maxmemory are restored and the rebuild is followed like any recovery."""
    assert isinstance(ctx.own_redis, OwnRedis)
    r = redis.Redis.from_url(ctx.own_redis.url)
    port = ctx.ports["sink-0"]
    used = int(r.info("memory")["used_memory"])
    r.config_set("maxmemory-policy", "allkeys-random")
    r.config_set("maxmemory", str(used // 2))
    ctx.mark("fault")
    seen: dict[str, float] = {}

    def evicted() -> bool:
        if "not_ready" not in seen and ready(port) is False:
            seen["not_ready"] = time.monotonic()
        return scrape(port, "kvbus_sink_redis_evicted_keys_total") > 0
    ctx.follow(30, until=evicted)  # a Redis still above maxmemory refuses writes: the sink may only see it later
    ctx.notes["redis_evicted"] = int(r.info("stats")["evicted_keys"])
    r.config_set("maxmemory", "0")
    r.config_set("maxmemory-policy", "noeviction")
    ctx.mark("restart")
    ctx.follow(30, until=evicted)
    ctx.notes["evicted_keys"] = scrape(port, "kvbus_sink_redis_evicted_keys_total")
    ctx.notes["counted_after_s"] = round(time.monotonic() - ctx.marks["fault"], 2) if evicted() else None
    ctx.notes["not_ready_after_s"] = round(seen["not_ready"] - ctx.marks["fault"], 2) if seen else None
    ctx.notes["sink_error"] = next((ln[-240:] for ln in tail_text(ctx.child("sink-0").log_path, 0).splitlines()
                                    if " ERROR " in ln and "evicted" in ln), None)


@fault("topic-recreated", sink_args=("--snapshot-every", "4"), exact=False)
def topic_recreated(ctx: "Ctx") -> None:
    """Delete the block topic the worker writes (``Run.block_topic``: layout 2's unless the run's environment
    says otherwise) and create it again empty while the sink (snapshotting every 4 s) and
    the worker run: the sink finds its stored offsets past the new log's end and rebuilds the view
    from the latest snapshot, the recreated partitions replayed from their start.

    What the deleted log held after the latest snapshot is gone with it, so the view is not expected
    to equal the truth (``view_exact`` is reported, not required); ``ok`` needs the rebuild
    (``notes.log_replaced``, ``notes.rebuilds``), the drain, and every probe published after the
    recreation visible."""
    from confluent_kafka.admin import AdminClient

    from kvbus.infra.dev_topics import ensure_topics

    settings = ctx.run.settings
    topic, port = ctx.run.block_topic(), ctx.ports["sink-0"]
    ctx.follow(30, until=lambda: scrape(port, "kvbus_sink_snapshots_total") >= 1)
    ctx.notes["snapshots_before"] = scrape(port, "kvbus_sink_snapshots_total")
    admin = AdminClient({"bootstrap.servers": settings.bootstrap})
    ctx.mark("fault")
    ctx.during(lambda: admin.delete_topics([topic], operation_timeout=30)[topic].result(30))
    ctx.follow(60, until=lambda: topic not in admin.list_topics(timeout=10).topics)

    def create() -> None:
        deadline = time.monotonic() + 60
        while True:  # refused while the deletion is still being finished (or created by a produce)
            try:
                ensure_topics(settings.bootstrap, [topic], settings.partitions, pl.cluster_replication(
                    settings.bootstrap))
                return
            except Exception:  # noqa: BLE001 - marked for deletion still: again
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
    ctx.during(create)
    ctx.mark("restart")
    ctx.follow(60, until=lambda: scrape(port, "kvbus_sink_log_replaced_total") >= 1)
    ctx.notes["log_replaced"] = scrape(port, "kvbus_sink_log_replaced_total")
    ctx.notes["rebuilds"] = scrape(port, "kvbus_sink_view_rebuilds_total")


def ready(port: int) -> Optional[bool]:
    """Whether the process serving probes on ``port`` answers /readyz with 200 (None: no answer)."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=1) as resp:
            return resp.status == 200
    except urllib.error.HTTPError as e:
        return e.code == 200
    except OSError:
        return None


# -- what a fault function works with ----------------------------------------------------

COUNTERS: dict[str, dict[str, str]] = {
    "sink": {"records": "kvbus_sink_records_total", "dups": "kvbus_sink_duplicates_skipped_total"},
    "worker": {"reports": "kvbus_streams_reports_total", "dups": "kvbus_streams_duplicates_total"},
    "bridge": {"acked": "kvbus_bridge_events_acked_total", "recovered": "kvbus_bridge_recovered_total",
               "resets": "kvbus_bridge_resets_total", "lost": "kvbus_bridge_lost_batches_total"},
}
"""Counters summed over every incarnation of a process kind (re-read figures)."""


class StageDied(RuntimeError):
    """A process the fault did not kill exited."""


class OwnRedis:
    """A redis-server of the benchmark's own (pid file in the cluster's run directory, so
    ``infra/stack down`` stops a leftover), with an AOF (``aof``: appendfsync policy) or none."""

    def __init__(self, run_dir: Path, log_dir: Path, data_dir: Path, aof: Optional[str]) -> None:
        from kvbus.infra import redis_server
        from kvbus.infra.stack_env import RedisSettings

        port = free_port()
        self.rs = RedisSettings(f"redis://127.0.0.1:{port}/0", "127.0.0.1", port)
        self.url = self.rs.url
        self.data = data_dir
        self.argv = redis_server.server_argv(self.rs, data_dir, aof=aof)
        self.pid_path = run_dir / f"redis-faults-{port}.pid"
        self.log_path = log_dir / f"redis-faults-{port}.log"
        self.rec: Any = None
        self.start()

    def start(self) -> None:
        from kvbus.infra import redis_server
        from kvbus.infra.procs import start_process, wait_until

        self.data.mkdir(parents=True, exist_ok=True)
        self.rec = start_process("redis-faults", self.argv, pid_path=self.pid_path, log_path=self.log_path,
                                 marker=redis_server.marker(self.rs), cwd=self.data)
        wait_until("redis (faults)", lambda: redis_server.ping(self.rs), timeout=30, records=[self.rec],
                   log=self.log_path, interval=0.05)

    def kill(self) -> None:
        os.kill(self.rec.pid, signal.SIGKILL)
        try:
            os.waitpid(self.rec.pid, 0)  # our child: reaped, so the port is free for the restart
        except ChildProcessError:
            pass

    def stop(self) -> None:
        from kvbus.infra.procs import stop_process

        if self.rec is not None:
            stop_process(self.rec, pid_path=self.pid_path, timeout=10)
        shutil.rmtree(self.data, ignore_errors=True)


class OwnRedisCluster:
    """A Redis Cluster of the benchmark's own (3 masters + 3 replicas, kvbus.infra.redis_cluster, state in
    ``root``): ``kill`` SIGKILLs the master serving most of the view's shards once every replica is
    in sync (a replica that never synced cannot take over), ``start`` starts it again (it rejoins as
    a replica of the master promoted in its place)."""

    def __init__(self, root: Path) -> None:
        from kvbus.infra import redis_cluster
        from kvbus.infra.stack_env import Paths

        self.paths = Paths(root).ensure()
        self.nodes = redis_cluster.plan(3, redis_cluster.free_base_port(3))
        self.url = redis_cluster.cluster_url(self.nodes)
        self.killed: Any = None
        self.start()

    def start(self) -> None:
        from kvbus.infra import redis_cluster

        redis_cluster.start(self.paths, self.nodes, timeout=60)

    def kill(self, prefix: str) -> None:
        from kvbus.infra.procs import read_pid
        from kvbus.sinks.view.sharded_store import ShardedRedisStore

        def in_sync() -> bool:
            return all(redis.Redis(host=n.host, port=n.port).info("replication").get("master_link_status") == "up"
                       for n in self.nodes if not n.master)
        deadline = time.monotonic() + 60
        while not in_sync():
            if time.monotonic() > deadline:
                raise RuntimeError("the cluster's replicas did not sync")
            time.sleep(0.2)
        store = ShardedRedisStore(self.url, prefix, load=False)
        owners = [store.node(s).port for s in range(store.nshards)]
        masters = [n for n in self.nodes
                   if redis.Redis(host=n.host, port=n.port).info("replication")["role"] == "master"]
        self.killed = max(masters, key=lambda n: owners.count(n.port))
        os.kill(read_pid(self.killed.pid_path(self.paths)).pid, signal.SIGKILL)

    def stop(self) -> None:
        from kvbus.infra import redis_cluster

        redis_cluster.stop(self.paths, self.nodes)
        shutil.rmtree(self.paths.root, ignore_errors=True)


@dataclass
class Ctx:
    """One fault's run: its processes (``run``), probes, samples, marks and notes."""

    args: argparse.Namespace
    run: pl.Run
    prober: pl.Prober
    sampler: pl.Sampler
    ports: dict[str, int]
    """Child name -> its metrics port."""
    own_redis: Optional[Any] = None
    """OwnRedis or OwnRedisCluster."""
    marks: dict[str, float] = field(default_factory=dict)
    """fault / restart -> time.monotonic()."""
    notes: dict[str, Any] = field(default_factory=dict)
    carried: dict[str, dict[str, float]] = field(default_factory=dict)
    """Kind -> counter -> sum over the incarnations that were killed."""
    woken: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Process paused and continued (:meth:`pause_pid`) -> ``at`` (when it was continued), ``log``
    and ``log_offset`` (its log and its size when paused), ``alive`` and ``restart`` (callables),
    ``crashed`` (set when it exited afterwards: it was started again)."""
    lost_broker: Optional[int] = None
    """A broker the fault killed for good (started again after the fault's figures)."""

    def mark(self, what: str) -> None:
        self.marks[what] = time.monotonic()
        log.info("%s at +%.1f s", what, self.marks[what] - self.marks.get("start", self.marks[what]))

    def check(self) -> None:
        """A woken process (:meth:`pause`) that exited is recorded as crashed and started again; any
        other process of the run that exited is :class:`StageDied`."""
        for name, w in self.woken.items():
            if "crashed" not in w and not w["alive"]():
                w["crashed"] = f"exited {time.monotonic() - w['at']:.1f} s after waking"
                w["last_lines"] = tail_lines(w["log"], w["log_offset"], 3)
                log.warning("%s %s: starting it again", name, w["crashed"])
                w["restart"]()
        report = self.run.children.stopped_report(ignore=("fleet",), tail=1500)
        if report:
            raise StageDied(report)

    def follow(self, seconds: float, until: Optional[Callable[[], bool]] = None) -> None:
        """Poll the probes for ``seconds`` (or until ``until()``), checking the processes."""
        end = time.monotonic() + max(0.0, seconds)
        last_check = 0.0
        while time.monotonic() < end:
            self.prober.poll()
            now = time.monotonic()
            if now - last_check > 0.5:
                last_check = now
                self.check()
                if until is not None and until():
                    return
            time.sleep(0.002)

    def during(self, fn: Callable[[], Any]) -> Any:
        """Run a blocking call (an infra restart) in a thread while following the probes."""
        box: dict[str, Any] = {}

        def go() -> None:
            try:
                box["value"] = fn()
            except BaseException as e:  # noqa: BLE001 - re-raised below
                box["error"] = e

        t = threading.Thread(target=go, daemon=True)
        t.start()
        while t.is_alive():
            self.follow(0.05)
        if "error" in box:
            raise box["error"]
        return box.get("value")

    # processes of the run
    def child(self, name: str) -> Child:
        return next(c for c in self.run.children.started if c.name == name)

    def kill(self, name: str) -> Child:
        """kill -9 child ``name`` (its counters scraped just before), forget it."""
        c = self.child(name)
        kind = name.split("-")[0]
        for key, metric in COUNTERS.get(kind, {}).items():
            self.carried.setdefault(kind, {}).setdefault(key, 0.0)
            self.carried[kind][key] += scrape(self.ports[name], metric)
        os.killpg(c.proc.pid, signal.SIGKILL)
        c.proc.wait()
        self.run.children.started.remove(c)
        self.mark("fault")
        return c

    def restart(self, old: Child, mark: bool = True) -> Child:
        """Start ``old``'s command again (same name, options and metrics port)."""
        new = self.run.children.start(old.name, *old.args)
        kind = old.name.split("-")[0]
        pids = self.run.pids.get(kind, [])
        self.run.pids[kind] = [new.proc.pid if p == old.proc.pid else p for p in pids]
        if mark:
            self.mark("restart")
        return new

    def pause(self, name: str, seconds: float) -> None:
        """SIGSTOP child ``name``'s process group for ``seconds`` (probes followed), then SIGCONT;
        from then on it is watched (:meth:`check`, :func:`woken_outcome`)."""
        c = self.child(name)

        def restart() -> None:
            self.run.children.started.remove(c)
            self.restart(c, mark=False)
        self.pause_pid(name, -c.proc.pid, seconds, c.log_path, lambda: c.proc.poll() is None, restart)

    def pause_pid(self, name: str, pid: int, seconds: float, log_path: Path, alive: Callable[[], bool],
                  restart: Callable[[], None]) -> None:
        """SIGSTOP ``pid`` (negative: a process group) for ``seconds``, then SIGCONT; watched from
        then on as ``name``: ``alive()`` false makes :meth:`check` call ``restart()``."""
        offset = log_path.stat().st_size if log_path.exists() else 0
        send = os.killpg if pid < 0 else os.kill
        # SIGCONT from a timer: following the probes blocks while a paused Redis does not answer
        cont = threading.Timer(seconds, lambda: send(abs(pid), signal.SIGCONT))
        send(abs(pid), signal.SIGSTOP)
        self.mark("fault")
        cont.start()
        try:
            self.follow(seconds)
        finally:
            cont.join()
        self.mark("restart")
        self.woken[name] = {"at": self.marks["restart"], "log": log_path, "log_offset": offset,
                            "alive": alive, "restart": restart}

    def pause_broker(self, node_id: int, seconds: float) -> None:
        from kvbus.infra import kafka_broker, stack
        from kvbus.infra.procs import alive_record
        from kvbus.infra.stack_env import Paths

        node = next(n for n in kafka_broker.plan(Paths(), 3) if n.node_id == node_id)
        rec = alive_record(node.pid_path)
        if rec is None:
            raise RuntimeError(f"kafka node {node_id} is not running")
        self.pause_pid(f"broker-{node_id}", rec.pid, seconds, node.log_path,
                       lambda: alive_record(node.pid_path) is not None,
                       lambda: self.during(lambda: stack.restart_broker(node_id)))

    def kill_restart(self, name: str) -> None:
        old = self.kill(name)
        self.follow(self.args.down_for)
        self.restart(old)

    def counters(self) -> dict[str, dict[str, float]]:
        """Kind -> counter -> total over every incarnation (live ones scraped now)."""
        out = {k: dict(v) for k, v in self.carried.items()}
        for c in self.run.children.started:
            kind = c.name.split("-")[0]
            for key, metric in COUNTERS.get(kind, {}).items():
                out.setdefault(kind, {}).setdefault(key, 0.0)
                out[kind][key] += scrape(self.ports[c.name], metric)
        return out

    # Kafka
    def partition_leaders(self) -> dict[int, list[str]]:
        """Broker id -> the run's raw and (framework-owned) block partitions it leads."""
        from kvbus.infra.dev_topics import admin_client

        md = admin_client(self.run.settings.bootstrap).list_topics(timeout=10)
        out: dict[int, list[str]] = {}
        for topic in (self.run.settings.topics.raw, self.run.block_topic()):
            for p, pm in md.topics[topic].partitions.items():
                out.setdefault(pm.leader, []).append(f"{topic.split('.', 1)[1]}-{p}")
        return out

    def kill_broker(self, node_id: int) -> None:
        from kvbus.infra import kafka_broker
        from kvbus.infra.procs import alive_record
        from kvbus.infra.stack_env import Paths

        node = next(n for n in kafka_broker.plan(Paths(), 3) if n.node_id == node_id)
        rec = alive_record(node.pid_path)
        if rec is None:
            raise RuntimeError(f"kafka node {node_id} is not running")
        os.kill(rec.pid, signal.SIGKILL)
        self.mark("fault")

    def restart_broker(self, node_id: int) -> None:
        from kvbus.infra import stack

        self.mark("restart")
        # a broker restarted on a loaded machine recovers every partition's log first: minutes
        res = self.during(lambda: stack.restart_broker(node_id, timeout=self.args.converge_timeout + 180))
        self.notes["restart_ready_s"] = res["seconds"]

    # Redis
    def kill_redis(self) -> None:
        assert self.own_redis is not None
        if isinstance(self.own_redis, OwnRedisCluster):
            self.own_redis.kill(self.run.prefix)
        else:
            self.own_redis.kill()
        self.mark("fault")

    def restart_redis(self) -> None:
        assert self.own_redis is not None
        self.mark("restart")
        self.during(self.own_redis.start)


# -- one fault -------------------------------------------------------------------------

def stage_args(args: argparse.Namespace, f: Fault) -> argparse.Namespace:
    """The options pipeline.py's helpers read (new_run, start_stages, start_fleet, drain)."""
    # one bridge per stream (sidecars, so that a bridge fault is one stream's); the live generator:
    # a run lasts until the fault is followed, a schedule not known up front to pregenerate
    return argparse.Namespace(replicas=args.replicas, tp=1, workers_procs=f.workers, sinks=f.sinks,
                              partitions=args.partitions, seed=args.seed, probe_every=args.probe_every,
                              base_port=free_port_block(2 * args.replicas), drain_timeout=args.drain_timeout,
                              streams_per_bridge=1, live_generator=True)


@dataclass
class Started:
    """A run whose stages and fleet play: what a fault or a soak follows it with."""

    ports: dict[str, int]
    """Metrics port of each stage process by name (``sink-0``, ``worker-1``, ``bridge-2-w0``)."""
    probe_log: Path
    """The fleet's probe log (one JSON line per probe published)."""
    manifest: Path
    """The fleet's truth: what every holder published (read at the end against the view)."""
    store: ResidencyStore
    """The run's view, read by the prober and the truth check."""
    prober: pl.Prober
    """Follows the probes into the view (freshness)."""


def start_run(run: pl.Run, pargs: argparse.Namespace, logs: Path, rate: float, seconds: float,
              sink_args: tuple[str, ...] = (), fleet_args: tuple[str, ...] = ()) -> Started:
    """Register the schemas, start ``run``'s stages (``sink_args`` added to each sink's command),
    then its fleet publishing ``rate`` engine events/s for ``seconds`` with probes (``fleet_args``
    added to ``kvbus fleet``'s command)."""
    from kvbus.schemas.registry import register

    for attempt in range(3):  # Apicurio now and then closes a connection unanswered (README)
        try:
            register(run.settings.registry_url, run.settings.topics, ("kvcr",), run.settings.security.registry)
            break
        except OSError as e:
            if attempt == 2:
                raise
            log.warning("schema registration failed (%s): again", e)
            time.sleep(1.0)
    pl.start_stages(run, pargs, sink_args=sink_args)
    run.pids.update(pl.service_pids(run.settings.redis_url))
    ports = {f"sink-{i}": p for i, p in enumerate(run.sink_ports)}
    ports.update({f"worker-{i}": p for i, p in enumerate(run.worker_ports)})
    ports.update({f"bridge-{i}-w0": p for i, p in enumerate(run.bridge_ports)})
    time.sleep(1.0)  # bridges connected before the first batch
    probe_log, manifest = logs / f"{run.run_id}-probes.jsonl", logs / f"{run.run_id}-manifest.json"
    store = open_store(run.settings.redis_url, run.prefix, load=False)  # sharded on a cluster URL
    prober = pl.Prober(probe_log, store)
    pl.start_fleet(run, pargs, [(rate, seconds)], probe_log, manifest, fleet_args)
    return Started(ports, probe_log, manifest, store, prober)


def run_fault(f: Fault, args: argparse.Namespace, base: Settings, state_dir: Path) -> dict[str, Any]:
    """Run fault ``f`` on a fresh run; returns its figures."""
    t_start = time.monotonic()
    out: dict[str, Any] = {"fault": f.name, "ok": False}
    own: Any = None
    if f.redis == "cluster":
        own = OwnRedisCluster(state_dir / "data" / f"rcluster-faults-{os.getpid()}")
        base = replace(base, redis_url=own.url)
    elif f.redis is not None:
        own = OwnRedis(state_dir / "run", state_dir / "logs", state_dir / "data" / f"redis-faults-{os.getpid()}",
                       aof=None if f.redis == "none" else "everysec")
        base = replace(base, redis_url=own.url)
    pargs = stage_args(args, f)
    run = pl.new_run(pargs, base, state_dir / "logs")
    out["run"] = run.run_id
    sampler: Optional[pl.Sampler] = None
    ctx: Optional[Ctx] = None
    try:
        started = start_run(run, pargs, state_dir / "logs", args.rate, 24 * 3600.0, sink_args=f.sink_args)
        ports, manifest, store, prober = started.ports, started.manifest, started.store, started.prober
        sampler = pl.Sampler(run)
        sampler.start()
        ctx = Ctx(args, run, prober, sampler, ports, own)
        ctx.mark("start")
        wait_steady(ctx)
        ctx.mark("steady")
        out["steady_after_s"] = round(ctx.marks["steady"] - ctx.marks["start"], 1)
        out["load_1m"] = round(os.getloadavg()[0], 1)  # the machine's load when the fault began
        ctx.follow(args.before)
        ctx.mark("steady_end")
        f.run(ctx)
        out["notes"] = ctx.notes
        converged = settle(ctx)
        ctx.mark("settled")
        out["settled"] = converged
        out.update(woken_figures(ctx.woken))
        fleet = ctx.child("fleet")
        run.children.stop(fleet)  # SIGTERM: the fleet writes its final manifest
        ctx.mark("fleet_stopped")
        try:
            drained = pl.drain(run, pargs, prober, sampler)
        except SystemExit as e:  # pipeline.check_alive: a stage exited
            raise StageDied(str(e)) from None
        out["drained"] = drained
        out["drain_s"] = round(time.monotonic() - ctx.marks["fleet_stopped"], 1)
        exact, diffs = pl.view_matches_truth(store, manifest) if manifest.exists() else (False, ["no manifest"])
        pos_ok, pos_diffs = positions_match(store, manifest) if manifest.exists() else (False, ["no manifest"])
        out.update(view_exact=exact, view_diffs=diffs[:5], positions_ok=pos_ok, position_diffs=pos_diffs[:5])
        if f.exact:
            out["ok"] = bool(drained and exact and pos_ok)
        else:  # what the fault needs instead (topic-recreated: the view rebuilt)
            out["ok"] = bool(drained and converged and ctx.notes.get("log_replaced"))
    except (Exception, SystemExit) as e:  # noqa: BLE001 - one fault failing must not stop the suite
        out["error"] = f"{type(e).__name__}: {e}"[:3000]
        log.warning("fault %s failed: %s", f.name, out["error"])
    finally:
        if ctx is not None and args.hops:
            try:
                out["hops"] = hop_windows(ctx)
            except Exception as e:  # noqa: BLE001 - Kafka or the registry gone: no split
                log.warning("hops of %s: %s", run.run_id, e)
        if ctx is not None:
            out.update(figures(ctx))
            ctx.prober.write_csv(state_dir / "logs" / f"{run.run_id}-probes.csv")
        if sampler is not None:
            sampler.stop.set()
        run.children.stop_all()
        if not args.keep:
            try:
                pl.cleanup(run)
            except Exception as e:  # noqa: BLE001 - Redis of a failed fault may be gone
                log.warning("cleanup of %s: %s", run.run_id, e)
        if own is not None:
            own.stop()
        if ctx is not None:
            out.update(restore_lost_broker(ctx, follow=False))
    out["duration_s"] = round(time.monotonic() - t_start, 1)
    return out


WOKEN_SIGNS: dict[str, str] = {
    "fenced": r"UNKNOWN_MEMBER_ID|ILLEGAL_GENERATION|FENCED_INSTANCE_ID|UnknownMemberId|IllegalGeneration|"
              r"CommitFailed|[Ff]enced|MAXPOLL|[Ss]ession timed out|REBALANCE_IN_PROGRESS|RebalanceInProgress|"
              r"member_id was not recognized|Heartbeat session expired|"
              # the sink's own fence: the view's stored offsets moved on under it (another sink applied
              # its partitions meanwhile), so the Redis functions refused its writes
              r"view changed|is not where this sink left it",
    "rejoined": r"kvbus\.sinks: assigned |[Aa]ssigned partitions|Resuming flow|Worker ready|Rebalance complete|"
                r"registered with the controller|Transition from STARTING to STARTED|"
                r"[Rr]eplica .* is in sync|[Ee]xpanding ISR|Broker \d+ is no longer fenced|"
                r"BrokerRegistrationChangeRecord\(brokerId=\d+, brokerEpoch=\d+, fenced=-1",
}
"""What a woken process's log says after SIGCONT (regular expressions): the group (or the controller)
had given up on it; it took part again (partitions assigned, flow resumed, broker unfenced)."""


def tail_text(path: Path, offset: int) -> str:
    """``path``'s text from byte ``offset`` ("" if it does not exist)."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")
    except FileNotFoundError:
        return ""


def tail_lines(path: Path, offset: int, n: int) -> list[str]:
    """The last ``n`` non-empty lines of ``path`` after byte ``offset``, each cut to 240 characters."""
    return [ln[-240:] for ln in tail_text(path, offset).splitlines() if ln.strip()][-n:]


def restore_lost_broker(ctx: Ctx, follow: bool = True) -> dict[str, Any]:
    """Start the broker a fault killed for good (:attr:`Ctx.lost_broker`, ``broker-lost``) again, so
    that the next fault has three brokers; ``{"lost_broker_restart_s": seconds}``, or ``{}`` when
    the fault lost none. ``follow``: follow the probes and the run's processes meanwhile (False once
    the run's processes are stopped)."""
    if ctx.lost_broker is None:
        return {}
    from kvbus.infra import stack

    node, ctx.lost_broker = ctx.lost_broker, None
    restart = lambda: stack.restart_broker(node, timeout=300)  # noqa: E731
    return {"lost_broker_restart_s": (ctx.during(restart) if follow else restart())["seconds"]}


def woken_figures(woken: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """``{"woken": {name: woken_outcome}, "woken_did": "name: did; ..."}`` of the processes a fault
    paused (:attr:`Ctx.woken`); empty when it paused none."""
    if not woken:
        return {}
    outcomes = {name: woken_outcome(w) for name, w in woken.items()}
    return {"woken": outcomes, "woken_did": "; ".join(f"{n}: {o['did']}" for n, o in outcomes.items())}


def woken_outcome(w: dict[str, Any]) -> dict[str, Any]:
    """What a paused process did once continued, from its log since the pause and its liveness:
    ``did`` is "crashed (restarted)", "fenced, rejoined", "fenced", "rejoined" or "carried on"
    (nothing in its log says the group or the controller had given up on it); with the first line
    of each sign seen (``signs``)."""
    import re

    text = tail_text(w["log"], w["log_offset"])
    signs = {}
    for kind, rx in WOKEN_SIGNS.items():
        m = re.search(rx, text)
        if m:
            start = text.rfind("\n", 0, m.start()) + 1
            end = text.find("\n", m.end())
            signs[kind] = text[start:end if end >= 0 else None][-240:]
    if "crashed" in w:
        did = "crashed (restarted)"
    else:
        did = ", ".join(k for k in ("fenced", "rejoined") if k in signs) or "carried on"
    out: dict[str, Any] = {"did": did, "signs": signs}
    if "crashed" in w:
        out.update(crashed=w["crashed"], last_lines=w.get("last_lines"))
    return out


def late_probes(prober: pl.Prober, since: float, now: float, late_s: float,
                until: float = float("inf")) -> tuple[list[bytes], int]:
    """Probes published in [since, until] that were (or, unseen at ``now``, already are) late:
    (seen late ones, outstanding late ones)."""
    seen_late, outstanding = [], 0
    for h, tp in prober.published.items():
        if not since <= tp <= until:
            continue
        ts = prober.seen.get(h)
        if ts is None:
            outstanding += now - tp > late_s
        elif ts - tp > late_s:
            seen_late.append(h)
    return seen_late, outstanding


class NeverSteady(RuntimeError):
    """The pipeline never became fresh after its start: no fault was injected."""


def wait_steady(ctx: Ctx) -> None:
    """Follow the flow from the fleet's start until the pipeline is fresh: the last
    ``--steady-probes`` probes old enough to judge (published more than ``--late-ms`` ago) were each
    visible within ``--late-ms``. :class:`NeverSteady` after ``--steady-timeout`` s, with what the
    last probes showed."""
    args = ctx.args
    k, late_s = args.steady_probes, args.late_ms / 1000.0
    deadline = ctx.marks["start"] + args.steady_timeout
    while True:
        ctx.follow(0.25)
        now = time.monotonic()
        judged = sorted((tp, h) for h, tp in ctx.prober.published.items() if tp <= now - late_s)[-k:]
        fresh = [ctx.prober.seen[h] - tp if h in ctx.prober.seen else now - tp for tp, h in judged]
        if len(judged) == k and max(fresh) <= late_s:
            return
        if now > deadline:
            late = sum(f > late_s for f in fresh)
            raise NeverSteady(
                f"the pipeline was never fresh within {args.steady_timeout:.0f} s of its start: of the last "
                f"{len(judged)} probes, {late} were not visible within {args.late_ms:.0f} ms (worst "
                f"{max(fresh, default=0) * 1000:.0f} ms; {len(ctx.prober.published)} probes published, "
                f"{len(ctx.prober.seen)} seen); no fault injected")


def settle(ctx: Ctx) -> bool:
    """Follow the flow after the restart until every probe is visible in time again and has been for
    ``--settle`` s (at most ``--converge-timeout`` s); returns whether it got there."""
    args = ctx.args
    t_fault, t_restart = ctx.marks["fault"], ctx.marks.get("restart", ctx.marks["fault"])
    late_s = args.late_ms / 1000.0
    deadline = t_restart + args.converge_timeout
    while time.monotonic() < deadline:
        ctx.follow(0.25)
        now = time.monotonic()
        seen_late, outstanding = late_probes(ctx.prober, t_fault, now, late_s)
        last = max((ctx.prober.seen[h] for h in seen_late), default=t_restart)
        # a probe published at the restart (or at a fault with none, broker-lost) is known to be
        # in time only --late-ms later: no settling before then
        if not outstanding and now - max(last, t_restart + late_s) >= args.settle:
            return True
    return False


def hop_windows(ctx: Ctx, bucket: float = 5.0) -> dict[str, Any]:
    """Each probe's freshness split into hops (pipeline.hop_figures: fleet -> raw record, raw -> blocks
    record, blocks record -> visible, by the records' Kafka timestamps) over windows of ``bucket`` s:
    ``warm+N`` from the fleet's start until the pipeline was fresh, ``steady``, then ``fault+N``
    until the fault was over."""
    m = ctx.marks
    windows: dict[str, tuple[float, float]] = {}
    t, warm_end = m["start"], m.get("steady", m.get("fault", time.monotonic()))
    while t < warm_end:  # never steady: the whole run is warm-up
        windows[f"warm+{t - m['start']:.0f}"] = (t, min(t + bucket, warm_end))
        t += bucket
    if "fault" not in m:
        return pl.hop_figures(ctx.run, ctx.prober, windows)
    if "steady" in m:
        windows["steady"] = (m["steady"], m["fault"])
    t, end = m["fault"], m.get("settled", m["fault"])
    while t < end:
        windows[f"fault+{t - m['fault']:.0f}"] = (t, min(t + bucket, end))
        t += bucket
    return pl.hop_figures(ctx.run, ctx.prober, windows)


def figures(ctx: Ctx) -> dict[str, Any]:
    """The fault's figures from the marks, the probes, the samples and the counters."""
    m, p = ctx.marks, ctx.prober
    out: dict[str, Any] = {}
    if "fault" not in m:
        return out
    t_fault, t_restart = m["fault"], m.get("restart", m["fault"])
    out["fault_window_s"] = round(t_restart - t_fault, 1)
    out["in_flight"] = events_between(p.events, t_fault, t_restart)
    late_s = ctx.args.late_ms / 1000.0
    end = m.get("settled", time.monotonic())  # probes published later were not followed
    seen_late, outstanding = late_probes(p, t_fault, end, late_s, until=end)
    fresh = [(p.seen[h] - tp) * 1000.0 for h, tp in p.published.items() if t_fault <= tp <= end and h in p.seen]
    out["late_probes"] = len(seen_late) + outstanding
    # when a fault's tail comes after the restart, which probes it was (to set beside the services' logs)
    out["late_after_restart"] = [
        {"published_s": round(p.published[h] - t_fault, 2), "stale_ms": round((p.seen[h] - p.published[h]) * 1000.0),
         "wall": time.strftime("%H:%M:%S", time.localtime(p.wall[h])) + f"{p.wall[h] % 1:.3f}"[1:],
         "holder": p.holders[h]}
        for h in sorted(seen_late, key=p.published.__getitem__) if p.published[h] >= t_restart][:40]
    out["max_stale_ms"] = round(max(fresh, default=0.0)) if not outstanding else None
    if outstanding:
        out["converge_from_fault_s"] = out["converge_from_restart_s"] = None
    else:
        done = max((p.seen[h] for h in seen_late), default=t_fault)
        out["converge_from_fault_s"] = round(done - t_fault, 2)
        out["converge_from_restart_s"] = round(max(0.0, done - t_restart), 2)
    t_steady = m.get("steady", m["start"])
    steady = [s for s in ctx.sampler.samples if t_steady <= s.t <= t_fault]
    # probes published within --late-ms of the fault may have been held up by it: not steady ones
    base_p = sorted((p.seen[h] - tp) * 1000.0 for h, tp in p.published.items()
                    if t_steady <= tp < t_fault - late_s and h in p.seen)
    out["steady_fresh_p50_ms"] = round(pl.quantile(base_p, 0.5), 1) if base_p else None
    out["steady_fresh_p99_ms"] = round(pl.quantile(base_p, 0.99), 1) if base_p else None
    warm = sorted((p.seen[h] - tp) * 1000.0 for h, tp in p.published.items()
                  if m["start"] <= tp < t_steady and h in p.seen)
    out["warmup_max_ms"] = round(warm[-1]) if warm else None
    out["lag_back_s"] = lag_back(steady, ctx.sampler.samples, t_restart)
    c = ctx.counters()
    sink_c, worker_c, bridge_c = c.get("sink", {}), c.get("worker", {}), c.get("bridge", {})
    out["worker_dups"] = int(worker_c.get("dups", 0))
    # TP=1: one report per event; every raw event the bridges had acknowledged is read once
    out["worker_reread"] = int(worker_c.get("reports", 0) + worker_c.get("dups", 0) - bridge_c.get("acked", 0))
    out["sink_dups"] = int(sink_c.get("dups", 0))
    try:
        out["sink_reread"] = int(sink_c.get("records", 0)) - topic_records(ctx)
    except Exception:  # noqa: BLE001 - Kafka unreachable: no figure
        out["sink_reread"] = None
    out["bridge_recovered"] = int(bridge_c.get("recovered", 0))
    out["bridge_resets"] = int(bridge_c.get("resets", 0))
    out["bridge_lost"] = int(bridge_c.get("lost", 0))
    return out


def events_between(events: list[tuple[float, int]], t0: float, t1: float) -> Optional[int]:
    """Engine events the fleet published in [t0, t1], from its log's (time, total) pairs."""
    before = [n for t, n in events if t <= t0]
    upto = [n for t, n in events if t <= t1]
    if not upto:
        return None
    return upto[-1] - (before[-1] if before else 0)


def lag_back(steady: list[pl.Sample], samples: list[pl.Sample], since: float) -> Optional[float]:
    """Seconds from ``since`` until both hops' lag are within their range before the fault."""
    def top(hop: str) -> int:
        return max([getattr(s, hop) for s in steady if getattr(s, hop) is not None], default=0)

    lim_raw, lim_blocks = top("lag_raw"), top("lag_blocks")
    for s in samples:
        if s.t >= since and s.lag_raw is not None and s.lag_blocks is not None \
                and s.lag_raw <= lim_raw and s.lag_blocks <= lim_blocks:
            return round(s.t - since, 1)
    return None


def topic_records(ctx: Ctx) -> int:
    """Records in the run's blocks topics (fresh topics: their end offsets)."""
    import re

    from confluent_kafka import Consumer, TopicPartition

    rx = re.compile(ctx.run.settings.topics.blocks_pattern()[1:])
    c = Consumer({"bootstrap.servers": ctx.run.settings.bootstrap, "group.id": f"{ctx.run.run_id}.count"})
    try:
        md = c.list_topics(timeout=10)
        total = 0
        for t, tm in md.topics.items():
            if rx.fullmatch(t):
                for p in tm.partitions:
                    low, high = c.get_watermark_offsets(TopicPartition(t, p), timeout=10)
                    total += high - low
        return total
    finally:
        c.close()


def positions_match(store: ResidencyStore, manifest: Path) -> tuple[bool, list[str]]:
    """Every holder's last applied position (the highest over its topics) against the last batch the
    fleet published to it: (seq, index) = (last_seq, last_events - 1). Lower: acknowledged events
    missing; higher: something applied that was not published."""
    data = json.loads(manifest.read_text())
    best: dict[str, tuple[int, int, int]] = {}
    for (holder, _topic), pos in store.positions().items():
        name = holder[:-2] if holder.endswith("#0") else holder
        best[name] = max(best.get(name, pos), pos)
    diffs = []
    for holder, rep in data["replicas"].items():
        name = holder[:-2] if holder.endswith("#0") else holder
        pub = rep["published"]
        want = (pub["last_seq"], pub["last_events"] - 1)
        got = best.get(name)
        if got is None or (got[1], got[2]) != want:
            diffs.append(f"{name}: applied up to {got and (got[1], got[2])} (epoch {got and got[0]}), "
                         f"published up to {want}")
    return not diffs, diffs


# -- output ----------------------------------------------------------------------------

COLUMNS = (
    ("fault", "fault"), ("ok", "ok"), ("steady_after_s", "fresh after s"), ("steady_fresh_p50_ms", "steady p50 ms"),
    ("in_flight", "in flight"), ("fault_window_s", "window s"),
    ("worker_reread", "worker re-read"), ("worker_dups", "worker dups"), ("sink_dups", "sink dups"),
    ("sink_reread", "sink re-read"),
    ("bridge_recovered", "bridge replayed"), ("max_stale_ms", "max stale ms"),
    ("converge_from_fault_s", "converge (fault) s"), ("converge_from_restart_s", "converge (restart) s"),
    ("lag_back_s", "lag back s"), ("view_exact", "view == truth"), ("positions_ok", "positions"),
    ("woken_did", "woken process did"),
)


def cell(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "NO"
    return str(v)


def text_table(rows: list[dict[str, Any]]) -> str:
    cols = [(k, h) for k, h in COLUMNS]
    cells = [[cell(r.get(k)) for k, _ in cols] for r in rows]
    widths = [max([len(h), *(len(c[i]) for c in cells)]) for i, (_, h) in enumerate(cols)]
    lines = [" | ".join(h.ljust(w) for (_, h), w in zip(cols, widths))]
    lines.append("-+-".join("-" * w for w in widths))
    lines += [" | ".join(c.ljust(w) for c, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def markdown_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| " + " | ".join(h for _, h in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(cell(r.get(k)) for k, _ in COLUMNS) + " |" for r in rows]
    return "\n".join(lines)


# -- main ------------------------------------------------------------------------------

def add_load_args(p: argparse.ArgumentParser) -> None:
    """The load a fault run or a soak runs under: the fleet's rate and replicas, the topics' partitions."""
    p.add_argument("--rate", type=float, default=1500.0, help="engine events/s the fleet publishes (default 1500)")
    p.add_argument("--replicas", type=int, default=4, help="engine replicas = bridges (default 4)")
    p.add_argument("--partitions", type=int, default=None,
                   help="partitions of the run's topics (default KVBUS_PARTITIONS)")


def add_fault_args(p: argparse.ArgumentParser) -> None:
    """The options of how a fault is run and followed (the fault functions and :func:`settle` read
    them), shared with benchmarks/soak.py."""
    p.add_argument("--down-for", type=float, default=10.0, help="seconds a killed process stays down (default 10)")
    p.add_argument("--registry-down", type=float, default=20.0, help="seconds the registry stays stopped (default 20)")
    p.add_argument("--late-ms", type=float, default=500.0,
                   help="a probe not visible within this many ms is late (default 500)")
    p.add_argument("--settle", type=float, default=3.0,
                   help="seconds every probe must be in time before the fault counts as over (default 3)")
    p.add_argument("--converge-timeout", type=float, default=120.0,
                   help="seconds after the restart to wait for the view to be fresh again (default 120)")
    p.add_argument("--pause-for", type=float, default=15.0,
                   help="seconds a paused (SIGSTOP) process stays stopped: past the sinks' (10 s) and workers' (6 s) "
                        "session timeouts and the brokers' broker.session.timeout.ms (dev stack: 5 s) (default 15)")


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--list", action="store_true", help="list the faults and exit")
    p.add_argument("--faults", default=",".join(FAULTS), help="comma-separated faults to run, in order (default all)")
    p.add_argument("--repeat", type=int, default=1, help="run the selection this many times in a row (default 1)")
    add_load_args(p)
    p.add_argument("--probe-every", type=float, default=0.05, help="seconds between freshness probes (default 0.05)")
    p.add_argument("--before", type=float, default=5.0,
                   help="seconds of measured steady flow before the fault, once the pipeline is fresh (default 5)")
    p.add_argument("--steady-probes", type=int, default=40,
                   help="the pipeline is fresh when this many probes in a row were visible within --late-ms "
                        "(default 40: 2 s at the default --probe-every)")
    p.add_argument("--steady-timeout", type=float, default=180.0,
                   help="seconds after the start to wait for the pipeline to be fresh before giving up (default 180)")
    add_fault_args(p)
    p.add_argument("--drain-timeout", type=float, default=90.0,
                   help="seconds to wait for the pipeline to drain (default 90)")
    p.add_argument("--seed", type=int, default=11, help="fleet seed (default 11)")
    p.add_argument("--hops", action="store_true",
                   help="after each fault, split the probes' freshness into hops (bridge, worker, sink) per 5 s "
                        "from the start (reads the run's raw and blocks topics back)")
    p.add_argument("--keep", action="store_true", help="leave each fault's topics and Redis keys")
    p.add_argument("--keep-cluster", action="store_true", help="leave the cluster up even if this run started it")
    p.add_argument("--use-env", action="store_true",
                   help="use the caller's KVBUS_* settings instead of the fault cluster's (CLUSTER_ENV)")
    return p.parse_args(argv)


def cluster_up(use_env: bool) -> dict[str, Any]:
    """Start (or confirm) the cluster and return ``stack.up``'s answer: 3 brokers, or with ``--use-env`` the
    caller's stack as it runs if it runs (its broker count), so that a run can use a one-broker dev or test
    stack (faults that need three brokers are refused there, :func:`cluster_fits`)."""
    from kvbus.infra import stack

    return stack.up(None if use_env and stack.status().get("ready") else 3)


def cluster_fits(faults: list[Fault], brokers: int) -> None:
    """Raise SystemExit naming the ``faults`` that need more than the cluster's ``brokers``."""
    short = [f.name for f in faults if f.brokers > brokers]
    if short:
        raise SystemExit(f"faults {short} need 3 Kafka brokers; this cluster has {brokers} "
                         "(without --use-env the benchmark runs its own three-broker cluster)")


def teardown_command() -> str:
    env = " ".join(f"{k}={os.environ[k]}" for k in CLUSTER_ENV if k in os.environ)
    return f"{env} infra/stack down"


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if args.list:
        for f in FAULTS.values():
            extra = f" [{f.workers} workers]" if f.workers > 1 else ""
            extra += f" [{f.brokers} brokers]" if f.brokers > 1 else ""
            kind = {"aof": "AOF everysec", "none": "no persistence", "cluster": "a 3-master Redis Cluster"}
            extra += f" [own Redis: {kind[f.redis]}]" if f.redis else ""
            print(f"{f.name:<14} {f.doc}{extra}")
        return 0
    names = [n.strip() for n in args.faults.split(",") if n.strip()]
    unknown = [n for n in names if n not in FAULTS]
    if unknown:
        raise SystemExit(f"unknown faults {unknown}; --list shows them")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    def interrupted(signum: int, _frame: Any) -> None:  # SIGTERM (SIGINT is ignored in a background job)
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, interrupted)  # the run's processes stopped, the cluster as it was started
    logging.getLogger("kvbus.bench").setLevel(logging.WARNING)
    from kvbus.infra import stack

    st = stack.status()
    started = not st.get("ready")
    if started:
        print(f"bringing the fault cluster up (3 brokers, state {os.environ.get('KVBUS_STATE_DIR')}) ...", flush=True)
    info = cluster_up(args.use_env)
    try:
        cluster_fits([FAULTS[n] for n in names], int(info["brokers"]))
    except SystemExit:
        if started and not args.keep_cluster:
            stack.down()
        raise
    print(f"cluster: {info['bootstrap']} (replication {info['replication']}), registry {info['registry_url']}, "
          f"redis {info['redis_url']}; tear down: {teardown_command()}", flush=True)
    state_dir = Path(info["state_dir"])
    base = Settings.from_env()
    results: list[dict[str, Any]] = []
    t0 = time.monotonic()
    try:
        for rep in range(args.repeat):
            for name in names:
                print(f"== {name}{f' (round {rep + 1})' if args.repeat > 1 else ''}: {FAULTS[name].doc}", flush=True)
                r = run_fault(FAULTS[name], args, base, state_dir)
                r["round"] = rep + 1
                results.append(r)
                print(text_table([r]), flush=True)
                for k in ("error", "view_diffs", "position_diffs", "woken"):
                    if r.get(k):
                        print(f"  {k}: {r[k]}", flush=True)
                if r.get("notes"):
                    print(f"  notes: {r['notes']}", flush=True)
    finally:
        print(f"\n== all faults ({time.monotonic() - t0:.0f} s)\n{text_table(results)}\n", flush=True)
        print(markdown_table(results) + "\n", flush=True)
        if started and not args.keep_cluster:
            stack.down()
            print("fault cluster stopped", flush=True)
        else:
            print(f"fault cluster left up; tear down: {teardown_command()}", flush=True)
    summary = {"cluster": info["bootstrap"], "rate_ev_s": args.rate, "replicas": args.replicas,
               "down_for_s": args.down_for, "late_ms": args.late_ms, "total_s": round(time.monotonic() - t0, 1),
               "all_ok": all(r.get("ok") for r in results), "faults": results}
    print(json.dumps(summary, default=str))
    return 0 if summary["all_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
