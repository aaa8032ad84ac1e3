"""``kvbus report`` on the real stack.

A fleet of three replicas sharing their system prompts publishes a known history through bridges and
the Faust worker (its default block layout 2: a BlockEvents record per engine batch, holder and tier on
the ``-packed`` topics) into a test's own topics; one replica's engine clock is right, one's is a year
behind, one's a year ahead. ``kvbus report`` (a process, as a user runs it) must then give the
figures an independent replay of the published events gives on the Kafka record times the worker
stamped: every block life, lifetimes, live blocks at the end (equal to the fleet's manifest on the
framework's tiers), per-minute stores and removes, sharing, what the CPU and kvcr tiers kept of what
GPU dropped, and the shared system prompts; the engines' ``ts`` as sent, the events of the two
clocks a year off counted, and files as small as a run of a few seconds makes; plus the incomplete
and dead-letter summaries and the time range. Records of both block layouts on one holder's tracks
count as the events they hold.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from confluent_kafka import Producer

from kvbus.analytics.cli import build_report, topics_to_read
from kvbus.analytics.reader import read
from kvbus.analytics.tables import event_values
from kvbus.analytics.timerange import TimeRange
from kvbus.runtime.settings import Settings
from kvbus.schemas.events import (
    AllBlocksCleared,
    BlockEvent,
    BlockEvents,
    BlockRemoved,
    BlockStored,
    DeadLetter,
    Incomplete,
    PositionedEvent,
    Reset,
    normalize_medium,
)
from kvbus.schemas.serde import RecordSerde, registry_client
from kvbus.simulator.fleet import Fleet, FleetConfig, ModelConfig
from tests.pipeline import Pipeline, env_for, eventually

pytestmark = pytest.mark.integration

STEPS = 200
T0 = float(int(time.time()) // 60 * 60 - 3600)  # a whole minute, an hour ago
YEAR = 365 * 86400.0
ENGINE_CLOCK = {"replica-0": 0.0, "replica-1": -YEAR, "replica-2": YEAR}
"""Seconds each replica's engine clock is off: replica-1 stamps its batches a year early, replica-2 a year late."""


def tier_of(e: BlockStored | BlockRemoved) -> str:
    label = normalize_medium(e.medium) or "GPU"
    return label + (f"@{e.ownership}" if e.ownership else "")


def u64(h: bytes) -> int:
    return int.from_bytes(h, "big")


def life_order(life: tuple) -> tuple:
    """Sort key of a life (holder, tier, block, start, end, ended): lives of a block can start in one
    millisecond of record time (a store, a clear and a store again), so the end breaks ties."""
    h, t, b, start, end, ended = life
    return h, t, b, start, end is None, end or 0.0, ended or ""


