"""What the report computes from the block-events table, all of it in polars.

Every time is the Kafka record time (:data:`kvbus.analytics.tables.TIME`); the engine's ``ts`` only
feeds the clock check. Definitions (the tests hold the code to them):

* **series** (per holder, tier and UTC minute of record time, sparse: only the minutes in which the
  holder's tier had an event): ``stores`` / ``removes`` = block stores / removes in the minute
  (re-announcements and unmatched removes included), ``live`` = blocks held at the end of the minute
  (:mod:`kvbus.analytics.lifecycle`), ``churn`` = removes / live (null when nothing is live),
  ``minutes`` = the minutes the row stands for (until the next row, or the range's last minute):
  a minute without a row stored and removed nothing and held the previous row's ``live``;
* **lifetimes** (per tier): seconds from the store that made a block resident to the remove, clear
  or reset that ended it; lives still open at the end are not in the distribution (they are counted);
* **sharing** (per tier and block): the most holders that had the block at the same time (events of
  one instant are applied together), and for each life-opening store whether
  another holder held the block just before it: the prefill that prefix-aware routing could have
  served from a replica that already had it;
* **offload** (per holder tier other than ``GPU``): of the blocks ``GPU`` dropped (removes that
  ended a life), how many the holder still had on that tier at that instant (kept, not lost), and of
  the stores that put a block on ``GPU``, how many came while the holder had it on that tier just
  before (a load from that tier instead of a recompute, if the engine used it): what offloading buys;
* **shared prefixes**: for stores that start a prefix (``parent_block_hash`` null), grouped by their
  first block: how many holders stored it, the most that held it at once, and how many leading
  blocks all those holders stored identically (a system prompt's length, for instance);
* **clocks** (per holder): events whose engine ``ts`` lies more than :data:`CLOCK_SKEW_S` from their
  record time (``clock_skew_s``), and the spread of ``clock_skew_s``.
"""
from __future__ import annotations

from dataclasses import dataclass

import polars as pl

from kvbus.analytics.lifecycle import annotate, lives
from kvbus.analytics.tables import TIME, utc

QUANTILES = (0.5, 0.9, 0.99)
CLOCK_SKEW_S = 300.0
"""Seconds between an event's engine ``ts`` and its Kafka record time beyond which the engine's clock
is counted as off. The record time follows the engine time by the pipeline's latency (milliseconds; a
minute or so while a fault recovers, a backlog written late); five minutes is well past that and well
short of a clock that is wrong (a host without NTP, a wrong time zone, a trace replayed from another
day). ``kvbus report --clock-skew`` changes it."""


@dataclass
class Report:
    """Every table of one report (all polars DataFrames)."""

    blocks: pl.DataFrame
    """The block-events table (kvbus.analytics.tables)."""
    annotated: pl.DataFrame
    """Its store/remove rows with life annotations (kvbus.analytics.lifecycle.annotate)."""
    lives: pl.DataFrame
    """One row per block life."""
    series: pl.DataFrame
    """Per holder, tier and minute with an event: stores, removes, live, churn, minutes."""
    tiers: pl.DataFrame
    """Per tier: totals, lifetime quantiles, sharing figures."""
    holders: pl.DataFrame
    """Per holder and tier: totals, live at the end, mean churn."""
    sharing: pl.DataFrame
    """Per tier and block: ``max_holders`` at once, ``holders`` ever."""
    prefixes: pl.DataFrame
    """Shared prefixes, most shared first."""
    offload: pl.DataFrame
    """Per tier other than GPU: GPU drops the tier still held, GPU stores it held before."""
    incomplete: pl.DataFrame
    """Per holder and event kind: incomplete aggregates, blocks, missing worker ranks."""
    dead_letters: pl.DataFrame
    """Per stage and reason kind: dead letters, an example reason."""
    clocks: pl.DataFrame
    """Per holder: engine events, those off by more than ``clock_skew_s``, the spread of their skew."""
    clock_skew_s: float = CLOCK_SKEW_S
    """The threshold ``clocks`` counted with, seconds."""
    raw: pl.DataFrame | None = None
    """Per holder and worker rank (``--raw``): records, events per kind, split parts, resets."""


