"""The report as one self-contained HTML file: charts as inline SVG drawn by matplotlib, tables,
no script and nothing fetched (it opens offline, from a mail attachment or a CI artifact).

Charts: live blocks per tier over time (fleet-wide), the block lifetime histogram per tier, the
sharing distribution (blocks by the most holders that had them at once), churn per holder.

The file stays small whatever the range: the live chart has at most :data:`CHART_POINTS` points per
tier (minutes merged into wider bins over a long range), the other charts have a fixed number of bins
or one bar per holder, and the tables one row per tier, holder or stage.
"""
from __future__ import annotations

import html
import io
import math
from pathlib import Path

import matplotlib

matplotlib.use("svg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import polars as pl  # noqa: E402

from kvbus.analytics.metrics import Report  # noqa: E402
from kvbus.analytics.summary import clock_text, span_text  # noqa: E402

CHART_POINTS = 500
"""Most points per tier on the live chart (about one per two pixels of its width)."""
BIN_MINUTES = (1, 2, 5, 10, 15, 30, 60, 120, 180, 360, 720, 1440, 2880, 10080)
"""Widths the live chart's bins may have, in minutes (past a week: whole weeks)."""
MARKERS_UP_TO = 60
"""Points per tier up to which each point gets a marker."""

plt.rcParams.update({"svg.fonttype": "none", "font.size": 9, "axes.spines.top": False, "axes.spines.right": False})

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px auto;max-width:1100px;color:#222}
h1{font-size:22px} h2{font-size:17px;margin-top:28px;border-bottom:1px solid #ddd;padding-bottom:4px}
table{border-collapse:collapse;font-size:13px;margin:8px 0}
td,th{border:1px solid #ddd;padding:3px 8px;text-align:right}
th{background:#f4f4f4} td.l,th.l{text-align:left} .grid{display:grid;grid-template-columns:1fr 1fr;gap:12px}
.note{color:#666;font-size:12px} svg{max-width:100%;height:auto}
"""


def tier_colors(tiers: list[str]) -> dict[str, str]:
    """One colour per tier (sorted), the same in every chart of a report."""
    palette = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    return {t: palette[i % len(palette)] for i, t in enumerate(sorted(tiers))}


def _svg(fig: plt.Figure) -> str:
    buf = io.StringIO()
    fig.savefig(buf, format="svg", bbox_inches="tight")
    plt.close(fig)
    text = buf.getvalue()
    return text[text.index("<svg"):]  # drop the XML prolog and doctype: inline in HTML


def _empty(fig_title: str) -> str:
    fig, ax = plt.subplots(figsize=(5.2, 2.8))
    ax.set_title(fig_title)
    ax.text(0.5, 0.5, "no data in this range", ha="center", va="center", transform=ax.transAxes, color="#888")
    ax.set_axis_off()
    return _svg(fig)


def live_points(series: pl.DataFrame, max_points: int = CHART_POINTS) -> tuple[pl.DataFrame, int]:
    """(per tier: ``minute``, ``live`` = blocks all holders held at its end, at most ``max_points`` rows
    per tier; the bin width in minutes). From the sparse series: each holder's live count holds until
    its next row, so the fleet's count changes only at rows; over a long range the minutes are merged
    into bins of ``width`` minutes, each shown by its last minute's count (the live count at the bin's end)."""
    if series.is_empty():
        return pl.DataFrame(schema={"tier": pl.String, "minute": pl.Datetime("ms", "UTC"), "live": pl.Int64}), 1
    key = ["holder", "tier"]
    change = series.sort(*key, "minute").select(
        "tier", "minute", change=pl.col("live") - pl.col("live").shift(1, fill_value=0).over(key))
    per = (change.group_by("tier", "minute").agg(pl.col("change").sum()).sort("tier", "minute")
           .select("tier", "minute", live=pl.col("change").cum_sum().over("tier")))
    lo, hi = per["minute"].min(), per["minute"].max()
    span = int((hi - lo).total_seconds() // 60) + 1
    need = math.ceil(span / max(max_points - 1, 1))
    width = next((w for w in BIN_MINUTES if w >= need), math.ceil(need / 10080) * 10080)
    if width == 1:
        return per, 1
    return (per.with_columns(bin=((pl.col("minute") - lo).dt.total_minutes() // width))
            .group_by("tier", "bin").agg(pl.col("minute").last(), pl.col("live").last())
            .sort("tier", "minute").select("tier", "minute", "live")), width


def _minutes_text(n: int) -> str:
    """``minute``, ``15 minutes``, ``hour``, ``2 hours``, ``day``, ``2 weeks`` (the largest unit ``n`` minutes
    is a whole number of)."""
    for unit, size in (("week", 10080), ("day", 1440), ("hour", 60), ("minute", 1)):
        if n % size == 0:
            return unit if n == size else f"{n // size} {unit}s"
    return f"{n} minutes"


def live_chart(series: pl.DataFrame, colors: dict[str, str], max_points: int = CHART_POINTS) -> str:
    """Live blocks per tier over record time, summed over holders, as steps (:func:`live_points`)."""
    points, width = live_points(series, max_points)
    title = f"Live blocks per tier (all holders, end of each {_minutes_text(width)})"
    if points.is_empty():
        return _empty(title)
    fig, ax = plt.subplots(figsize=(10.5, 3.4))
    for (tier,), g in points.group_by("tier", maintain_order=True):
        marker = {"marker": "o", "ms": 3} if g.height <= MARKERS_UP_TO else {}
        ax.step(g["minute"].to_list(), g["live"].to_list(), where="post", label=tier, color=colors.get(tier),
                **marker)
    ax.set_title(title)
    ax.set_ylabel("blocks")
    ax.legend(loc="upper left", fontsize=8)
    fig.autofmt_xdate()
    return _svg(fig)


def lifetime_chart(lives: pl.DataFrame, colors: dict[str, str]) -> str:
    """Histogram of ended block lifetimes per tier (log-spaced seconds)."""
    title = "Block lifetime, store to remove/clear (seconds)"
    ended = lives.filter(pl.col("end").is_not_null() & (pl.col("seconds") >= 0))
    if ended.is_empty():
        return _empty(title)
    secs = ended["seconds"].to_numpy()
    lo = max(secs[secs > 0].min() if (secs > 0).any() else 0.01, 0.01)
    bins = np.geomspace(lo, max(secs.max(), lo * 10), 30)
    fig, ax = plt.subplots(figsize=(5.2, 3.2))
    for (tier,), g in ended.sort("tier").group_by("tier", maintain_order=True):
        ax.hist(np.clip(g["seconds"].to_numpy(), lo, None), bins=bins, histtype="step", lw=1.5, label=tier,
                color=colors.get(tier))
    ax.set_xscale("log")
    ax.set_title(title)
    ax.set_ylabel("lives")
    ax.legend(fontsize=8)
    return _svg(fig)


def _grouped_bars(ax: plt.Axes, df: pl.DataFrame, x: str, y: str, colors: dict[str, str], **tick_kw) -> None:
    """One group of bars per value of column ``x`` (sorted), one bar per tier in it, height ``y``."""
    xs = sorted(df[x].unique().to_list())
    tiers = sorted(df["tier"].unique().to_list())
    width = 0.8 / max(len(tiers), 1)
    for i, tier in enumerate(tiers):
        g = dict(df.filter(pl.col("tier") == tier).select(x, y).iter_rows())
        ax.bar([k + i * width for k in range(len(xs))], [g.get(v, 0) for v in xs], width, label=tier,
               color=colors.get(tier))
    ax.set_xticks([k + width * (len(tiers) - 1) / 2 for k in range(len(xs))], [str(v) for v in xs], **tick_kw)
    ax.legend(fontsize=8)


def sharing_chart(sharing: pl.DataFrame, colors: dict[str, str]) -> str:
    """Blocks by the most holders that had them at once, per tier."""
    title = "Sharing: blocks by holders at once"
    if sharing.is_empty():
        return _empty(title)
    fig, ax = plt.subplots(figsize=(5.2, 3.2))
    _grouped_bars(ax, sharing.group_by("tier", "max_holders").agg(blocks=pl.len()), "max_holders", "blocks", colors)
    ax.set_yscale("log")
    ax.set_xlabel("most holders at once")
    ax.set_ylabel("blocks")
    ax.set_title(title)
    return _svg(fig)


def churn_chart(holders: pl.DataFrame, colors: dict[str, str]) -> str:
    """Mean per-minute churn (removes / live) per holder, one bar per tier."""
    title = "Churn per holder (mean over minutes of removes / live)"
    h = holders.filter(pl.col("mean_churn").is_not_null())
    if h.is_empty():
        return _empty(title)
    fig, ax = plt.subplots(figsize=(10.5, 3.0))
    _grouped_bars(ax, h, "holder", "mean_churn", colors, rotation=30, ha="right")
    ax.set_ylabel("removes / live per minute")
    ax.set_title(title)
    return _svg(fig)


def _table(df: pl.DataFrame, left: tuple[str, ...] = ()) -> str:
    if df.is_empty():
        return '<p class="note">none</p>'
    head = "".join(f'<th class="{"l" if c in left else ""}">{html.escape(c)}</th>' for c in df.columns)
    rows = []
    for r in df.iter_rows():
        cells = []
        for c, v in zip(df.columns, r):
            if isinstance(v, float):
                v = f"{v:.3f}" if abs(v) < 100 else f"{v:.1f}"
            elif isinstance(v, list):
                v = ", ".join(map(str, v))
            cells.append(f'<td class="{"l" if c in left else ""}">{html.escape("" if v is None else str(v))}</td>')
        rows.append("<tr>" + "".join(cells) + "</tr>")
    return f"<table><tr>{head}</tr>{''.join(rows)}</table>"


def render(report: Report, title: str, command: str) -> str:
    """The whole HTML document."""
    b = report.blocks
    span = span_text(report)
    if not b.is_empty():
        span += f", {b.height} block events, {b['holder'].n_unique()} holders"
    tiers = report.tiers.select(
        "tier", "stores", "removes", "reannounced", "unmatched_removes", "live_end", "lives_ended",
        "p50_s", "p90_s", "p99_s", "mean_s")
    shared = report.tiers.select("tier", "blocks", "shared_blocks", "max_holders", "opening_stores", "held_elsewhere",
                                 "held_elsewhere_frac")
    colors = tier_colors(report.tiers["tier"].to_list())
    prefixes = report.prefixes.with_columns(pl.col("root").map_elements(lambda x: f"{x:#018x}", return_dtype=pl.String))
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>{html.escape(title)}</title><style>{_CSS}</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
        f"<p>{html.escape(span)}</p><p class='note'>made by <code>{html.escape(command)}</code></p>",
        "<h2>Live blocks over time</h2>", live_chart(report.series, colors),
        "<h2>Lifetimes and sharing</h2><div class='grid'>", lifetime_chart(report.lives, colors),
        sharing_chart(report.sharing, colors), "</div>",
        "<h2>Per tier</h2>", _table(tiers, ("tier",)),
        "<p class='note'>block stores and removes; reannounced: stores of a block the tier held already; "
        "unmatched: removes of a block not held (stored before the range); lifetimes (p50_s ... mean_s) in "
        "seconds of Kafka record time, of lives that ended in the range</p>",
        "<h2>Sharing per tier</h2>", _table(shared, ("tier",)),
        "<p class='note'>shared_blocks: held by 2 or more holders at once; held_elsewhere: stores that opened a "
        "block's life while another holder already had it on that tier (prefill a prefix-aware router could "
        "have avoided)</p>",
        "<h2>What offloading buys</h2>", _table(report.offload, ("tier",)),
        "<p class='note'>gpu_drops: GPU removes that ended a block's life; kept: the holder still had the block on "
        "this tier then; gpu_stores: stores that put a block on GPU; held_before: the holder had it on this tier "
        "just before (a load instead of a recompute, if the engine used it)</p>",
        "<h2>Most shared prefixes</h2>", _table(prefixes, ("tier", "root")),
        "<h2>Churn per holder</h2>", churn_chart(report.holders, colors), _table(report.holders, ("holder", "tier")),
        "<h2>Incomplete aggregates</h2>", _table(report.incomplete, ("holder", "kind", "missing")),
        "<h2>Dead letters</h2>", _table(report.dead_letters, ("stage", "reason_kind", "example")),
        "<h2>Engine clocks</h2>", f"<p>{html.escape(clock_text(report))}</p>", _table(report.clocks, ("holder",)),
        (f"<p class='note'>clock_skew_s: the engine's ts minus the Kafka record time, seconds; off: more than "
         f"{report.clock_skew_s:g} s either way (ahead / behind). Everything above is timed by the record time; "
         "ts is kept in events.parquet</p>"),
    ]
    if report.raw is not None:
        parts += ["<h2>kvbus.raw per holder and worker</h2>", _table(report.raw, ("holder",))]
    parts.append("</body></html>")
    return "\n".join(parts)


def write(report: Report, path: Path, title: str, command: str) -> Path:
    """Write the HTML report to ``path``; returns it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render(report, title, command), encoding="utf-8")
    return path
