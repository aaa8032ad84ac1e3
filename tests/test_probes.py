"""``/healthz`` and ``/readyz`` beside ``/metrics`` on each stage's metrics port, JSON log lines, and
the retry pauses: the shared pieces (kvbus.runtime.probes, .logs, .backoff) on their own, then each
stage as a real process against the real Kafka, registry and Redis, its readiness flipping both ways:

* a sink's while its view is rebuilt after ``FLUSHALL``;
* a bridge's while its engine socket is connected or not;
* a worker's with its raw partition assigned to it or to the other worker of its group.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import urllib.error
import urllib.request
import uuid
from dataclasses import replace
from pathlib import Path

import pytest
import zmq
from prometheus_client import CollectorRegistry, Counter

from kvbus.children import Children, free_port
from kvbus.infra.scratch_redis import RedisServer
from kvbus.runtime.backoff import Backoff
from kvbus.runtime.probes import Readiness, serve
from kvbus.runtime.settings import Settings
from kvbus.schemas.topics import Topics
from tests.histories import random_streams
from tests.memory_store import InMemoryStore
from tests.test_sink_consumer import produce
from tests.waiting import eventually

QUIET = logging.getLogger("tests.probes.librdkafka")
"""Where the test's own librdkafka clients log (not stderr)."""


def get(port: int, path: str) -> tuple[int, str]:
    """(HTTP status, body) of ``GET http://127.0.0.1:<port><path>``; (0, error) if nothing answers."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError as e:
        return 0, str(e)


def readyz(port: int) -> tuple[int, list[str]]:
    """``/readyz``'s status and reasons (``[]`` when ready)."""
    status, body = get(port, "/readyz")
    return status, (json.loads(body).get("reasons", []) if status in (200, 503) else [body])


def wait_until(check, timeout: float, what: str, children: Children | None = None, interval: float = 0.2):
    """``check()`` until truthy; fails after ``timeout`` s saying what it waited for and what it last saw
    (and with the log of any child that exited)."""
    def alive() -> None:
        report = children.stopped_report(tail=3000) if children is not None else None
        assert report is None, report

    return eventually(check, timeout, what=what, interval=interval, alive=alive)


def sample(exposition: str, name: str) -> float:
    """The value of the first sample called ``name`` in a Prometheus exposition; -1 when there is none."""
    from prometheus_client.parser import text_string_to_metric_families

    return next((s.value for fam in text_string_to_metric_families(exposition) for s in fam.samples
                 if s.name == name), -1.0)


def json_lines(path: Path) -> list[dict]:
    """Every line of a log, each parsed as one JSON object (fails on a line that is not one)."""
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        try:
            out.append(json.loads(line))
        except ValueError:
            raise AssertionError(f"{path} line {n} is not a JSON object: {line!r}") from None
    assert out, f"{path} is empty"
    return out


# ------------------------------------------------------------------ the shared pieces


def test_readyz_answers_503_with_the_reasons_and_metrics_keep_working():
    registry = CollectorRegistry()
    Counter("kvbus_probe_test", "a counter", registry=registry).inc(3)
    state = {"why": "the view is rebuilding"}

    def flaky() -> str:
        raise RuntimeError("Redis unreachable")

    readiness = Readiness([lambda: state["why"]], starting="Kafka")
    port = free_port()
    server = serve(port, registry, readiness, addr="127.0.0.1")
    try:
        assert get(port, "/healthz") == (200, "ok\n")
        assert readyz(port) == (503, ["starting: waiting for Kafka"])
        readiness.starting = None
        assert readyz(port) == (503, ["the view is rebuilding"])
        state["why"] = None
        assert get(port, "/readyz") == (200, '{"ready": true}\n')
        readiness.add(flaky)
        assert readyz(port) == (503, ["readiness check failed: RuntimeError: Redis unreachable"])
        status, body = get(port, "/metrics")
        assert status == 200 and "kvbus_probe_test_total 3.0" in body
    finally:
        server.shutdown()


JSON_CHILD = """
import sys, time
from confluent_kafka import Producer
from kvbus.runtime import logs
from kvbus.runtime.settings import Settings

logs.configure("bridge", fmt="json")
logs.bind(holder="r#0")
producer = Producer(Settings(bootstrap=sys.argv[1]).kafka())  # nothing listens there: librdkafka logs
deadline = time.monotonic() + 3  # its first connection is refused within milliseconds
while time.monotonic() < deadline:
    producer.poll(0.2)  # serves librdkafka's log lines
raise RuntimeError("boom")
"""


