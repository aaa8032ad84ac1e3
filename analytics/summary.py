"""The report's terminal summary: plain text, one section per question, figures from
:class:`kvbus.analytics.metrics.Report`."""
from __future__ import annotations

from datetime import datetime, timezone

import polars as pl

from kvbus.analytics.metrics import Report
from kvbus.analytics.tables import TIME


def _fmt_s(v: float | None) -> str:
    """A duration in seconds as ``12.3 s``, ``4.5 min``, ``6.7 h`` or ``365.0 d`` (signed), ``-`` for None."""
    if v is None:
        return "-"
    for unit, size, up_to in (("s", 1, 120), ("min", 60, 7200), ("h", 3600, 172800)):
        if abs(v) < up_to:
            return f"{v / size:.1f} {unit}"
    return f"{v / 86400:.1f} d"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f} %"


def _utc(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


def span_text(report: Report) -> str:
    """``record time <first> .. <last> UTC (<seconds> s)`` of the block events, or ``no block events``."""
    b = report.blocks
    if b.is_empty():
        return "no block events"
    lo, hi = b[TIME].min(), b[TIME].max()
    return f"record time {_utc(lo)} .. {_utc(hi)} UTC ({hi - lo:.0f} s)"


def clock_text(report: Report) -> str:
    """How many engine events carried a clock more than ``report.clock_skew_s`` from their record time."""
    c = report.clocks
    events, off = int(c["events"].sum() or 0), int(c["off"].sum() or 0)
    frac = f" ({_pct(off / events)})" if events else ""
    return (f"{off} of {events} events{frac} carried an engine clock more than {report.clock_skew_s:g} s from their "
            f"record time ({int(c['ahead'].sum() or 0)} ahead, {int(c['behind'].sum() or 0)} behind)")


def render(report: Report, header: str = "") -> str:
    """The whole summary as text."""
    out: list[str] = []
    add = out.append
    b = report.blocks
    add(f"== kvbus report{': ' + header if header else ''}")
    holders = b["holder"].n_unique() if not b.is_empty() else 0
    add(f"   {b.height} block events from {holders} holders; {span_text(report)}")
    add("== tiers: stores, removes, live at the end, block lifetime (store -> remove/clear)")
    add(f"   {'tier':12s} {'stores':>9s} {'removes':>9s} {'re-ann.':>8s} {'unmatched':>9s} {'live':>8s} "
        f"{'p50':>9s} {'p90':>9s} {'p99':>9s} {'lives':>7s}")
    for r in report.tiers.iter_rows(named=True):
        add(f"   {r['tier']:12s} {r['stores']:9d} {r['removes']:9d} {r['reannounced']:8d} {r['unmatched_removes']:9d} "
            f"{r['live_end']:8d} {_fmt_s(r['p50_s']):>9s} {_fmt_s(r['p90_s']):>9s} {_fmt_s(r['p99_s']):>9s} "
            f"{r['lives_ended']:7d}")
    add("== sharing: blocks held by 2+ holders at once; stores of a block another holder already held")
    for r in report.tiers.iter_rows(named=True):
        add(f"   {r['tier']:12s} {r['shared_blocks'] or 0:7d} of {r['blocks'] or 0:7d} blocks shared, at most "
            f"{r['max_holders'] or 0} holders at once; {r['held_elsewhere']:7d} of {r['opening_stores']:7d} stores "
            f"({_pct(r['held_elsewhere_frac'])}) were already held elsewhere")
    add("== offloading: GPU drops the holder still had on another tier; GPU stores it had there just before")
    if report.offload.is_empty():
        add("   no tier besides GPU")
    for r in report.offload.iter_rows(named=True):
        add(f"   {r['tier']:12s} kept {r['kept']:7d} of {r['gpu_drops']:7d} GPU drops ({_pct(r['kept_frac'])}); "
            f"held {r['held_before']:7d} of {r['gpu_stores']:7d} GPU stores before them "
            f"({_pct(r['held_before_frac'])})")
    add("== most shared prefixes (stores that start a prefix, grouped by their first block)")
    if report.prefixes.is_empty():
        add("   none held by 2+ holders")
    for r in report.prefixes.iter_rows(named=True):
        add(f"   {r['tier']:12s} root {r['root']:#018x}: {r['blocks']:3d} blocks ({r['tokens']} tokens) stored by "
            f"{r['holders']} holders, {r['max_holders']} at once")
    add("== churn per holder (mean over minutes of removes / live blocks)")
    for r in report.holders.iter_rows(named=True):
        churn = "-" if r["mean_churn"] is None else f"{r['mean_churn']:.3f}"
        add(f"   {r['holder']:14s} {r['tier']:12s} stores {r['stores']:8d} removes {r['removes']:8d} "
            f"live {r['live_end']:7d} churn/min {churn}")
    add("== incomplete aggregates (kvbus.incomplete)")
    if report.incomplete.is_empty():
        add("   none")
    for r in report.incomplete.iter_rows(named=True):
        add(f"   {r['holder']:14s} {r['kind']:7s} {r['count']:6d} events, {r['blocks']} blocks, "
            f"missing workers {r['missing']}")
    add("== dead letters (kvbus.dlq) per stage and reason")
    if report.dead_letters.is_empty():
        add("   none")
    for r in report.dead_letters.iter_rows(named=True):
        add(f"   {r['stage']:10s} {r['reason_kind'][:40]:40s} {r['count']:6d}  e.g. {r['example'][:80]}")
    add("== engine clocks (the report is timed by the Kafka record time; ts - record time per holder)")
    add(f"   {clock_text(report)}")
    for r in report.clocks.filter(pl.col("off") > 0).iter_rows(named=True):
        add(f"   {r['holder']:14s} {r['off']:7d} of {r['events']:7d} events off, by {_fmt_s(r['off_median_skew_s'])} "
            f"(median of those; all: {_fmt_s(r['min_skew_s'])} .. {_fmt_s(r['max_skew_s'])})")
    if report.raw is not None:
        add("== kvbus.raw per holder and worker (records, engine batches, split parts, events)")
        for r in report.raw.iter_rows(named=True):
            add(f"   {r['holder']:14s} worker {r['worker_rank']}: {r['records']} records, {r['batches']} batches, "
                f"{r['parts']} extra parts, {r['events']} events ({r['stores']} stores, {r['removes']} removes, "
                f"{r['clears']} clears, {r['resets']} resets)")
    return "\n".join(out)

