"""Streams stage on the real stack: Faust worker subprocesses, Kafka 4.x, the schema registry.

Each test has its own topics (conftest ``test_settings``), its own app id (consumer group,
changelog) and data directories, and kills its workers on teardown.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import pytest
from confluent_kafka import Consumer
from confluent_kafka.admin import AdminClient

from kvbus.children import free_port
from kvbus.runtime.settings import Settings
from kvbus.schemas.events import (
    AllBlocksCleared,
    BlockEvent,
    BlockStored,
    EventBatch,
    Incomplete,
    Reset,
    canonical_hash,
    holder_key,
)
from kvbus.schemas.serde import RecordSerde, registry_client
from kvbus.simulator.tp_trace import TraceSpec, batches, expected
from tests.pipeline import RawProducer

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[1]


# -- helpers ------------------------------------------------------------------



def worker_env(settings: Settings, app_id: str, datadir: Path, window: float, **extra: str) -> dict[str, str]:
    t = settings.topics
    env = dict(os.environ)
    env.update(
        KVBUS_BOOTSTRAP=settings.bootstrap, KVBUS_REGISTRY_URL=settings.registry_url,
        KVBUS_PARTITIONS=str(settings.partitions), KVBUS_TOPIC_RAW=t.raw, KVBUS_TOPIC_BLOCKS=t.blocks,
        KVBUS_TOPIC_INCOMPLETE=t.incomplete, KVBUS_TOPIC_DLQ=t.dlq, KVBUS_STREAMS_APP_ID=app_id,
        KVBUS_STREAMS_DATADIR=str(datadir), KVBUS_STREAMS_WINDOW=str(window), KVBUS_STREAMS_SWEEP="0.25",
        KVBUS_STREAMS_SESSION_TIMEOUT="8", PYTHONUNBUFFERED="1",
    )
    env.update(extra)
    return env


@dataclass
class Workers:
    """Worker subprocesses of one test; all killed at teardown."""

    tmp: Path
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    def start(self, name: str, env: dict[str, str], argv: Optional[list[str]] = None) -> subprocess.Popen:
        log = open(self.tmp / f"{name}.log", "w")
        argv = argv or [sys.executable, "-m", "kvbus.streams", "worker", "-l", "info"]
        p = subprocess.Popen(argv, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        self.procs[name] = p
        return p

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text(errors="replace")

    def stop_all(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)


@pytest.fixture
def workers(tmp_path: Path):
    w = Workers(tmp_path)
    yield w
    w.stop_all()


class Collector:
    """Consumes every block topic (regex, so tier topics created later are seen), incomplete and dlq.
    Each event of a BlockEvents record (block layout 2) is recorded as a BlockEvent of its own under its
    track's name (the layout 1 topic: ``Topics.track``)."""

    def __init__(self, settings: Settings):
        self.settings = settings
        t = settings.topics
        reg = registry_client(settings.registry_url)
        self.serdes = {k: RecordSerde(reg, k) for k in ("BlockEvent", "BlockEvents", "Incomplete", "DeadLetter")}
        self.records: list[tuple[str, int, int, bytes, Any, float]] = []
        self._seen: set[tuple[str, int, int]] = set()  # a rebalance of the collector re-reads
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._consumer = Consumer({
            "bootstrap.servers": settings.bootstrap, "group.id": f"collector-{uuid.uuid4().hex[:8]}",
            "auto.offset.reset": "earliest", "topic.metadata.refresh.interval.ms": 500,
            "enable.auto.commit": False,
        })
        self._consumer.subscribe([t.blocks_pattern(), t.incomplete, t.dlq])
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _kind(self, topic: str) -> str:
        t = self.settings.topics
        return ("Incomplete" if topic == t.incomplete else "DeadLetter" if topic == t.dlq
                else "BlockEvents" if t.is_packed(topic) else "BlockEvent")

    def _run(self) -> None:
        while not self._stop.is_set():
            for m in self._consumer.consume(500, 0.2):
                if m.error() or (m.topic(), m.partition(), m.offset()) in self._seen:
                    continue
                self._seen.add((m.topic(), m.partition(), m.offset()))
                kind = self._kind(m.topic())
                v = self.serdes[kind].loads(m.value(), m.topic())
                values = v.unpacked() if kind == "BlockEvents" else [v]
                topic = self.settings.topics.track(m.topic())
                with self._lock:
                    self.records += [(topic, m.partition(), m.offset(), m.key(), v, time.time()) for v in values]
        self._consumer.close()

    def of(self, topic: str) -> list[tuple[str, int, int, bytes, Any, float]]:
        with self._lock:
            return [r for r in self.records if r[0] == topic]

    def all(self) -> list[tuple[str, int, int, bytes, Any, float]]:
        with self._lock:
            return list(self.records)

    def wait(self, cond: Callable[["Collector"], bool], timeout: float, what: str) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if cond(self):
                return
            time.sleep(0.2)
        raise AssertionError(f"timed out after {timeout}s waiting for {what}; have {len(self.all())} records")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)


