"""kvbus report's figures on a small hand-made history whose answers are worked out below:
lives, re-announcements, unmatched removes, clears, per-minute series, sharing and prefixes, all timed
by the Kafka record time while holder B's engine clock is a year behind; and the report over a
year of record time stays small."""
from __future__ import annotations

import itertools

import polars as pl
import pytest

from kvbus.analytics import html_report
from kvbus.analytics.html_report import CHART_POINTS, live_points
from kvbus.analytics.metrics import Report, compute
from kvbus.analytics.summary import clock_text, render
from kvbus.analytics.tables import _EVENT_SCHEMA, explode_blocks, tier_label

T0 = 1_700_000_040.0  # a whole minute
FW, KVCR = "b", "b.kvcr"
YEAR = 365 * 86400.0
ENGINE_CLOCK = {"A": 0.0, "B": -YEAR}
"""How far each replica's engine clock is from the record time: B's is a year behind."""
OFFSETS = itertools.count()
"""Each event's Kafka offset (one partition)."""


def h(n: int) -> bytes:
    return n.to_bytes(8, "big")


def ev(replica: str, seq: int, t: float, kind: str, hashes: list[int] | None = None, parent: int | None = None,
       topic: str = FW, medium: str | None = "GPU", ownership: str | None = None) -> dict:
    return {"topic": topic, "partition": 0, "offset": next(OFFSETS), "track": topic, "record_ts": T0 + t,
            "replica": replica, "dp_rank": 0, "epoch": 1, "seq": seq, "index": 0, "ts": T0 + t + ENGINE_CLOCK[replica],
            "kind": kind, "medium": medium, "ownership": ownership, "group_idx": None,
            "hashes": [h(x) for x in hashes] if hashes is not None else None,
            "parent_hash": h(parent) if parent is not None else None, "block_size": 16 if kind == "store" else None,
            "reason": None}


HISTORY = [
    ev("A", 0, 0, "store", [1, 2]),
    ev("A", 1, 10, "store", [1], topic=KVCR, medium="CPU", ownership="kvcr"),
    ev("B", 0, 30, "store", [1, 2]),
    ev("A", 2, 60, "store", [3], parent=2),
    ev("A", 3, 70, "remove", [1]),
    ev("A", 4, 80, "store", [2], parent=1),      # A holds 2 already: a re-announcement
    ev("B", 1, 100, "remove", [2]),
    ev("B", 2, 110, "remove", [9]),              # never stored: unmatched
    ev("A", 5, 130, "clear", medium=None),       # ends A's GPU lives of 2 and 3, not its kvcr tier
    ev("A", 6, 130, "store", [2]),               # same instant: A again, nobody else holds 2
    ev("A", 7, 140, "store", [1]),               # back on GPU while A's kvcr tier and B have it
]


def report_of(history: list[dict]) -> Report:
    blocks = explode_blocks(pl.DataFrame(history, schema=_EVENT_SCHEMA, orient="row"))
    empty = pl.DataFrame(schema={"holder": pl.String, "kind": pl.String, "blocks": pl.Int32,
                                 "missing": pl.List(pl.Int32)})
    dlq = pl.DataFrame(schema={"stage": pl.String, "reason_kind": pl.String, "payload_bytes": pl.Int64,
                               "reason": pl.String})
    return compute(blocks, FW, empty, dlq)


@pytest.fixture(scope="module")
def report() -> Report:
    return report_of(HISTORY)


def test_lives_end_at_removes_and_at_the_clear_of_their_topic(report) -> None:
    got = sorted((r["holder"], r["tier"], r["block"], r["start"] - T0,
                  None if r["end"] is None else r["end"] - T0, r["ended"]) for r in report.lives.iter_rows(named=True))
    assert got == [
        ("A#0", "CPU@kvcr", 1, 10, None, None),
        ("A#0", "GPU", 1, 0, 70, "remove"),
        ("A#0", "GPU", 1, 140, None, None),
        ("A#0", "GPU", 2, 0, 130, "clear"),
        ("A#0", "GPU", 2, 130, None, None),
        ("A#0", "GPU", 3, 60, 130, "clear"),
        ("B#0", "GPU", 1, 30, None, None),
        ("B#0", "GPU", 2, 30, 100, "remove"),
    ]


def test_tier_totals_lifetimes_and_sharing(report) -> None:
    gpu = report.tiers.filter(pl.col("tier") == "GPU").row(0, named=True)
    assert (gpu["stores"], gpu["removes"], gpu["reannounced"], gpu["unmatched_removes"]) == (8, 3, 1, 1)
    assert (gpu["live_end"], gpu["lives_ended"]) == (3, 4)
    assert (gpu["p50_s"], gpu["mean_s"]) == (70.0, 85.0)   # lifetimes 70, 130, 70, 70
    assert (gpu["blocks"], gpu["shared_blocks"], gpu["max_holders"]) == (3, 2, 2)
    # seven stores opened a life; B's two came while A held both blocks, A's at 140 while B held 1;
    # A's at 130 only while its own life of the block ended at that instant
    assert (gpu["opening_stores"], gpu["held_elsewhere"], gpu["held_elsewhere_frac"]) == (7, 3, 3 / 7)
    kvcr = report.tiers.filter(pl.col("tier") == "CPU@kvcr").row(0, named=True)
    assert (kvcr["stores"], kvcr["live_end"], kvcr["lives_ended"], kvcr["held_elsewhere"]) == (1, 1, 0, 0)


