"""``kvbus top`` against a running pipeline on the real stack: its ``--once --json`` numbers match
what the pipeline was given (events, the view per replica and tier, lag, a dead letter), and the
live screen under tmux shows the same, with a bridge that does not answer shown as unreachable.
Also: with nothing reachable it keeps running and says what is unreachable."""
from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid

import pytest

from kvbus.children import free_port
from kvbus.schemas.events import BlockRemoved, BlockStored
from kvbus.schemas.hashing import block_hashes
from kvbus.simulator.fleet import Fleet, FleetConfig, ScriptBatch
from kvbus.top.metrics import quantile
from kvbus.top.top_config import parse_endpoints
from tests.pipeline import Pipeline, RawProducer, Waiting, env_for, eventually
from tests.tmux import TmuxPane

BS = 16
PROMPT = list(range(1, 4 * BS + 1))  # 4 blocks
HASHES = block_hashes(PROMPT, BS)


def stored(first: int, last: int, medium: str = "GPU", ownership: str | None = None) -> BlockStored:
    return BlockStored(block_hashes=HASHES[first:last + 1], parent_block_hash=HASHES[first - 1] if first else None,
                       token_ids=PROMPT[first * BS:(last + 1) * BS], block_size=BS, medium=medium, ownership=ownership)


SCRIPT = [
    ScriptBatch("replica-0", [stored(0, 3)]),
    ScriptBatch("replica-0", [BlockRemoved(block_hashes=[HASHES[3]], medium="GPU")]),
    ScriptBatch("replica-1", [stored(0, 1), stored(0, 3, "CPU")]),
    ScriptBatch("replica-1", [stored(0, 3, "CPU", ownership="kvcr")]),
]
ENGINE_EVENTS = sum(len(b.events) for b in SCRIPT)  # 5
VIEW = {"replica-0": {"GPU": 3}, "replica-1": {"CPU": 4, "CPU@kvcr": 4, "GPU": 2}}


#: The live screen gets this many times as long as ``kvbus top --once`` took on the same sources
#: (a start and a snapshot) to show what the test waits for, and at least SCREEN_MIN_S: its own start,
#: a snapshot or two, and the pane's refreshes, on a machine as busy as that run found it.
SCREEN_RUNS = 6
SCREEN_MIN_S = 30.0


def screen_budget(once_s: float) -> float:
    """Seconds the live screen may take, from what ``kvbus top --once`` took (``once_s``)."""
    return max(SCREEN_MIN_S, SCREEN_RUNS * once_s)


def top_once(settings, *args: str) -> tuple[dict, float]:
    """``kvbus top --once --json <args>`` as a process: its snapshot, and the seconds it took."""
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "kvbus", "top", "--once", "--json", *args], env=env_for(settings),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout), time.monotonic() - t0


class TopSampler:
    """Snapshots as ``kvbus top`` takes them, from one collector in this process sampled on every call
    (what the live console does every interval; rates span the time between two calls), so polling a
    pipeline starts no process. The ``--once --json`` command is checked once, on the settled state."""

    def __init__(self, settings, *args: str) -> None:
        from kvbus.cli import build_parser
        from kvbus.top.collect import Collector
        from kvbus.top.top_config import top_config

        self.collector = Collector(top_config(build_parser("top").parse_args(["top", *args])), settings)
        self.collector.collect()

    def snap(self) -> dict:
        return self.collector.collect()

    def close(self) -> None:
        self.collector.close()