@pytest.fixture
def collector(test_settings: Settings):
    c = Collector(test_settings)
    yield c
    c.close()


def eb(replica: str, rank: int, workers: int, seq: int, events: list, epoch: Optional[int] = None) -> EventBatch:
    return EventBatch(replica=replica, seq=seq, ts=1.7e9 + seq, events=events, worker_rank=rank, workers=workers,
                      epoch=epoch if epoch is not None else 5000 + rank)


def st(n: int, **kw) -> BlockStored:
    kw.setdefault("medium", "GPU")
    return BlockStored(block_hashes=[canonical_hash(n)], parent_block_hash=None, token_ids=[n, n + 1],
                       block_size=2, **kw)


# -- tests --------------------------------------------------------------------

def test_worker_consolidates_routes_expires_and_dead_letters(test_settings: Settings, workers: Workers,
                                                             collector: Collector, tmp_path: Path):
    """One worker started as ``kvbus worker`` (kvbus.streams.cli)."""
    s = test_settings
    t = s.topics
    app_id = f"it-{uuid.uuid4().hex[:8]}"
    metrics_port = free_port()
    window = 2.0
    env = worker_env(s, app_id, tmp_path / "w1", window)
    workers.start("w1", env, [sys.executable, "-m", "kvbus", "worker", "--app-id", app_id, "--window", str(window),
                              "--metrics-port", str(metrics_port), "--datadir", str(tmp_path / "w1")])
    raw = RawProducer(s)
    A, B, C = "A-" + app_id, "B-" + app_id, "C-" + app_id
    tier = st(3, ownership="kvcr", medium="CPU")
    # A: 2 workers; step 0 complete (framework + tier), step 1 rank 1 misses one event
    raw.send(eb(A, 1, 2, 0, [st(1), tier]))
    raw.send(eb(A, 0, 2, 0, [st(1, lora_name="x"), tier]))
    raw.send(eb(A, 0, 2, 1, [st(4), st(5)]))
    raw.send(eb(A, 1, 2, 1, [st(5)]))
    sent_partial = time.time()
    # B: single worker passes through
    raw.send(eb(B, 0, 1, 7, [st(10), st(11, ownership="kvcr", medium="CPU")], epoch=42))
    # C: 3 workers, reports in reverse rank order
    for r in (2, 1, 0):
        raw.send(eb(C, r, 3, 0, [st(20)]))
    # bad input
    raw.send_raw(f"{A}#0".encode(), b"not avro")
    raw.send(eb(A, 5, 2, 9, [st(1)]))  # worker_rank >= workers
    raw.flush()

    collector.wait(lambda c: len(c.of(t.incomplete)) >= 1 and len(c.of(t.dlq)) >= 2 and len(c.of(t.blocks)) >= 4,
                   60, "consolidated, incomplete and dead letters")
    blocks_a = [(r[4].position, r[4].event) for r in collector.of(t.blocks) if r[4].replica == A]
    assert blocks_a == [((5000, 0, 0), st(1, lora_name="x")), ((5000, 1, 1), st(5))]
    kv = [(r[4].replica, r[4].position) for r in collector.of(t.blocks + ".kvcr")]
    assert sorted(kv) == sorted([(A, (5000, 0, 1)), (B, (42, 7, 1))])
    assert [(r[4].position, r[4].event) for r in collector.of(t.blocks) if r[4].replica == B] == [((42, 7, 0), st(10))]
    assert [r[4].position for r in collector.of(t.blocks) if r[4].replica == C] == [(5000, 0, 0)]
    # the incomplete one, after (not before) the window
    (inc,) = collector.of(t.incomplete)
    value: Incomplete = inc[4]
    assert (value.replica, value.reported, value.missing, value.event, value.workers) == (A, [0], [1], st(4), 2)
    assert (value.epoch, value.seq, value.index) == (5000, 1, 0)
    assert window - 0.3 <= inc[5] - sent_partial <= window + 15
    # dead letters name their source and reason
    dlq = sorted((r[4].reason.split(":")[0], r[4].source, r[4].stage) for r in collector.of(t.dlq))
    assert [d[0] for d in dlq] == ["decode", "invariant"]
    assert all(d[2] == "streams" and d[1].startswith(f"{t.raw}[") and "]@" in d[1] for d in dlq)
    assert any("worker_rank" in r[4].reason for r in collector.of(t.dlq))
    assert collector.of(t.dlq)[0][4].payload != []
    # tier topic (of the block layout the worker writes) created with the stage's partition count
    tier = t.for_ownership("kvcr", packed=True)
    md = AdminClient({"bootstrap.servers": s.bootstrap}).list_topics(tier, timeout=10)
    assert len(md.topics[tier].partitions) == s.partitions

    # Reset: both bridges of A restart; one marker to blocks and the tier topic A used
    raw.send(eb(A, 1, 2, -1, [Reset(reason="engine-restart")], epoch=9001))
    raw.send(eb(A, 0, 2, -1, [Reset(reason="engine-restart")], epoch=9000))
    raw.send(eb(A, 0, 2, 0, [st(30), AllBlocksCleared()], epoch=9000))
    raw.send(eb(A, 1, 2, 0, [st(30), AllBlocksCleared()], epoch=9001))
    raw.flush()
    collector.wait(lambda c: sum(1 for r in c.of(t.blocks) if r[4].replica == A) >= 5, 60, "reset and new run")
    after = [(r[4].position, type(r[4].event).__name__) for r in collector.of(t.blocks) if r[4].replica == A][2:]
    assert after == [((5000, 1, 2**31 - 1), "Reset"), ((9000, 0, 0), "BlockStored"), ((9000, 0, 1), "AllBlocksCleared")]
    collector.wait(lambda c: any(r[4].replica == A and isinstance(r[4].event, Reset) for r in c.of(t.blocks + ".kvcr")),
                   30, "reset on the tier topic")
    assert [type(r[4].event).__name__ for r in collector.of(t.blocks + ".kvcr") if r[4].replica == A] == [
        "BlockStored", "Reset"]
    # one key per holder, and per holder one partition
    for topic in (t.blocks, t.blocks + ".kvcr"):
        parts = defaultdict(set)
        for r in collector.of(topic):
            assert r[3] == holder_key(r[4].replica, r[4].dp_rank).encode()
            parts[r[3]].add(r[1])
        assert all(len(p) == 1 for p in parts.values())

    metrics = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    for line in ("kvbus_streams_consolidated_total 6.0", 'kvbus_streams_incomplete_total{reason="window"} 1.0',
                 'kvbus_streams_dead_letters_total{reason="decode"} 1.0', "kvbus_streams_pending_aggregates 0.0",
                 'kvbus_streams_resets_total{kind="coalesced"} 1.0'):
        assert line in metrics, line
    assert "kvbus_streams_partition_lag{partition=" in metrics
    assert workers.procs["w1"].poll() is None, workers.log("w1")
    # the worker created its table's changelog before Faust started (Faust's own creation logs no such line)
    assert re.search(rf"created topic {app_id}-state-changelog \(partitions {s.partitions}, replication \d+, "
                     r"cleanup.policy compact\)", workers.log("w1")), workers.log("w1")[-3000:]