SERIES_KEY = ["holder", "tier", "minute"]


def series(annotated: pl.DataFrame, life: pl.DataFrame) -> pl.DataFrame:
    """The sparse per-minute series (module doc): one row per (holder, tier) and minute with a store,
    a remove, or a life that began or ended (a clear); as many rows as such minutes, whatever the
    range."""
    minute = lambda c: utc(pl.col(c)).dt.truncate("1m")  # noqa: E731
    counts = annotated.group_by("holder", "tier", minute(TIME).alias("minute")).agg(
        stores=(pl.col("kind") == "store").sum().cast(pl.Int64),
        removes=(pl.col("kind") == "remove").sum().cast(pl.Int64),
    )
    if counts.is_empty():
        return pl.DataFrame(schema={"holder": pl.String, "tier": pl.String, "minute": pl.Datetime("ms", "UTC"),
                                    "stores": pl.Int64, "removes": pl.Int64, "live": pl.Int64, "churn": pl.Float64,
                                    "minutes": pl.Int64})
    deltas = pl.concat([
        life.select("holder", "tier", minute("start").alias("minute"), delta=pl.lit(1, pl.Int64)),
        life.filter(pl.col("end").is_not_null()).select("holder", "tier", minute("end").alias("minute"),
                                                        delta=pl.lit(-1, pl.Int64)),
    ]).group_by(SERIES_KEY).agg(pl.col("delta").sum())
    out = (counts.join(deltas, on=SERIES_KEY, how="full", coalesce=True)
           .with_columns(pl.col("stores", "removes", "delta").fill_null(0))
           .sort(SERIES_KEY))
    after_last = pl.col("minute").max() + pl.duration(minutes=1)
    step = pl.col("minute").shift(-1).over("holder", "tier").fill_null(after_last)
    return out.with_columns(
        live=pl.col("delta").cum_sum().over("holder", "tier"),
        minutes=((step - pl.col("minute")).dt.total_minutes()).cast(pl.Int64),
    ).with_columns(
        churn=pl.when(pl.col("live") > 0).then(pl.col("removes") / pl.col("live")),
    ).select(*SERIES_KEY, "stores", "removes", "live", "churn", "minutes")


def sharing(life: pl.DataFrame, annotated: pl.DataFrame) -> tuple[pl.DataFrame, pl.DataFrame]:
    """(per tier and block: ``max_holders`` at once and ``holders`` ever; the life-opening stores
    with ``held_elsewhere``, the holders that had the block just before the store)."""
    deltas = pl.concat([
        life.select("tier", "block", pl.col("start").alias(TIME), delta=pl.lit(1, pl.Int64)),
        life.filter(pl.col("end").is_not_null()).select("tier", "block", pl.col("end").alias(TIME),
                                                        delta=pl.lit(-1, pl.Int64)),
    ]).group_by("tier", "block", TIME).agg(pl.col("delta").sum()).sort("tier", "block", TIME).with_columns(
        after=pl.col("delta").cum_sum().over("tier", "block"),
    ).with_columns(before=pl.col("after") - pl.col("delta"))
    per_block = deltas.group_by("tier", "block").agg(max_holders=pl.col("after").max()).join(
        life.group_by("tier", "block").agg(holders=pl.col("holder").n_unique()), on=["tier", "block"])
    # a holder whose own life of the block ended at the very instant it stores it again (a clear and
    # a store in one batch) counts in ``before`` if that life began earlier: take it out, it is not
    # another holder (a life that began and ended at that instant never counted)
    own = life.filter(pl.col("end").is_not_null() & (pl.col("start") < pl.col("end"))).select(
        "holder", "tier", "block", pl.col("end").alias(TIME), own=pl.lit(1))
    opens = (annotated.filter(pl.col("opening"))
             .join(deltas.select("tier", "block", TIME, "before"), on=["tier", "block", TIME], how="left")
             .join(own.unique(), on=["holder", "tier", "block", TIME], how="left")
             .with_columns(held_elsewhere=pl.col("before") - pl.col("own").fill_null(0))
             .drop("before", "own"))
    return per_block, opens


