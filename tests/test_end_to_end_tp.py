"""Tensor parallelism end to end on the real stack: every worker of a replica publishes its own
ZMQ stream through its own bridge, some reports are missing or duplicated, and the consolidated
stream equals what vLLM's all-workers rule gives for the same reports, in the same per-replica
order; what not every worker reported appears on the incomplete topic (after the window)."""
from __future__ import annotations

import random
import time
import uuid
from collections import defaultdict

import pytest
from confluent_kafka import Consumer

from kvbus.runtime.settings import Settings
from kvbus.schemas.events import Event, without_tokens
from kvbus.schemas.serde import RecordSerde, registry_client
from kvbus.simulator.engine_wire import project
from kvbus.simulator.fleet import Fleet, FleetConfig, ModelConfig
from tests.pipeline import Pipeline

pytestmark = pytest.mark.integration

FMT = "vllm-0.33"
WORKERS = 2
STEPS = 40
WINDOW = 2.0


def worker_views(rng: random.Random, events: list[Event]) -> list[list[Event]]:
    """Each worker's report of one engine step: some events dropped, some duplicated."""
    views = []
    for _ in range(WORKERS):
        view = []
        for e in events:
            r = rng.random()
            if r < 0.08:
                continue
            view.append(e)
            if r > 0.95:
                view.append(e)
        views.append(view)
    return views


def read_topics(settings: Settings, pattern: str, record: str, count: int, timeout: float) -> list:
    """Every record on the topics matching ``pattern`` (in partition order), once ``count`` arrived.
    Records are keyed by (topic, partition, offset): a regex subscription rebalances when a new
    matching topic appears and, with nothing committed, reads the old ones again. ``record``
    "BlockEvent" reads the block topics of both layouts, each event of a BlockEvents record as a
    BlockEvent of its own (``count`` counts events)."""
    c = Consumer({"bootstrap.servers": settings.bootstrap, "group.id": f"t-{uuid.uuid4().hex}",
                  "auto.offset.reset": "earliest", "enable.auto.commit": False,
                  "topic.metadata.refresh.interval.ms": 1000})
    registry = registry_client(settings.registry_url)
    serde = RecordSerde(registry, record, auto_register=False)
    packed = RecordSerde(registry, "BlockEvents", auto_register=False)
    c.subscribe([pattern])
    out: dict[tuple[str, int, int, int], object] = {}

    def take(m) -> None:
        if record == "BlockEvent" and settings.topics.is_packed(m.topic()):
            for i, ev in enumerate(packed.loads(m.value(), m.topic()).unpacked()):
                out[(m.topic(), m.partition(), m.offset(), i)] = ev
        else:
            out[(m.topic(), m.partition(), m.offset(), 0)] = serde.loads(m.value(), m.topic())

    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline and len(out) < count:
            for m in c.consume(500, timeout=0.5):
                assert m.error() is None, m.error()
                take(m)
        time.sleep(1.0)  # anything beyond the expected count would be a defect: read it too
        for m in c.consume(500, timeout=1.0):
            if m.error() is None:
                take(m)
    finally:
        c.close()
    return [out[k] for k in sorted(out)]