@pytest.mark.parametrize("store", ["memory://", "rocksdb://"])
def test_sigkill_one_of_two_workers_loses_nothing(test_settings: Settings, workers: Workers,
                                                   collector: Collector, tmp_path: Path, store: str):
    """Two workers share the partitions; one is SIGKILLed mid-stream, while it holds partial
    aggregates (worker 1 of every replica lags worker 0 by 20 steps) and uncommitted work.
    Its partitions and table state move to the survivor; every consolidated event arrives, and
    every record, re-emitted ones included, carries its original position."""
    s = test_settings
    t = s.topics
    app_id = f"kill-{uuid.uuid4().hex[:8]}"
    window = 60.0  # longer than the handover, so partial aggregates must survive it
    for name in ("w1", "w2"):
        workers.start(name, worker_env(s, app_id, tmp_path / name, window, KVBUS_STREAMS_STORE=store))
    spec = TraceSpec(replicas=8, workers=2, steps=300, events_per_batch=4, prefix=app_id, seed=7)
    want = expected(spec)
    per_rank: dict[int, list[EventBatch]] = defaultdict(list)
    for b in batches(spec):
        per_rank[b.worker_rank].append(b)
    lag = 20 * spec.replicas  # rank 1 is 20 steps behind rank 0
    trace = []
    for i in range(len(per_rank[0]) + lag):
        if i < len(per_rank[0]):
            trace.append(per_rank[0][i])
        if i >= lag:
            trace.append(per_rank[1][i - lag])

    # wait until both workers hold partitions
    owned: dict[str, list[int]] = {}
    deadline = time.time() + 90
    while time.time() < deadline:
        for n in ("w1", "w2"):
            lines = [ln for ln in workers.log(n).splitlines() if "state rebuilt for raw partitions [" in ln]
            if lines:
                owned[n] = [int(x) for x in lines[-1].split("[")[-1].split("]")[0].split(",") if x.strip()]
        if len(owned) == 2 and all(owned.values()) and sorted(owned["w1"] + owned["w2"]) == list(range(s.partitions)):
            break
        time.sleep(0.5)
    else:
        pytest.fail(f"workers did not share the partitions: {owned}")
    victim_parts = set(owned["w2"])

    # The trace goes out in paced chunks, as engines produce over time (~5 s in all): the victim
    # is killed as soon as it has produced 1000 events, while records keep arriving; so it dies
    # mid-stream (partial aggregates held, work not yet committed) and the survivor must take its
    # partitions over to finish. A slow machine must not let the trace end first (it did, once,
    # with the CI run sharing 2 cores with benchmarks): the second half is held back until the
    # victim has produced its 1000 events and been killed.
    raw = RawProducer(s)
    killed_at = None
    chunk = 50
    half = len(trace) // 2

    def victim_out() -> int:
        return sum(1 for r in collector.of(t.blocks) if r[1] in victim_parts)

    def kill(at: int) -> int:
        workers.procs["w2"].send_signal(signal.SIGKILL)
        workers.procs["w2"].wait(10)
        return at

    for start in range(0, len(trace), chunk):
        if start >= half and killed_at is None:
            deadline = time.time() + 120
            while victim_out() <= 1000:
                assert time.time() < deadline, f"the victim produced only {victim_out()} events of the first half"
                time.sleep(0.1)
            killed_at = kill(start)
        for b in trace[start:start + chunk]:
            raw.send(b)
        raw.flush()
        if killed_at is None and victim_out() > 1000:
            killed_at = kill(start + chunk)
        time.sleep(0.05)
    assert killed_at is not None and killed_at < len(trace), "the victim must die before the trace ends"
    victim_seen = sum(1 for r in collector.of(t.blocks) if r[1] in victim_parts)

    def seen(c: Collector) -> set:
        return {(r[3].decode(), r[4].position) for r in c.all() if isinstance(r[4], BlockEvent)}

    # Wait on progress, not on a fixed deadline: on a loaded machine the handover and replay
    # can be slow, but they must keep producing; fail after 90 s without a new event, or at
    # once if the survivor died (its log says why).
    have: set = set()
    last_progress = time.time()
    while not set(want) <= have:
        if workers.procs["w1"].poll() is not None or time.time() - last_progress > 90:
            missing = sorted(set(want) - have)
            per_holder = defaultdict(list)
            for key, pos in missing:
                per_holder[key].append(pos)
            detail = "; ".join(f"{k}: {len(v)} from {v[0]} to {v[-1]}" for k, v in sorted(per_holder.items()))
            state = ("survivor w1 exited with %s" % workers.procs["w1"].returncode
                     if workers.procs["w1"].poll() is not None else "no progress for 90 s")
            pytest.fail(f"{state}; {len(missing)} of {len(want)} consolidated events missing after the kill "
                        f"(w2 owned {sorted(victim_parts)}, killed after {killed_at} of {len(trace)} raw records): "
                        f"{detail}\n--- survivor log tail ---\n{workers.log('w1')[-6000:]}")
        now_seen = seen(collector)
        if len(now_seen) > len(have):
            last_progress = time.time()
        have = now_seen
        time.sleep(0.5)
    time.sleep(1.0)
    records = [r for r in collector.all() if isinstance(r[4], BlockEvent)]
    # original positions: each record's position names exactly the event the trace put there
    for topic, part, off, key, v, _ in records:
        assert want[(key.decode(), v.position)] == v.event, (topic, part, off, v)
    # per holder and topic, positions only grow apart from re-emitted ones
    by_holder = defaultdict(list)
    for topic, part, off, key, v, _ in sorted(records, key=lambda r: (r[0], r[1], r[2])):
        by_holder[(topic, key)].append(v.position)
    duplicates = 0
    for positions in by_holder.values():
        best = None
        for p in positions:
            if best is not None and p <= best:
                duplicates += 1
                continue
            best = p
    assert len(records) - duplicates == len(want)
    assert collector.of(t.incomplete) == [], "no report was lost, so nothing may be incomplete"
    assert collector.of(t.dlq) == []
    survivor = workers.log("w1")
    rebuilt = [ln for ln in survivor.splitlines() if "state rebuilt for raw partitions [0, 1, 2, 3]" in ln]
    assert rebuilt, survivor[-3000:]
    pending = int(rebuilt[-1].split("holders, ")[1].split(" pending")[0])
    print(f"[{store}] killed w2 (partitions {sorted(victim_parts)}) after {killed_at} of {len(trace)} raw records, "
          f"{victim_seen} of its outputs seen; survivor restored {pending} pending aggregates; "
          f"{len(records)} outputs, {duplicates} re-emitted")
    assert pending > 0, "the victim's partial aggregates must be handed over"
    assert workers.procs["w1"].poll() is None