def offload(annotated: pl.DataFrame, life: pl.DataFrame, primary: str = "GPU") -> pl.DataFrame:
    """Per tier other than ``primary``: ``gpu_drops`` (removes that ended a ``primary`` life),
    ``kept`` (of those, the holder had the block on this tier at that instant), ``gpu_stores``
    (stores that opened a ``primary`` life), ``held_before`` (of those, the holder had the block on
    this tier just before), and the fractions ``kept_frac`` / ``held_before_frac``."""
    gpu = annotated.filter(pl.col("tier") == primary).with_row_index("row")
    other = life.filter(pl.col("tier") != primary).select(
        "holder", "block", other=pl.col("tier"), o_start=pl.col("start"), o_end=pl.col("end"))
    drops = gpu.filter(pl.col("closing"))
    stores = gpu.filter(pl.col("opening"))
    tiers = other.select(tier=pl.col("other")).unique()
    kept = drops.join(other, on=["holder", "block"]).filter(
        (pl.col("o_start") <= pl.col(TIME)) & (pl.col("o_end").is_null() | (pl.col("o_end") > pl.col(TIME)))
    ).group_by(tier=pl.col("other")).agg(kept=pl.col("row").n_unique())
    before = stores.join(other, on=["holder", "block"]).filter(
        (pl.col("o_start") < pl.col(TIME)) & (pl.col("o_end").is_null() | (pl.col("o_end") >= pl.col(TIME)))
    ).group_by(tier=pl.col("other")).agg(held_before=pl.col("row").n_unique())
    return (tiers.join(kept, on="tier", how="left").join(before, on="tier", how="left")
            .with_columns(gpu_drops=pl.lit(drops.height, pl.Int64), gpu_stores=pl.lit(stores.height, pl.Int64),
                          kept=pl.col("kept").fill_null(0).cast(pl.Int64),
                          held_before=pl.col("held_before").fill_null(0).cast(pl.Int64))
            .with_columns(kept_frac=pl.when(pl.col("gpu_drops") > 0).then(pl.col("kept") / pl.col("gpu_drops")),
                          held_before_frac=pl.when(pl.col("gpu_stores") > 0)
                          .then(pl.col("held_before") / pl.col("gpu_stores")))
            .select("tier", "gpu_drops", "kept", "kept_frac", "gpu_stores", "held_before", "held_before_frac")
            .sort("tier"))


def prefixes(annotated: pl.DataFrame, per_block: pl.DataFrame, top: int = 10) -> pl.DataFrame:
    """The most shared prefixes (module doc): ``tier``, ``root`` (first block), ``holders`` (that
    stored it), ``max_holders`` (at once), ``blocks`` (leading blocks all of them stored), ``tokens``."""
    roots = annotated.filter(pl.col("event_root").is_not_null() & (pl.col("kind") == "store"))
    per_idx = roots.group_by("tier", "event_root", "block_idx", "block").agg(
        n=pl.col("holder").n_unique(), block_size=pl.col("block_size").max())
    first = per_idx.filter(pl.col("block_idx") == 0).select("tier", "event_root", holders=pl.col("n"))
    full = (per_idx.join(first, on=["tier", "event_root"]).filter(pl.col("n") == pl.col("holders"))
            .group_by("tier", "event_root", "holders")
            .agg(blocks=(pl.col("block_idx").unique().sort() == pl.int_range(pl.col("block_idx").n_unique()))
                 .cum_min().sum(),
                 block_size=pl.col("block_size").max()))
    return (full.filter(pl.col("holders") >= 2)
            .join(per_block.select("tier", pl.col("block").alias("event_root"), "max_holders"),
                  on=["tier", "event_root"], how="left")
            .select("tier", pl.col("event_root").alias("root"), "holders", "max_holders",
                    pl.col("blocks").cast(pl.Int64),
                    (pl.col("blocks") * pl.col("block_size")).cast(pl.Int64).alias("tokens"))
            .sort(["max_holders", "holders", "blocks"], descending=True).head(top))