@pytest.mark.integration
def test_top_shows_a_running_pipeline(test_settings, tmp_path) -> None:
    settings = test_settings
    run = uuid.uuid4().hex[:8]
    prefix, worker_group, sink_group = f"top{run}:", f"streams-{run}", f"sink-{run}"
    worker_port, sink_port, dead_port = free_port(), free_port(), free_port()
    pipeline = Pipeline(settings, tmp_path)
    fleet = Fleet(FleetConfig(replicas=2, base_port=0, format="vllm-0.33")).start()
    tmux = None
    try:
        pipeline.start("sink", "sink", "--group", sink_group, "--prefix", prefix, "--metrics-port", str(sink_port))
        pipeline.start("worker", "worker", "--app-id", worker_group, "--workdir", str(tmp_path),
                       "--metrics-port", str(worker_port))
        bridge_ports = []
        for s in fleet.streams():
            bridge_ports.append(free_port())
            pipeline.start(f"bridge-{s.replica}", "bridge", "--endpoint", s.endpoint, "--replay-endpoint",
                           s.replay_endpoint, "--replica", s.replica, "--metrics-port", str(bridge_ports[-1]))
        fleet.play(SCRIPT)
        raw = RawProducer(settings)
        raw.send_raw(b"replica-9#0", b"not an EventBatch")  # the worker dead-letters it: reason decode
        raw.flush()
        args = ("--bridges", ",".join(map(str, [*bridge_ports, dead_port])), "--workers", str(worker_port),
                "--sinks", str(sink_port), "--worker-group", worker_group, "--sink-group", sink_group,
                "--prefix", prefix, "--interval", "0.5")

        sampler = TopSampler(settings, *args)

        def settled() -> dict | Waiting:
            """Everything has gone through and every process's metrics say so (a worker syncs its
            counters every sweep, a sink its view gauges every few seconds when caught up)."""
            snap = sampler.snap()
            hops = snap["kafka"].get("hops") or []
            flow = [snap["flow"][k]["total"] for k in ("in", "consolidated", "applied")]
            dead = [(r["stage"], r["reason"], r["total"]) for r in snap["dead_letters"]["rows"] if r["total"]]
            sinks = snap["sinks"]
            dlq = snap["dead_letters"]["topic"] or {}  # None while Kafka is unreachable (snap["kafka"]["error"])
            done = (snap["view"].get("replicas") == VIEW and len(hops) == 2 and all(h["lag"] == 0 for h in hops)
                    and flow == [ENGINE_EVENTS] * 3 and dead == [("worker", "decode", 1)]
                    and dlq.get("records") == 1
                    and sinks[0]["up"] and sinks[0]["gauges"]["view_holders"] == 2)
            return snap if done else Waiting(view=snap["view"].get("replicas"), lags=[h["lag"] for h in hops],
                                             lagging=[p for h in hops for p in h["partitions"] if p["lag"]],
                                             flow=flow, dead=dead, dlq=dlq.get("records"),
                                             kafka_error=snap["kafka"].get("error"),
                                             sink=(sinks[0]["up"], sinks[0].get("gauges", {}).get("view_holders")))

        try:
            eventually(settled, 120, pipeline, interval=0.5)
        finally:
            sampler.close()
        snap, once_s = top_once(settings, *args)  # the command itself, on the settled pipeline

        # flow: every engine event acknowledged by Kafka, consolidated (passed through: TP=1), applied
        assert snap["flow"]["in"]["total"] == ENGINE_EVENTS
        assert snap["flow"]["consolidated"]["total"] == ENGINE_EVENTS
        assert snap["flow"]["applied"]["total"] == ENGINE_EVENTS
        assert snap["flow"]["in"]["per_s"] == 0.0  # nothing flows any more
        # bridges: two up, the third endpoint unreachable
        by_endpoint = {b["endpoint"]: b for b in snap["bridges"]}
        assert [by_endpoint[f"127.0.0.1:{p}"]["up"] for p in bridge_ports] == [True, True]
        acked = sorted(by_endpoint[f"127.0.0.1:{p}"]["counters"]["events_acked"]["total"] for p in bridge_ports)
        assert acked == [2, 3]
        resets = sum(by_endpoint[f"127.0.0.1:{p}"]["counters"]["resets"]["total"] for p in bridge_ports)
        assert by_endpoint[f"127.0.0.1:{dead_port}"] == {
            "endpoint": f"127.0.0.1:{dead_port}", "up": False,
            "error": f"unreachable: 127.0.0.1:{dead_port} (connection refused)"}
        # lag per hop and partition, from Kafka
        raw_hop, blocks_hop = snap["kafka"]["hops"]
        assert (raw_hop["group"], blocks_hop["group"]) == (worker_group, sink_group)
        assert {p["topic"] for p in raw_hop["partitions"]} == {settings.topics.raw}
        assert len(raw_hop["partitions"]) == settings.partitions
        # both block layouts count: the worker writes layout 2's topics; layout 1's that exist (empty) are read too
        names = settings.topics
        hop_topics = {p["topic"] for p in blocks_hop["partitions"]}
        assert {names.packed, names.for_ownership("kvcr", packed=True)} <= hop_topics
        assert hop_topics <= {names.for_ownership(o, packed=packed) for o in (None, "kvcr") for packed in (True, False)}
        assert raw_hop["end"] == len(SCRIPT) + 1 + resets  # engine batches, the bad record, any reset marker
        # the worker: nothing pending, no incomplete
        (worker,) = snap["workers"]
        assert worker["up"] and worker["gauges"]["pending_aggregates"] == 0
        assert snap["incomplete"]["reasons"] == {}
        # dead letters: the bad raw record, per stage and reason, and in the topic
        assert [r for r in snap["dead_letters"]["rows"] if r["total"]] == [
            {"stage": "worker", "reason": "decode", "total": 1.0, "per_s": 0.0}]
        # the sink's gauges and the view read from Redis agree
        (sink,) = snap["sinks"]
        assert sink["gauges"]["view_holders"] == 2 and sink["gauges"]["stale_holders"] == 0
        assert snap["view"]["state"] == "ready" and snap["view"]["tiers"] == ["CPU", "CPU@kvcr", "GPU"]
        assert snap["view"]["size"]["entries"] == sum(sum(t.values()) for t in VIEW.values())
        assert [f["hop"] for f in snap["freshness"]] == [
            "bridge: produce -> Kafka ack", "worker: one batch", "sink: one batch -> Redis"]

        # the live screen shows the same
        tmux = TmuxPane([sys.executable, "-m", "kvbus", "top", *args], env_for(settings), width=200, height=80)

        partition_lags = " ".join(f"p{i} 0" for i in range(settings.partitions))

        def screen_shows() -> str | Waiting:
            """The screen shows the settled pipeline."""
            text = tmux.screen()
            assert not tmux.exited(text), text
            rows = {line.strip("│ ").split()[0]: line.strip("│ ").split() for line in text.splitlines()
                    if line.strip("│ ").startswith(("replica-0 ", "replica-1 "))}
            wanted = {"replica-0 row": rows.get("replica-0") == ["replica-0", "0", "0", "3", "3"],
                      "replica-1 row": rows.get("replica-1") == ["replica-1", "4", "4", "2", "10"],
                      "bridges": "bridges: 2 up, 1 down" in text,
                      "dead bridge": f"unreachable: 127.0.0.1:{dead_port} (connection refused)" in text,
                      "dlq": f"{settings.topics.dlq} holds 1 records" in text,
                      "worker lag": f"raw -> worker ({worker_group}): lag 0" in text,
                      "partition lags": f"{settings.topics.raw} lag by partition: {partition_lags}" in text}
            missing = [name for name, ok in wanted.items() if not ok]
            return Waiting(missing=missing, rows=rows, screen=text) if missing else text

        text = eventually(screen_shows, screen_budget(once_s), interval=0.5)
        assert "state ready" in text and "unreachable: Kafka" not in text and "unreachable: Redis" not in text
        # the dead-letter row (in the right-hand column: the line also crosses the lag panel)
        assert any(" ".join(line.replace("│", " ").split()).find("worker decode 1 ") >= 0
                   for line in text.splitlines()), text
    finally:
        if tmux is not None:
            tmux.close()
        pipeline.stop()
        fleet.stop()