def test_json_mode_turns_librdkafka_lines_and_uncaught_errors_into_json_lines(tmp_path: Path):
    """Every line a process writes in JSON mode is one object: librdkafka's own (through the
    ``logger`` Settings.kafka() sets) and an uncaught exception's traceback (as ``exc_info``)."""
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    out = subprocess.run([sys.executable, "-c", JSON_CHILD, dead], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and out.stdout == ""
    (tmp_path / "err.log").write_text(out.stderr)
    lines = json_lines(tmp_path / "err.log")
    assert all(line["stage"] == "bridge" and line["holder"] == "r#0" for line in lines)
    assert any(line["logger"] == "kvbus.kafka" and "Connection refused" in line["message"] for line in lines), lines
    assert lines[-1]["message"] == "uncaught RuntimeError: boom" and "Traceback" in lines[-1]["exc_info"]


def test_retry_pauses_double_up_to_the_cap_with_jitter():
    low, high = Backoff(first=1.0, cap=8.0, rng=lambda: 0.0), Backoff(first=1.0, cap=8.0, rng=lambda: 0.999999)
    assert [round(low.next(), 3) for _ in range(6)] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    assert [round(high.next(), 3) for _ in range(6)] == [1.0, 2.0, 4.0, 8.0, 8.0, 8.0]
    low.reset()
    assert low.next() == 0.5
    pauses = {round(Backoff(first=2.0).next(), 6) for _ in range(50)}  # processes started together
    assert len(pauses) > 40 and all(1.0 <= p <= 2.0 for p in pauses)


@pytest.mark.integration
def test_a_producer_that_cannot_reach_kafka_is_failing_and_one_acknowledged_is_not(stack: Settings):
    """RecordProducer.failure (the bridge's "producer not failing") with real librdkafka clients:
    one whose bootstrap is a closed port, and one of the real stack."""
    from kvbus.producers.metrics import BridgeMetrics
    from kvbus.producers.record_producer import RecordProducer, producer_conf

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"

    def producer(bootstrap: str) -> RecordProducer:
        return RecordProducer(f"probes-{uuid.uuid4().hex[:8]}", "probes-dlq", lambda dl: b"", BridgeMetrics(),
                              stage="bridge", conf=producer_conf({"bootstrap.servers": bootstrap, "logger": QUIET}),
                              max_record_bytes=100_000)

    down = producer(dead)
    down.produce(down.raw_topic, b"k", b"v", 1)

    def reported() -> str | None:
        down.service()
        return down.failure()
    try:
        reason = wait_until(reported, 30, "the producer to report Kafka unreachable")
        assert reason.startswith("Kafka: "), reason
    finally:
        down.producer.purge()  # nothing will take its record
    up = producer(stack.bootstrap)
    up.produce(up.raw_topic, b"k", b"v", 1)
    assert up.flush(30) == 0 and up.acked == 1
    assert up.failure() is None


# ------------------------------------------------------------------ the stages


@pytest.fixture
def children(tmp_path: Path):
    kids = Children(log_dir=tmp_path, log_prefix="")
    yield kids
    kids.stop_all()


@pytest.mark.integration
def test_sink_is_not_ready_while_its_view_is_rebuilt_after_flushall(stack: Settings, sink_topics: Topics,
                                                                    children: Children, tmp_path: Path):
    """FLUSHALL, with the rebuild lock taken in the same transaction as a second sink rebuilding
    would hold it: the sink's /readyz answers 503 (the view is missing, and it waits for the
    lock); once the lock is gone the sink rebuilds the view, replays the block topics and answers
    200 again, with the view as before. Its log is JSON lines."""
    records = random_streams(31, sink_topics, holders=4, batches=300, pool=30)
    produce(stack, records)
    model = InMemoryStore()
    model.apply(records)
    prefix, port = f"p{uuid.uuid4().hex[:8]}:", free_port()
    with RedisServer() as redis_server:
        from kvbus.sinks.view.redis_store import RedisStore

        view = RedisStore(redis_server.client(), prefix)
        env = {**os.environ, **replace(stack, topics=sink_topics, redis_url=redis_server.url).to_env(),
               "KVBUS_LOG_FORMAT": "json"}
        children.env = env
        children.start("sink", "sink", "--group", f"g-{uuid.uuid4().hex}", "--prefix", prefix, "--metrics-port",
                       str(port), "--snapshot-every", "0", "--stale-after", "0")
        wait_until(lambda: readyz(port) == (200, []) and view.positions() == model.positions(), 90,
                   "the sink to be ready with the whole view", children)
        pipe = redis_server.client().pipeline(transaction=True)
        pipe.flushall()
        pipe.set(prefix + "lock", "a-test-holding-the-rebuild", px=120_000)
        pipe.execute()
        status, reasons = readyz(port)
        assert status == 503 and reasons == [f"the view is missing (P status under {prefix!r})"]
        wait_until(lambda: b"resync" in (tmp_path / "sink.log").read_bytes(), 30,
                   "the sink to notice the view is gone", children)
        assert readyz(port)[0] == 503  # it waits for the lock: nobody has rebuilt the view
        seen: list[tuple[int, tuple[str, ...]]] = []

        def ready_again() -> bool:
            status, reasons = readyz(port)
            if not seen or seen[-1] != (status, tuple(reasons)):
                seen.append((status, tuple(reasons)))
            return status == 200
        redis_server.client().delete(prefix + "lock")
        wait_until(ready_again, 90, "the sink to rebuild the view and be ready again", children, interval=0.05)
        assert view.positions() == model.positions() and view.snapshot() == model.snapshot()
        assert all(status == 503 for status, _ in seen[:-1]), seen
        metrics = get(port, "/metrics")[1]
        assert "kvbus_sink_view_rebuilds_total 2.0" in metrics  # the view made at start, and this one
        print("readiness while rebuilt:", seen)
    children.stop_all()
    lines = json_lines(tmp_path / "sink.log")
    assert {line["stage"] for line in lines} == {"sink"}
    assigned = [line for line in lines if line["message"].startswith("assigned ")]
    assert assigned and set(assigned[0]["partitions"]) == {f"{t}[{p}]" for t in
                                                           (sink_topics.blocks, sink_topics.for_ownership("kvcr"))
                                                           for p in (0, 1)}


@pytest.mark.integration
def test_sink_is_not_ready_while_it_lags_more_than_its_bound(stack: Settings, sink_topics: Topics, monkeypatch):
    """The lag part of the sink's readiness, stepped by hand (its lag measured at every step, not
    once a second): a ready sink gets a backlog of more than ``ready_lag`` records and is not ready
    until it has read it."""
    import kvbus.sinks.consumer
    from kvbus.sinks.config import SinkConfig
    from kvbus.sinks.consumer import SinkConsumer
    from kvbus.sinks.view.redis_store import RedisStore

    monkeypatch.setattr(kvbus.sinks.consumer, "LAG_EVERY", 0.0)

    records = random_streams(32, sink_topics, holders=3, batches=400, pool=30)
    half = len(records) // 2
    with RedisServer() as redis_server:
        view = RedisStore(redis_server.client(), "kvbus:")
        sink = SinkConsumer(stack, view, SinkConfig(group=f"g-{uuid.uuid4().hex}", batch=5, stale_after=0,
                                                    poll_timeout=0.2, ready_lag=10), topics=sink_topics)

        def caught_up(upto: int):
            model = InMemoryStore()
            model.apply(records[:upto])

            def check() -> bool:
                sink.step()
                return view.positions() == model.positions() and sink.lag == 0 and sink.not_ready(view) is None
            return check
        try:
            produce(stack, records[:half])
            wait_until(caught_up(half), 90, "the sink to be ready with the first half", interval=0)
            produce(stack, records[half:])  # a backlog: the sink reads 5 records a step

            def behind() -> str | None:
                sink.step()
                return sink.not_ready(view)
            reason = wait_until(behind, 60, "the sink to measure its backlog", interval=0)
            assert reason.endswith("records behind on its partitions (ready within 10)"), reason
            wait_until(caught_up(len(records)), 90, "the sink to read the backlog and be ready", interval=0)
        finally:
            sink.close()


@pytest.mark.integration
def test_bridge_is_ready_only_while_its_engine_socket_is_connected(test_settings: Settings, children: Children,
                                                                    tmp_path: Path):
    """A real bridge (Kafka, registry) whose engine is not there yet: 503 naming the endpoint; the
    engine binds its PUB socket: 200; the engine goes away: 503 again. Its log is JSON lines, each
    with the bridge's holder."""
    engine_port, port = free_port(), free_port()
    endpoint = f"tcp://127.0.0.1:{engine_port}"
    children.env = {**os.environ, **test_settings.to_env(), "KVBUS_LOG_FORMAT": "json",
                    "KVBUS_MALLOC_TRIM_INTERVAL": "0.2"}
    children.start("bridge", "bridge", "--endpoint", endpoint, "--replica", "probe-r", "--dp-rank", "2",
                   "--metrics-port", str(port), "--flush-timeout", "5")
    not_connected = (503, [f"the engine socket is not connected to {endpoint}"])
    wait_until(lambda: readyz(port) == not_connected, 90, "the bridge to run, without its engine", children)
    # a long-running stage serves its process's metrics and trims its allocator every interval
    wait_until(lambda: sample(get(port, "/metrics")[1], "kvbus_malloc_trims_total") >= 2, 30,
               "the bridge's /metrics to count two trims of its allocator", children)
    assert sample(get(port, "/metrics")[1], "process_resident_memory_bytes") > 10 * 2**20
    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.PUB)
    pub.bind(endpoint)
    try:
        wait_until(lambda: readyz(port) == (200, []), 30, "the bridge to be ready once the engine is up", children)
    finally:
        pub.close(linger=0)
    wait_until(lambda: readyz(port) == not_connected, 30, "the bridge to be not ready once the engine is gone",
               children)
    children.stop_all()
    lines = json_lines(tmp_path / "bridge.log")
    assert {(line["stage"], line["holder"]) for line in lines} == {("bridge", "probe-r#2")}
    messages = [line["message"] for line in lines]
    assert f"engine {endpoint} connected" in messages
    assert f"engine {endpoint} disconnected: waiting for it to come back" in messages