def tier_table(annotated: pl.DataFrame, life: pl.DataFrame, per_block: pl.DataFrame,
               opens: pl.DataFrame) -> pl.DataFrame:
    """Per tier: ``stores``, ``removes``, ``reannounced``, ``unmatched_removes``, ``live_end``,
    ``lives_ended``, lifetime ``p50_s``/``p90_s``/``p99_s``/``mean_s``, ``blocks`` (distinct),
    ``shared_blocks`` (held by 2+ holders at once), ``max_holders``, ``opening_stores``,
    ``held_elsewhere`` (of those, another holder had the block) and ``held_elsewhere_frac``."""
    t = annotated.group_by("tier").agg(
        stores=(pl.col("kind") == "store").sum(), removes=(pl.col("kind") == "remove").sum(),
        reannounced=pl.col("reannounce").sum(), unmatched_removes=pl.col("unmatched").sum())
    ended = life.filter(pl.col("end").is_not_null())
    lt = ended.group_by("tier").agg(
        lives_ended=pl.len(),
        **{f"p{int(q * 100)}_s": pl.col("seconds").quantile(q, "linear") for q in QUANTILES},
        mean_s=pl.col("seconds").mean())
    live = life.filter(pl.col("end").is_null()).group_by("tier").agg(live_end=pl.len())
    sh = per_block.group_by("tier").agg(blocks=pl.len(), shared_blocks=(pl.col("max_holders") >= 2).sum(),
                                        max_holders=pl.col("max_holders").max())
    op = opens.group_by("tier").agg(opening_stores=pl.len(), held_elsewhere=(pl.col("held_elsewhere") >= 1).sum())
    out = t
    for other in (live, lt, sh, op):
        out = out.join(other, on="tier", how="left")
    return out.with_columns(
        pl.col("live_end", "lives_ended", "held_elsewhere", "opening_stores").fill_null(0),
        held_elsewhere_frac=pl.when(pl.col("opening_stores") > 0)
        .then(pl.col("held_elsewhere") / pl.col("opening_stores")),
    ).sort("tier")


def holder_table(annotated: pl.DataFrame, life: pl.DataFrame, ser: pl.DataFrame) -> pl.DataFrame:
    """Per holder and tier: ``stores``, ``removes``, ``reannounced``, ``live_end`` and
    ``mean_churn`` (mean of the per-minute churn over the minutes something was live, from the
    holder's first event on the tier to the range's last minute)."""
    t = annotated.group_by("holder", "tier").agg(
        stores=(pl.col("kind") == "store").sum(), removes=(pl.col("kind") == "remove").sum(),
        reannounced=pl.col("reannounce").sum())
    live = life.filter(pl.col("end").is_null()).group_by("holder", "tier").agg(live_end=pl.len())
    churn = ser.group_by("holder", "tier").agg(
        churn=pl.col("churn").sum(), minutes=pl.col("minutes").filter(pl.col("live") > 0).sum(),
    ).select("holder", "tier", mean_churn=pl.when(pl.col("minutes") > 0).then(pl.col("churn") / pl.col("minutes")))
    return (t.join(live, on=["holder", "tier"], how="left").join(churn, on=["holder", "tier"], how="left")
            .with_columns(pl.col("live_end").fill_null(0)).sort("holder", "tier"))