def test_top_says_what_is_unreachable_and_keeps_running(tmp_path) -> None:
    """No Kafka, Redis or process answers: ``--once --json`` exits 0 with an error per source, and the
    live screen says "unreachable: ..." for each, keeps refreshing, and Ctrl-C ends it with exit code 0."""
    from kvbus.runtime.settings import Settings

    nothing = free_port()
    env = {**env_for(Settings()), "KVBUS_BOOTSTRAP": f"127.0.0.1:{nothing}",
           "KVBUS_REDIS_URL": f"redis://127.0.0.1:{nothing}/0"}
    args = ["--bridges", str(nothing), "--workers", str(nothing), "--sinks", str(nothing), "--interval", "0.5"]
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "kvbus", "top", "--once", "--json", *args], env=env,
                         capture_output=True, text=True, timeout=60)
    once_s = time.monotonic() - t0
    assert out.returncode == 0, out.stderr
    snap = json.loads(out.stdout)
    assert snap["kafka"]["error"].startswith(f"unreachable: Kafka at 127.0.0.1:{nothing} (")
    assert snap["view"]["error"] == f"unreachable: Redis at redis://127.0.0.1:{nothing}/0 (" + \
        snap["view"]["error"].split(" (", 1)[1]
    assert [e["up"] for e in snap["bridges"] + snap["workers"] + snap["sinks"]] == [False, False, False]
    assert snap["flow"]["in"] == {"total": None, "per_s": None}
    assert snap["dead_letters"] == {"rows": [], "topic": None}

    tmux = TmuxPane([sys.executable, "-m", "kvbus", "top", *args], env, width=200, height=60)
    try:
        seen: set[str] = set()

        def refreshed_twice() -> bool | Waiting:
            """Two snapshots (two header times) that each say what is unreachable."""
            text = tmux.screen()
            assert not tmux.exited(text), text
            missing = [what for what in ("Kafka at", "Redis at", f"127.0.0.1:{nothing}")
                       if f"unreachable: {what}" not in text]
            if not missing:
                seen.add(text.splitlines()[0])  # the header carries the time of the snapshot
            return len(seen) >= 2 or Waiting(headers=sorted(seen), missing=missing, screen=text)

        eventually(refreshed_twice, screen_budget(once_s), interval=0.3)
        tmux.send_keys("C-c")  # quits cleanly: the screen is given back and the exit code is 0
        def exited() -> str | Waiting:
            """The console has ended."""
            text = tmux.screen()
            return text if tmux.exited(text) else Waiting(screen=text)

        text = eventually(exited, screen_budget(once_s), interval=0.3)
        assert "[program exited with 0]" in text and "unreachable" not in text
    finally:
        tmux.close()