class Oracle:
    """The report's figures replayed from the published events with plain Python, as the residency
    view applies them: a clear ends the holder's lives on the framework's tiers (ownership null)."""

    def __init__(self) -> None:
        self.live: dict[tuple[str, str], dict[int, float]] = defaultdict(dict)
        self.lives: list[tuple[str, str, int, float, float | None, str | None]] = []
        self.opens: list[tuple[str, str, int, float]] = []
        self.stores: dict[tuple[str, str, int], int] = defaultdict(int)
        self.removes: dict[tuple[str, str, int], int] = defaultdict(int)
        self.roots: dict[tuple[str, int], dict[str, set[tuple[int, int]]]] = defaultdict(lambda: defaultdict(set))
        self.clears: set[str] = set()
        self.reannounced: dict[str, int] = defaultdict(int)
        self.batches: dict[str, list[int]] = defaultdict(list)
        self.engine_ts: dict[str, set[float]] = defaultdict(set)

    def apply(self, holder: str, times: list[float], events: list) -> None:
        """One published batch of ``holder``: its ``events`` and the Kafka record time of each."""
        self.batches[holder].append(len(events))
        for ts, e in zip(times, events, strict=True):
            minute = int(ts // 60)
            if isinstance(e, AllBlocksCleared):
                self.clears.add(holder)
                for (h, tier), blocks in self.live.items():
                    if h == holder and "@" not in tier:
                        self.lives += [(h, tier, b, start, ts, "clear") for b, start in blocks.items()]
                        blocks.clear()
                continue
            tier = tier_of(e)
            held = self.live[(holder, tier)]
            hashes = [u64(h) for h in e.block_hashes]
            if isinstance(e, BlockStored):
                self.stores[(holder, tier, minute)] += len(hashes)
                if e.parent_block_hash is None:
                    self.roots[(tier, hashes[0])][holder].update(enumerate(hashes))
                for b in hashes:
                    if b not in held:
                        held[b] = ts
                        self.opens.append((holder, tier, b, ts))
                    else:
                        self.reannounced[tier] += 1
            else:
                self.removes[(holder, tier, minute)] += len(hashes)
                for b in hashes:
                    if b in held:
                        self.lives.append((holder, tier, b, held.pop(b), ts, "remove"))

    def all_lives(self) -> list[tuple]:
        still = [(h, t, b, start, None, None) for (h, t), blocks in self.live.items() for b, start in blocks.items()]
        return sorted(self.lives + still, key=life_order)

    def held_elsewhere(self, tier: str) -> tuple[int, int]:
        """(life-opening stores on ``tier``, those while another holder had the block)."""
        by_block = defaultdict(list)
        for h, t, b, start, end, _ in self.all_lives():
            if t == tier:
                by_block[b].append((h, start, end))
        opens = [o for o in self.opens if o[1] == tier]
        hit = sum(1 for h, _, b, ts in opens
                  if any(o != h and s < ts and (e is None or e >= ts) for o, s, e in by_block[b]))
        return len(opens), hit

    def offload(self, tier: str) -> tuple[int, int, int, int]:
        """(GPU removes that ended a life, of those while the holder had the block on ``tier``,
        stores that opened a GPU life, of those while the holder had it on ``tier`` just before)."""
        on_tier = defaultdict(list)
        for h, t, b, start, end, _ in self.all_lives():
            if t == tier:
                on_tier[(h, b)].append((start, end))
        drops = [(h, b, end) for h, t, b, _, end, how in self.all_lives() if t == "GPU" and how == "remove"]
        kept = sum(1 for h, b, ts in drops if any(s <= ts and (e is None or e > ts) for s, e in on_tier[(h, b)]))
        stores = [(h, b, ts) for h, t, b, ts in self.opens if t == "GPU"]
        held = sum(1 for h, b, ts in stores if any(s < ts and (e is None or e >= ts) for s, e in on_tier[(h, b)]))
        return len(drops), kept, len(stores), held

    def max_holders(self, tier: str) -> dict[int, int]:
        """Per block: the most holders that had it at one instant."""
        points = defaultdict(lambda: defaultdict(int))
        for h, t, b, start, end, _ in self.all_lives():
            if t == tier:
                points[b][start] += 1
                if end is not None:
                    points[b][end] -= 1
        out = {}
        for b, deltas in points.items():
            n = best = 0
            for ts in sorted(deltas):
                n += deltas[ts]
                best = max(best, n)
            out[b] = best
        return out


@pytest.fixture
def fleet_run(stack: Settings, unique_topics, tmp_path):
    """The known run: (settings of the test's topics, the fleet, the oracle)."""
    from kvbus.infra.dev_topics import ensure_topics

    settings = replace(stack, topics=unique_topics)
    ensure_topics(settings.bootstrap, [unique_topics.for_ownership("kvcr")], settings.partitions, 1)
    model = ModelConfig(gpu_blocks=192, cpu_blocks=256, kvcr_blocks=128, cpu_rate=0.3, kvcr_rate=0.2,
                        clear_rate=0.004, requests_per_step=(1, 2))
    fleet = Fleet(FleetConfig(replicas=3, base_port=0, seed=13, model=model)).start()
    first = next(iter(fleet.models.values())).system
    assert all(m.system == first for m in fleet.models.values()), "the fleet-wide system prompts"
    pipeline = Pipeline(settings, tmp_path)
    run = uuid.uuid4().hex[:8]
    oracle = Oracle()
    try:
        pipeline.start("worker", "worker", "--app-id", f"report-{run}", "--workdir", str(tmp_path))
        for s in fleet.streams():
            pipeline.start(f"bridge-{s.replica}", "bridge", "--endpoint", s.endpoint,
                           "--replay-endpoint", s.replay_endpoint, "--replica", s.replica)
        batches: list[tuple[str, float, list]] = []
        for _ in range(STEPS):
            for (name, d), m in fleet.models.items():
                events = m.step()
                if events:
                    ts = time.time() + ENGINE_CLOCK[name]
                    fleet.publish_events(name, events, d, ts)
                    batches.append((f"{name}#{d}", ts, events))
        # the worker's default layout: packed records only (its layout 1 topics stay empty)
        topics = [unique_topics.packed, unique_topics.for_ownership("kvcr", packed=True)]
        published = sum(len(events) for _, _, events in batches)
        seen: list[int] = []

        def all_consolidated() -> bool:
            seen.append(sum(len(es) for es in consolidated(settings, topics).values()))
            return seen[-1] == published

        try:
            eventually(all_consolidated, 180, pipeline)
        except AssertionError:
            raise AssertionError(f"waited 180 s for the {published} published events in {topics}; "
                                 f"saw {seen[-1:]}") from None
        # each published event at the record time the worker gave its consolidated record
        records = consolidated(settings, topics)
        per_record = defaultdict(int)
        for es in records.values():
            for offset, _, _ in es:
                per_record[offset] += 1
        assert max(per_record.values()) > 1, "some packed record should hold several events (change the seed)"
        for holder, ts, events in batches:
            mine = records[holder][:len(events)]
            del records[holder][:len(events)]
            assert [v["ts"] for _, _, v in mine] == [ts] * len(events), holder
            oracle.apply(holder, [record_ts for _, record_ts, _ in mine], events)
            oracle.engine_ts[holder].add(ts)
        assert oracle.clears, "the run should hold at least one AllBlocksCleared (change the seed)"
        yield settings, fleet, oracle
    finally:
        pipeline.stop()
        fleet.stop()


def consolidated(settings: Settings, topics: list[str]) -> dict[str, list[tuple[tuple[str, int, int], float, dict]]]:
    """Per holder, the consolidated engine events in ``topics`` so far in position order (Reset
    markers the bridges add left out): (topic, partition and offset of the record that held the event,
    its record time, the event as a BlockEvent value)."""
    out: dict[str, list[tuple[tuple[str, int, int], float, dict]]] = defaultdict(list)
    for r in read(settings, topics, TimeRange()):
        for v in event_values(r, settings.topics):
            if v["event"][0] != "kvbus.Reset":
                out[f"{v['replica']}#{v['dp_rank']}"].append(((r.topic, r.partition, r.offset), r.timestamp, v))
    for es in out.values():
        es.sort(key=lambda e: (e[2]["epoch"], e[2]["seq"], e[2]["index"]))
    return out


def produce_extras(settings: Settings) -> None:
    """Two incomplete aggregates and three dead letters, as the worker and the stages write them."""
    reg = registry_client(settings.registry_url)
    p = Producer({"bootstrap.servers": settings.bootstrap})
    inc = RecordSerde(reg, "Incomplete")
    for i, missing in enumerate(([1], [1, 2])):
        p.produce(settings.topics.incomplete, inc.dumps(Incomplete(
            replica="replica-9", epoch=1, seq=i, index=0, workers=3, reported=[0], missing=missing,
            event=BlockRemoved(block_hashes=[b"\x00" * 7 + b"\x01"] * 2, medium="GPU")), settings.topics.incomplete),
            b"replica-9#0")
    dlq = RecordSerde(reg, "DeadLetter")
    for stage, reason in (("bridge", "DecodeError: bad msgpack"), ("bridge", "DecodeError: truncated"),
                          ("sink", "UnknownTier: x")):
        p.produce(settings.topics.dlq, dlq.dumps(DeadLetter(stage=stage, source="tcp://x", reason=reason,
                                                            payload=[b"abc"], ts=T0), settings.topics.dlq), b"src")
    assert p.flush(30) == 0


def run_report(settings: Settings, out: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvbus", "report", "--out", str(out), "--top", "1000", *args],
                          env=env_for(settings), capture_output=True, text=True, timeout=300)


def test_report_matches_the_fleets_ground_truth(fleet_run, tmp_path) -> None:
    settings, fleet, oracle = fleet_run
    produce_extras(settings)
    out = tmp_path / "report"
    done = run_report(settings, out, "--raw")
    assert done.returncode == 0, done.stderr[-3000:]
    lives = pl.read_parquet(out / "lives.parquet")
    got = sorted(((r["holder"], r["tier"], r["block"], r["start"], r["end"], r["ended"])
                  for r in lives.iter_rows(named=True)), key=life_order)
    assert got == oracle.all_lives()

    # live blocks at the end: the fleet's manifest on the framework's tiers, and on the kvcr tier
    # for holders never cleared (the fleet's model also drops kvcr blocks on a clear; the view does not)
    holders = pl.read_parquet(out / "holders.parquet")
    live_end = {(r["holder"], r["tier"]): r["live_end"] for r in holders.iter_rows(named=True)}
    manifest = fleet.manifest()["replicas"]
    for holder, rep in manifest.items():
        for tier_key, n in rep["tiers"].items():
            medium, ownership = tier_key.split("/")
            tier = medium + (f"@{ownership}" if ownership != "None" else "")
            if ownership == "None" or holder not in oracle.clears:
                assert live_end.get((holder, tier), 0) == n, (holder, tier)

    tiers = {r["tier"]: r for r in pl.read_parquet(out / "tiers.parquet").iter_rows(named=True)}
    assert set(tiers) == {"GPU", "CPU", "CPU@kvcr"}
    for tier, row in tiers.items():
        secs = [e - s for h, t, b, s, e, _ in oracle.all_lives() if t == tier and e is not None]
        if secs:
            assert [row["p50_s"], row["p90_s"], row["p99_s"]] == pytest.approx(
                list(np.quantile(secs, [0.5, 0.9, 0.99])), abs=1e-6)
        assert row["reannounced"] == oracle.reannounced[tier]
        assert (row["opening_stores"], row["held_elsewhere"]) == oracle.held_elsewhere(tier)
        holders_at_once = oracle.max_holders(tier)
        assert row["max_holders"] == max(holders_at_once.values())
        assert row["shared_blocks"] == sum(1 for n in holders_at_once.values() if n >= 2)
    assert tiers["GPU"]["held_elsewhere"] > 0 and tiers["GPU"]["max_holders"] == 3

    series = pl.read_parquet(out / "series.parquet").with_columns(m=pl.col("minute").dt.epoch("s") // 60)
    got_stores = {(r["holder"], r["tier"], r["m"]): r["stores"] for r in series.iter_rows(named=True) if r["stores"]}
    got_removes = {(r["holder"], r["tier"], r["m"]): r["removes"] for r in series.iter_rows(named=True) if r["removes"]}
    assert got_stores == dict(oracle.stores)
    assert got_removes == dict(oracle.removes)

    offload = {r["tier"]: r for r in pl.read_parquet(out / "offload.parquet").iter_rows(named=True)}
    assert set(offload) == {"CPU", "CPU@kvcr"}
    for tier, row in offload.items():
        assert (row["gpu_drops"], row["kept"], row["gpu_stores"], row["held_before"]) == oracle.offload(tier)
    assert offload["CPU"]["kept"] > 0 and offload["CPU"]["held_before"] > 0

    # the shared system prompts: every one stored by 2+ replicas is listed with its length
    prefixes = pl.read_parquet(out / "prefixes.parquet").filter(pl.col("tier") == "GPU")
    listed = {r["root"]: (r["blocks"], r["holders"]) for r in prefixes.iter_rows(named=True)}
    model = next(iter(fleet.models.values()))
    expected = {}
    for prompt in model.system:
        hashes, _ = model.hashes(prompt)
        holders = oracle.roots.get(("GPU", u64(hashes[0])), {})
        if len(holders) >= 2:
            expected[u64(hashes[0])] = (len(hashes), len(holders))
    assert expected and listed == expected

    # incomplete aggregates and dead letters, and the summary on stdout
    inc = pl.read_parquet(out / "incomplete.parquet").row(0, named=True)
    assert (inc["holder"], inc["kind"], inc["count"], inc["blocks"], inc["missing"]) == \
        ("replica-9#0", "remove", 2, 4, [1, 2])
    dlq = {(r["stage"], r["reason_kind"]): r["count"]
           for r in pl.read_parquet(out / "dead_letters.parquet").iter_rows(named=True)}
    assert dlq == {("bridge", "DecodeError"): 2, ("sink", "UnknownTier"): 1}
    assert "== sharing" in done.stdout and f"{tiers['GPU']['stores']:9d}" in done.stdout

    # kvbus.raw: every published batch, as one record (none was large enough to split)
    raw = {r["holder"]: r for r in pl.read_parquet(out / "raw.parquet").iter_rows(named=True)}
    assert set(raw) == set(oracle.batches)
    for holder, row in raw.items():
        assert (row["records"] - row["resets"], row["events"] - row["resets"], row["parts"]) == \
            (len(oracle.batches[holder]), sum(oracle.batches[holder]), 0)

    html = (out / "report.html").read_text()
    assert html.count("<svg") == 4 and "<script" not in html and "<link" not in html and " src=" not in html

    # the engines' clocks: ts kept as sent; the two a year off counted; nothing timed by them
    events = pl.read_parquet(out / "events.parquet").filter(pl.col("kind") != "reset")
    sent = {h: set(g["ts"].to_list()) for (h,), g in events.group_by("holder")}
    assert sent == oracle.engine_ts
    clocks = {r["holder"]: r for r in pl.read_parquet(out / "clocks.parquet").iter_rows(named=True)}
    counts = {h: (sum(n), 0, 0) for h, n in oracle.batches.items()}
    counts["replica-1#0"] = (counts["replica-1#0"][0], 0, counts["replica-1#0"][0])
    counts["replica-2#0"] = (counts["replica-2#0"][0], counts["replica-2#0"][0], 0)
    assert {h: (r["events"], r["ahead"], r["behind"]) for h, r in clocks.items()} == counts
    assert clocks["replica-1#0"]["off_median_skew_s"] == pytest.approx(-YEAR, abs=300)
    assert clocks["replica-2#0"]["off_median_skew_s"] == pytest.approx(YEAR, abs=300)
    off, total = counts["replica-1#0"][0] + counts["replica-2#0"][0], sum(c[0] for c in counts.values())
    assert f"{off} of {total} events" in done.stdout and "more than 300 s from their record time" in done.stdout
    # sparse series within the minutes the records span; files the size of a run of seconds
    minutes = events["record_time"].dt.epoch("s") // 60
    first, last = minutes.min(), minutes.max()
    assert first <= series["m"].min() and series["m"].max() <= last and series.height <= 9 * (last - first + 1)
    assert (out / "report.html").stat().st_size < 500_000 and (out / "series.parquet").stat().st_size < 100_000


def test_sample_prints_records_of_every_topic(fleet_run, tmp_path) -> None:
    settings, _, _ = fleet_run
    done = run_report(settings, tmp_path, "--sample", "1")
    assert done.returncode == 0, done.stderr[-3000:]
    sections = [line[2:] for line in done.stdout.splitlines() if line.startswith("# ")]
    t = settings.topics
    assert sections == sorted([t.packed, t.for_ownership("kvcr", packed=True)])
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert all(set(r["value"]) >= {"replica", "epoch", "seq", "ts", "events"} for r in rows)
    # packed records (their events shown up to the first six), each taken for an event kind of its topic
    # that no record before it had: at most one per kind (store, remove, clear, reset)
    kinds: dict[str, set[str]] = defaultdict(set)
    for section, r in zip(sections_of(done.stdout), rows, strict=True):
        kinds[section] |= {next(iter(e["event"])) for e in r["value"]["events"] if isinstance(e, dict)}
    assert all(sections_of(done.stdout).count(section) <= 4 for section in sections)
    # the run stored, removed and cleared on the framework's topic (a clear starts its engine batch)
    assert {"kvbus.BlockStored", "kvbus.BlockRemoved", "kvbus.AllBlocksCleared"} <= kinds[t.packed]


def sections_of(text: str) -> list[str]:
    """The topic section each JSON line of ``--sample`` output is in."""
    out, section = [], ""
    for line in text.splitlines():
        if line.startswith("# "):
            section = line[2:]
        elif line.startswith("{"):
            out.append(section)
    return out


def test_time_range_and_series_follow_the_kafka_record_time(stack: Settings, unique_topics) -> None:
    """Four records of one partition at record times T0, T0 + 1000 s, T0 + 2000 s and, out of order,
    T0 + 500 s, their engine clock a year behind: the range selects by record time (a record between
    the range's offsets whose time is outside it is left out), and the series are per record minute."""
    settings = replace(stack, topics=unique_topics)
    serde = RecordSerde(registry_client(settings.registry_url), "BlockEvent")
    p = Producer({"bootstrap.servers": settings.bootstrap})
    offsets_s = [0, 1000, 2000, 500]
    for i, at in enumerate(offsets_s):
        ev = BlockEvent(replica="r", epoch=1, seq=i, index=0, ts=T0 + at - YEAR,
                        event=BlockStored(block_hashes=[bytes([i + 1]) * 8], block_size=16, medium="GPU"))
        p.produce(unique_topics.blocks, serde.dumps(ev, unique_topics.blocks), b"r#0", timestamp=int((T0 + at) * 1000))
    assert p.flush(30) == 0
    seqs = lambda span: sorted(r.value["seq"] for r in read(settings, [unique_topics.blocks], span))  # noqa: E731
    assert seqs(TimeRange()) == [0, 1, 2, 3]
    assert seqs(TimeRange(since=T0 + 500, until=T0 + 1500)) == [1]   # the one at 500 s lies after the end offset
    assert seqs(TimeRange(since=T0 + 1000)) == [1, 2]                # the one at 500 s is read and left out
    assert seqs(TimeRange(until=T0 + 1000)) == [0]
    assert seqs(TimeRange(since=T0 + 3000)) == []

    t = unique_topics
    report = build_report(settings, list(read(settings, [t.blocks, t.incomplete, t.dlq], TimeRange())), raw=False)
    minutes = sorted(m.timestamp() for m in report.series["minute"])
    assert minutes == sorted((T0 + at) // 60 * 60 for at in offsets_s)
    assert report.clocks.select("holder", "events", "behind").rows() == [("r#0", 4, 4)]


def test_packed_records_count_as_the_events_they_hold(stack: Settings, unique_topics) -> None:
    """One holder's history in both block layouts, its engine clock a year behind: a BlockEvent on
    ``blocks``, then BlockEvents records of several events on ``blocks-packed`` and its kvcr tier topic,
    an AllBlocksCleared and Reset markers packed too. The report counts events (not records), takes each
    event's position from its record and entry, its tier from the event, and applies the packed clear to
    the lives the layout 1 record opened (one track per tier, whichever layout carried its events)."""
    from kvbus.infra.dev_topics import ensure_topics

    settings = replace(stack, topics=unique_topics)
    t = unique_topics
    kvcr = t.for_ownership("kvcr", packed=True)
    ensure_topics(settings.bootstrap, [t.packed, kvcr], settings.partitions, 1)
    reg = registry_client(settings.registry_url)
    one, many = RecordSerde(reg, "BlockEvent"), RecordSerde(reg, "BlockEvents")
    p = Producer({"bootstrap.servers": settings.bootstrap, "enable.idempotence": True})

    def gpu(*blocks: int, parent: int | None = None) -> BlockStored:
        return BlockStored(block_hashes=[b.to_bytes(8, "big") for b in blocks], block_size=16, medium="GPU",
                           parent_block_hash=parent.to_bytes(8, "big") if parent is not None else None)

    def packed(topic: str, at: float, epoch: int, seq: int, events: list[tuple[int, object]]) -> None:
        value = BlockEvents(replica="r", epoch=epoch, seq=seq, ts=T0 + at - YEAR, model="m",
                            events=[PositionedEvent(index=i, event=e) for i, e in events])
        p.produce(topic, many.dumps(value, topic), b"r#0", timestamp=int((T0 + at) * 1000))

    first = BlockEvent(replica="r", epoch=1, seq=0, index=0, ts=T0 - YEAR, event=gpu(1, 2))
    p.produce(t.blocks, one.dumps(first, t.blocks), b"r#0", timestamp=int(T0 * 1000))
    packed(t.packed, 10, 1, 1, [(0, gpu(3, parent=2)), (1, BlockRemoved(block_hashes=[(1).to_bytes(8, "big")],
                                                                         medium="GPU")), (2, gpu(4, 5))])
    packed(kvcr, 10, 1, 1, [(3, BlockStored(block_hashes=[(1).to_bytes(8, "big")], block_size=16, medium="CPU",
                                            ownership="kvcr"))])
    packed(t.packed, 20, 1, 2, [(0, AllBlocksCleared())])
    for topic in (t.packed, kvcr):
        packed(topic, 30, 2, -1, [(0, Reset(reason="engine-restart"))])
    assert p.flush(30) == 0

    records = list(read(settings, topics_to_read(settings, raw=False), TimeRange()))
    assert len(records) == 6
    report = build_report(settings, records, raw=False)
    ev = report.blocks
    # one row per block of each event: 2 + (1 + 1 + 2) + 1 + 1 clear + 2 resets
    assert ev.height == 10
    kvcr_row = ev.filter(pl.col("tier") == "CPU@kvcr").row(0, named=True)
    assert (kvcr_row["topic"], kvcr_row["track"], kvcr_row["epoch"], kvcr_row["seq"], kvcr_row["index"],
            kvcr_row["holder"], kvcr_row["ts"]) == (kvcr, t.for_ownership("kvcr"), 1, 1, 3, "r#0", T0 + 10 - YEAR)
    assert ev.filter(pl.col("topic") == t.packed, pl.col("seq") == 1)["index"].to_list() == [0, 1, 2, 2]
    # six engine events in four records, all a year behind
    assert report.clocks.select("holder", "events", "behind").rows() == [("r#0", 6, 6)]
    tiers = {r["tier"]: (r["stores"], r["removes"], r["live_end"]) for r in report.tiers.iter_rows(named=True)}
    assert tiers == {"GPU": (5, 1, 0), "CPU@kvcr": (1, 0, 0)}
    lives = sorted((r["tier"], r["block"], r["start"] - T0, r["end"] - T0, r["ended"])
                   for r in report.lives.iter_rows(named=True))
    assert lives == [("CPU@kvcr", 1, 10, 30, "reset"), ("GPU", 1, 0, 10, "remove"), ("GPU", 2, 0, 20, "clear"),
                     ("GPU", 3, 10, 20, "clear"), ("GPU", 4, 10, 20, "clear"), ("GPU", 5, 10, 20, "clear")]