def test_per_minute_series(report) -> None:
    s = report.series.filter(pl.col("tier") == "GPU").sort("holder", "minute")
    got = [(r["holder"], int((r["minute"].timestamp() - T0) // 60), r["stores"], r["removes"], r["live"], r["churn"],
            r["minutes"]) for r in s.iter_rows(named=True)]
    # sparse: B had no event in minute 2, its minute-1 row stands for minutes 1 and 2 (the range's last)
    assert got == [
        ("A#0", 0, 2, 0, 2, 0.0, 1), ("A#0", 1, 2, 1, 2, 0.5, 1), ("A#0", 2, 2, 0, 2, 0.0, 1),
        ("B#0", 0, 2, 0, 2, 0.0, 1), ("B#0", 1, 0, 2, 1, 2.0, 2),
    ]
    # mean churn over the minutes something was live: A (0 + 0.5 + 0) / 3, B (0 + 2 + 0) / 3
    churn = {r["holder"]: r["mean_churn"] for r in report.holders.filter(pl.col("tier") == "GPU").iter_rows(named=True)}
    assert churn == pytest.approx({"A#0": 0.5 / 3, "B#0": 2 / 3})


def test_clocks_count_the_events_of_the_engine_a_year_off(report) -> None:
    rows = {r["holder"]: r for r in report.clocks.iter_rows(named=True)}
    assert (rows["B#0"]["events"], rows["B#0"]["off"], rows["B#0"]["ahead"], rows["B#0"]["behind"]) == (3, 3, 0, 3)
    assert rows["B#0"]["off_median_skew_s"] == pytest.approx(-YEAR) and rows["A#0"]["off_median_skew_s"] is None
    assert (rows["A#0"]["events"], rows["A#0"]["off"], rows["A#0"]["max_skew_s"]) == (8, 0, 0.0)
    assert report.clocks["holder"].to_list() == ["B#0", "A#0"]   # holders with clocks off first
    assert clock_text(report) == ("3 of 11 events (27.3 %) carried an engine clock more than 300 s from their record "
                                  "time (0 ahead, 3 behind)")
    assert "B#0                  3 of       3 events off, by -365.0 d (median of those" in render(report)


def test_a_year_of_record_time_stays_small() -> None:
    """One holder storing and removing a block every 20 minutes for a year, another once a week,
    its engine clock a year behind: the series has one row per minute with an event, the live chart
    at most CHART_POINTS points per tier, and the HTML stays well under a megabyte."""
    history = [ev("A", i, i * 1200.0, "store" if i % 2 == 0 else "remove", [1 + i // 2])
               for i in range(365 * 72)]           # every 20 minutes
    for w in range(52):
        history.append(ev("B", w, w * 7 * 86400.0 + 30, "store", [10_000_000 + w]))
    r = report_of(history)
    assert r.series.height == len(history)         # no two events of a holder in one minute
    points, width = live_points(r.series)
    assert width > 1 and points.group_by("tier").len()["len"].max() <= CHART_POINTS
    # each point is the fleet's live count at the end of its bin: A holds 0 or 1, B one more a week
    last = points.sort("minute").tail(1).row(0, named=True)
    assert last["live"] == 52
    page = html_report.render(r, "a year", "kvbus report")
    assert len(page.encode()) < 1_000_000 and page.count("<svg") == 4


def test_offload_counts_gpu_drops_kept_and_gpu_stores_held_on_another_tier(report) -> None:
    # GPU dropped 1 (A, t=70) while A's kvcr tier had it; A stored 1 on GPU again at 140 while it did;
    # of GPU's 2 removes that ended a life (B's remove of 9 did not) and 7 opening stores, those are
    # the only ones
    assert report.offload.rows(named=True) == [{
        "tier": "CPU@kvcr", "gpu_drops": 2, "kept": 1, "kept_frac": 1 / 2,
        "gpu_stores": 7, "held_before": 1, "held_before_frac": 1 / 7}]


def test_shared_prefix_is_the_run_both_holders_stored(report) -> None:
    assert report.prefixes.rows(named=True) == [
        {"tier": "GPU", "root": 1, "holders": 2, "max_holders": 2, "blocks": 2, "tokens": 32}]


def test_tier_labels_follow_the_sinks() -> None:
    df = pl.DataFrame({"m": [None, "cpu", "GPU", "CPU"], "o": [None, "kvcr", None, None], "g": [None, 0, 1, None]},
                      schema={"m": pl.String, "o": pl.String, "g": pl.Int32})
    got = df.select(tier_label(pl.col("m"), pl.col("o"), pl.col("g")))["m"].to_list()
    assert got == ["GPU", "CPU@kvcr", "GPU/g1", "CPU"]