def test_bad_arguments_exit_2(capsys) -> None:
    from kvbus.cli import main

    assert main(["top", "--json"]) == 2
    assert main(["top", "--bridges", "host:port"]) == 2
    assert main(["top", "--interval", "0"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "kvbus top: --json needs --once",
        "kvbus top: argument --bridges: expected [host:]port or [host:]first-last, comma-separated, got 'host:port' "
        "(see kvbus top --help)",
        "kvbus top: --interval must be positive"]


def test_endpoint_lists_and_quantiles() -> None:
    assert parse_endpoints("9410-9412, host:9401") == (
        "127.0.0.1:9410", "127.0.0.1:9411", "127.0.0.1:9412", "host:9401")
    with pytest.raises(ValueError):
        parse_endpoints("host:port")
    # 10 observations: 5 under 1 ms, 4 in (1, 2] ms, 1 above 2 ms (PromQL's histogram_quantile rules)
    buckets = {0.001: 5.0, 0.002: 9.0, float("inf"): 10.0}
    assert quantile(0.5, buckets) == 0.001
    assert quantile(0.7, buckets) == pytest.approx(0.0015)
    assert quantile(0.99, buckets) == 0.002  # in +Inf: the largest finite bound
    assert quantile(0.5, {0.001: 0.0, float("inf"): 0.0}) is None


def test_the_command_the_demo_prints_watches_the_demos_processes(monkeypatch) -> None:
    """``kvbus demo`` prints a ``kvbus top`` command; parsed by kvbus's own parser it names the
    demo's metrics ports and groups (and plain ``kvbus top`` defaults to the demo's defaults)."""
    import shlex

    from kvbus.cli import build_parser
    from kvbus.demo import top_command
    from kvbus.demo_layout import BRIDGE_METRICS_BASE, SINK_GROUP, SINK_METRICS_PORT, WORKER_GROUP, WORKER_METRICS_PORT
    from kvbus.top.top_config import top_config

    for var in ("KVBUS_TOP_BRIDGES", "KVBUS_TOP_WORKERS", "KVBUS_TOP_SINKS", "KVBUS_STREAMS_APP_ID",
                "KVBUS_SINK_GROUP"):
        monkeypatch.delenv(var, raising=False)
    argv = shlex.split(top_command(5))[1:]
    cfg = top_config(build_parser("top").parse_args(argv))
    assert cfg.bridges == tuple(f"127.0.0.1:{BRIDGE_METRICS_BASE + i}" for i in range(5))
    assert (cfg.workers, cfg.sinks) == ((f"127.0.0.1:{WORKER_METRICS_PORT}",), (f"127.0.0.1:{SINK_METRICS_PORT}",))
    assert (cfg.worker_group, cfg.sink_group) == (WORKER_GROUP, SINK_GROUP)
    default = top_config(build_parser("top").parse_args(["top"]))
    assert default.bridges == cfg.bridges[:3] and default.workers == cfg.workers and default.sinks == cfg.sinks


def _records(settings, topic: str) -> int:
    """Records ``topic`` holds now (high - low watermark over its partitions), read from Kafka here."""
    from confluent_kafka import Consumer, TopicPartition

    c = Consumer({"bootstrap.servers": settings.bootstrap, "group.id": f"t-{uuid.uuid4().hex}"})
    try:
        parts = c.list_topics(topic, timeout=10).topics[topic].partitions
        return sum(hi - lo for lo, hi in (c.get_watermark_offsets(TopicPartition(topic, p), timeout=10) for p in parts))
    finally:
        c.close()


@pytest.mark.integration
def test_top_shows_incompletes_of_tensor_parallel_workers(test_settings, tmp_path) -> None:
    """A TP=2 replica whose workers each omit some reports: while it streams, the workers panel shows
    incompletes and their share of consolidated events; once the window has passed, no aggregate is
    pending and the incompletes per reason add up to the records on the incomplete topic."""
    from kvbus.children import free_port_block

    settings = test_settings
    run = uuid.uuid4().hex[:8]
    worker_port, sink_port = free_port(), free_port()
    base = free_port_block(4)
    pipeline = Pipeline(settings, tmp_path)
    try:
        pipeline.start("worker", "worker", "--app-id", f"streams-{run}", "--workdir", str(tmp_path),
                       "--metrics-port", str(worker_port), "--window", "1")
        for w in range(2):
            pipeline.start(f"bridge-w{w}", "bridge", "--endpoint", f"tcp://127.0.0.1:{base + 2 * w}",
                           "--replay-endpoint", f"tcp://127.0.0.1:{base + 2 * w + 1}", "--replica", "replica-0",
                           "--worker-rank", str(w), "--workers", "2")
        # the fleet streams until the console has seen incompletes, however long the worker takes to start
        pipeline.start("fleet", "fleet", "--replicas", "1", "--workers", "2", "--drop-rate", "0.2",
                       "--base-port", str(base), "--rate", "20", "--duration", "600")
        fleet = pipeline.children.started[-1].proc
        args = ("--bridges", "", "--workers", str(worker_port), "--sinks", str(sink_port),
                "--worker-group", f"streams-{run}", "--sink-group", f"sink-{run}", "--interval", "0.5")
        sampler = TopSampler(settings, *args)

        def streaming_with_incompletes() -> dict | Waiting:
            """The workers panel shows a share of incompletes while the fleet streams."""
            snap = sampler.snap()
            return snap if (snap["incomplete"]["share"] or 0) > 0 else Waiting(
                incomplete=snap["incomplete"], workers=[w["up"] for w in snap["workers"]])

        snap = eventually(streaming_with_incompletes, 120, pipeline, interval=0.5)
        fleet.terminate()
        fleet.wait(30)
        assert set(snap["incomplete"]["reasons"]) <= {"window", "cleared", "disordered"}  # streams/metrics.py
        # the share is of TP-consolidated events over the same interval (bursts of expiries can exceed 1)
        inc = sum(v["per_s"] for v in snap["incomplete"]["reasons"].values())
        (worker,) = snap["workers"]
        assert snap["incomplete"]["share"] == pytest.approx(inc / worker["counters"]["consolidated"]["per_s"])

        def settled() -> dict | Waiting:
            """No aggregate pending, no raw lag, and the incompletes counted equal the incomplete topic's records."""
            snap = sampler.snap()
            (worker,) = snap["workers"]
            done = (worker["up"] and worker["gauges"]["pending_aggregates"] == 0
                    and snap["kafka"]["hops"][0]["lag"] == 0)
            # the counters and the topic meet once the last Incomplete records are acknowledged
            total = sum(v["total"] for v in snap["incomplete"]["reasons"].values())
            records = _records(settings, settings.topics.incomplete)
            return snap if done and total == records else Waiting(
                up=worker["up"], pending=worker.get("gauges", {}).get("pending_aggregates"),
                raw_lag=snap["kafka"]["hops"][0]["lag"], counted=total, records=records)

        try:
            eventually(settled, 120, interval=0.5)
        finally:
            sampler.close()
        snap, _ = top_once(settings, *args)  # the command itself, on the settled pipeline
        assert sum(v["total"] for v in snap["incomplete"]["reasons"].values()) > 0
        assert snap["flow"]["consolidated"]["total"] > 0
        (sink,) = snap["sinks"]  # no sink runs in this test
        assert sink == {"endpoint": f"127.0.0.1:{sink_port}", "up": False,
                        "error": f"unreachable: 127.0.0.1:{sink_port} (connection refused)"}
    finally:
        pipeline.stop()