@pytest.mark.integration
def test_worker_is_ready_only_with_its_raw_partition_assigned(stack: Settings, children: Children, tmp_path: Path):
    """Two real workers of one group over a raw topic of one partition: the one that has it is
    ready, the other answers 503 saying it has none; stop the first and the second takes the
    partition and is ready. Their logs are JSON lines (Faust's and librdkafka's lines too)."""
    from kvbus.infra.dev_topics import ensure_topics
    from tests.conftest import _delete_topics

    suffix = uuid.uuid4().hex[:8]
    topics = Topics(raw=f"w{suffix}.raw", blocks=f"w{suffix}.blocks", incomplete=f"w{suffix}.incomplete",
                    dlq=f"w{suffix}.dlq", snapshots=f"w{suffix}.snapshots")
    ensure_topics(stack.bootstrap, [topics.raw, topics.blocks, topics.incomplete, topics.dlq], 1, 1)
    app_id = f"probes-{suffix}"
    try:
        children.env = {**os.environ, **replace(stack, topics=topics, partitions=1).to_env(),
                        "KVBUS_LOG_FORMAT": "json", "KVBUS_STREAMS_SESSION_TIMEOUT": "6"}
        ports = {"a": free_port(), "b": free_port()}
        kids = {}
        for name in ("a", "b"):
            kids[name] = children.start(f"worker-{name}", "worker", "--app-id", app_id, "--metrics-port",
                                        str(ports[name]), "--datadir", str(tmp_path / name))
        idle = (503, [f"no partition of {topics.raw} is assigned to this worker"])

        def one_of_each() -> dict[str, tuple] | None:
            seen = {name: readyz(port) for name, port in ports.items()}
            return seen if sorted(seen.values()) == sorted([(200, []), idle]) else None
        seen = wait_until(one_of_each, 120, "one worker ready, the other without a partition", children)
        owner = next(name for name, answer in seen.items() if answer == (200, []))
        other = "b" if owner == "a" else "a"
        children.stop(kids[owner])
        children.started.remove(kids[owner])  # stopped on purpose: no longer watched
        wait_until(lambda: readyz(ports[other]) == (200, []), 120,
                   f"worker {other} to take the partition and be ready", children)
    finally:
        children.stop_all()
        _delete_topics(stack, f"w{suffix}.")
    for name in ("a", "b"):
        lines = json_lines(tmp_path / f"worker-{name}.log")
        assert {line["stage"] for line in lines} == {"worker"}
    rebuilt = [line for line in json_lines(tmp_path / f"worker-{other}.log")
               if line["message"].startswith("state rebuilt for raw partitions [0]")]
    assert rebuilt and rebuilt[-1]["partitions"] == [0]