def incomplete_summary(inc: pl.DataFrame) -> pl.DataFrame:
    """Per holder and kind: ``count`` of incomplete aggregates, ``blocks`` they named, the
    ``missing`` worker ranks (sorted, distinct)."""
    return inc.group_by("holder", "kind").agg(
        count=pl.len(), blocks=pl.col("blocks").sum(),
        missing=pl.col("missing").explode().drop_nulls().unique().sort()).sort("holder", "kind")


def dead_letter_summary(dlq: pl.DataFrame) -> pl.DataFrame:
    """Per stage and reason kind: ``count``, ``payload_bytes``, one ``example`` reason."""
    return dlq.group_by("stage", "reason_kind").agg(
        count=pl.len(), payload_bytes=pl.col("payload_bytes").sum(), example=pl.col("reason").first(),
    ).sort("count", descending=True)


def raw_summary(raw: pl.DataFrame) -> pl.DataFrame:
    """Per holder and worker rank of ``kvbus.raw``: ``records``, ``batches`` (distinct epoch/seq),
    ``parts`` (records of split batches beyond the first), events per kind, first/last engine time."""
    return raw.group_by("holder", "worker_rank").agg(
        records=pl.len(), batches=pl.struct("epoch", "seq").n_unique(),
        parts=(pl.col("first_index") > 0).sum(), events=pl.col("events").sum(), stores=pl.col("stores").sum(),
        removes=pl.col("removes").sum(), clears=pl.col("clears").sum(), resets=pl.col("resets").sum(),
        first_ts=pl.col("ts").min(), last_ts=pl.col("ts").max(),
    ).sort("holder", "worker_rank")


def clocks(blocks: pl.DataFrame, skew_s: float = CLOCK_SKEW_S) -> pl.DataFrame:
    """Per holder: ``events`` (engine events: records other than kvbus's Reset markers, whose time is
    the bridge's), ``off`` (of those, ``|clock_skew_s| > skew_s``), ``ahead`` / ``behind`` (off with
    the engine's clock ahead of / behind the record time), ``off_median_skew_s`` (the median
    ``clock_skew_s`` of the events off: how far off the clock was, null when none), and the
    ``median_skew_s``, ``min_skew_s``, ``max_skew_s`` of all its events (seconds, engine time minus
    record time). Holders with events off first."""
    ev = blocks.filter(pl.col("kind") != "reset").unique(["topic", "partition", "offset", "index"])  # one per event
    skew = pl.col("clock_skew_s")
    return ev.group_by("holder").agg(
        events=pl.len().cast(pl.Int64), off=(skew.abs() > skew_s).sum().cast(pl.Int64),
        ahead=(skew > skew_s).sum().cast(pl.Int64), behind=(skew < -skew_s).sum().cast(pl.Int64),
        off_median_skew_s=skew.filter(skew.abs() > skew_s).median(),
        median_skew_s=skew.median(), min_skew_s=skew.min(), max_skew_s=skew.max(),
    ).sort(["off", "holder"], descending=[True, False])


def compute(blocks: pl.DataFrame, framework_track: str, incomplete: pl.DataFrame, dead_letters: pl.DataFrame,
            raw: pl.DataFrame | None = None, top_prefixes: int = 10, clock_skew_s: float = CLOCK_SKEW_S) -> Report:
    """Every table of the report from the block-events table and the other topics' tables;
    ``framework_track``: the track of the framework-owned block topics (``Topics.blocks``)."""
    ann = annotate(blocks, framework_track)
    life = lives(ann)
    ser = series(ann, life)
    per_block, opens = sharing(life, ann)
    return Report(
        blocks=blocks, annotated=ann, lives=life, series=ser,
        tiers=tier_table(ann, life, per_block, opens), holders=holder_table(ann, life, ser),
        sharing=per_block, prefixes=prefixes(ann, per_block, top_prefixes), offload=offload(ann, life),
        incomplete=incomplete_summary(incomplete), dead_letters=dead_letter_summary(dead_letters),
        clocks=clocks(blocks, clock_skew_s), clock_skew_s=clock_skew_s,
        raw=raw_summary(raw) if raw is not None else None,
    )