def test_consolidated_stream_follows_the_all_workers_rule(test_settings, tmp_path) -> None:
    run = uuid.uuid4().hex[:8]
    pipeline = Pipeline(test_settings, tmp_path)
    fleet = Fleet(FleetConfig(replicas=2, workers=WORKERS, base_port=0, format=FMT, seed=11,
                              model=ModelConfig(clear_rate=0.02, kvcr_rate=0.2))).start()
    rng = random.Random(5)
    expected: dict[tuple[str, str | None], list[Event]] = defaultdict(list)
    incomplete: dict[str, list[Event]] = defaultdict(list)
    try:
        pipeline.start("worker", "worker", "--app-id", f"tp-{run}", "--workdir", str(tmp_path),
                       "--window", str(WINDOW))
        for s in fleet.streams():
            pipeline.start(f"bridge-{s.replica}-{s.worker_rank}", "bridge", "--endpoint", s.endpoint,
                           "--replay-endpoint", s.replay_endpoint, "--replica", s.replica,
                           "--worker-rank", str(s.worker_rank), "--workers", str(WORKERS))
        seen: set[tuple[str, str]] = set()
        for step in range(STEPS):
            for (name, dp), model in fleet.models.items():
                # vLLM aggregates within one engine step; kvbus across processes, pairing the k-th
                # report of each worker within the window (docs/streams.md). The two agree unless an
                # identical event recurs within one window, so the trace keeps each event once.
                events = [e for e in model.step() if (name, repr(e)) not in seen]
                seen.update((name, repr(e)) for e in events)
                if not events:
                    continue
                views = worker_views(rng, events)
                for w, view in enumerate(views):
                    fleet.publisher(name, dp, w).publish(view, ts=1_750_000_000.0 + step)
                for e in events:
                    # vLLM's rule: real once every worker reported it. A worker reporting it twice
                    # does not make it count twice; when every worker reports it k times (a tier that
                    # repeats a hash per chunk) it is real k times (docs/streams.md).
                    counts = [sum(1 for x in v if x == e) for v in views]
                    p = without_tokens(project(FMT, e))  # the bridges keep no prompt tokens
                    expected[(name, getattr(p, "ownership", None))].extend([p] * min(counts))
                    incomplete[name].extend([p] * (max(counts) - min(counts)))
            time.sleep(0.05)

        blocks = test_settings.topics.blocks_pattern()
        n_expected = sum(len(v) for v in expected.values())
        got = read_topics(test_settings, blocks, "BlockEvent", n_expected, 120)
        by_stream: dict[tuple[str, str | None], list[Event]] = defaultdict(list)
        for be in got:
            if type(be.event).__name__ != "Reset":
                by_stream[(be.replica, getattr(be.event, "ownership", None))].append(be.event)
        for key in sorted(set(by_stream) | set(expected), key=str):
            _assert_same_events(key, by_stream.get(key, []), expected.get(key, []))
        for be_list in _positions_by_holder(got).values():
            assert be_list == sorted(be_list), "positions must only grow per (replica, dp_rank)"

        n_incomplete = sum(len(v) for v in incomplete.values())
        inc = read_topics(test_settings, test_settings.topics.incomplete, "Incomplete", n_incomplete, 60)
        got_inc: dict[str, list[Event]] = defaultdict(list)
        for i in inc:
            got_inc[i.replica].append(i.event)
            assert sorted(i.reported + i.missing) == list(range(WORKERS)) and i.missing
        assert {k: sorted(map(repr, v)) for k, v in got_inc.items()} == \
               {k: sorted(map(repr, v)) for k, v in incomplete.items()}
        assert n_incomplete > 0 and n_expected > 100
    finally:
        pipeline.stop()
        fleet.stop()


def _positions_by_holder(records: list) -> dict[str, list[tuple[int, int, int]]]:
    out: dict[str, list[tuple[int, int, int]]] = defaultdict(list)
    for be in records:
        if getattr(be.event, "ownership", None) is None:
            out[f"{be.replica}#{be.dp_rank}"].append(be.position)
    return out


def _assert_same_events(key, got: list[Event], want: list[Event]) -> None:
    """Equal sequences, or a message naming the first difference."""
    if got == want:
        return
    first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    raise AssertionError(
        f"{key}: {len(got)} consolidated vs {len(want)} expected; first difference at {first}:\n"
        f" got  {[type(e).__name__ for e in got[max(0, first - 2):first + 3]]} {got[first:first + 1]!r}\n"
        f" want {[type(e).__name__ for e in want[max(0, first - 2):first + 3]]} {want[first:first + 1]!r}")
