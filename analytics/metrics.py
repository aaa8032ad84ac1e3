"""What the report computes from the block-events table, all of it in polars.

Definitions (the tests hold the code to them):

* **series** (per holder, tier and UTC minute of engine time): ``stores`` / ``removes`` = block
  stores / removes in the minute (re-announcements and unmatched removes included), ``live`` =
  blocks held at the end of the minute (:mod:`kvbus.analytics.lifecycle`), ``churn`` = removes / live
  (null when nothing is live);
* **lifetimes** (per tier): seconds from the store that made a block resident to the remove, clear
  or reset that ended it; lives still open at the end are not in the distribution (they are counted);
* **sharing** (per tier and block): the most holders that had the block at the same time (engine
  time; events of one instant are applied together), and for each life-opening store whether
  another holder held the block just before it: the prefill that prefix-aware routing could have
  served from a replica that already had it;
* **offload** (per holder tier other than ``GPU``): of the blocks ``GPU`` dropped (removes that
  ended a life), how many the holder still had on that tier at that instant (kept, not lost), and of
  the stores that put a block on ``GPU``, how many came while the holder had it on that tier just
  before (a load from that tier instead of a recompute, if the engine used it): what offloading buys;
* **shared prefixes**: for stores that start a prefix (``parent_block_hash`` null), grouped by their
  first block: how many holders stored it, the most that held it at once, and how many leading
  blocks all those holders stored identically (a system prompt's length, for instance).
"""
from __future__ import annotations

from dataclasses import dataclass

import polars as pl

from kvbus.analytics.lifecycle import annotate, lives

QUANTILES = (0.5, 0.9, 0.99)


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
    """Per holder, tier, minute: stores, removes, live, churn."""
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
    raw: pl.DataFrame | None = None
    """Per holder and worker rank (``--raw``): records, events per kind, split parts, resets."""


def series(annotated: pl.DataFrame, life: pl.DataFrame) -> pl.DataFrame:
    """Per-minute series (module doc) with every minute from the first to the last event present
    for every (holder, tier) seen."""
    minute = lambda c: pl.from_epoch((pl.col(c) * 1e6).cast(pl.Int64), time_unit="us") \
        .dt.replace_time_zone("UTC").dt.truncate("1m")  # noqa: E731
    counts = annotated.group_by("holder", "tier", minute("ts").alias("minute")).agg(
        stores=(pl.col("kind") == "store").sum().cast(pl.Int64),
        removes=(pl.col("kind") == "remove").sum().cast(pl.Int64),
    )
    deltas = pl.concat([
        life.select("holder", "tier", minute("start").alias("minute"), delta=pl.lit(1, pl.Int64)),
        life.filter(pl.col("end").is_not_null()).select("holder", "tier", minute("end").alias("minute"),
                                                        delta=pl.lit(-1, pl.Int64)),
    ]).group_by("holder", "tier", "minute").agg(pl.col("delta").sum())
    if counts.is_empty():
        return pl.DataFrame(schema={"holder": pl.String, "tier": pl.String, "minute": pl.Datetime("us", "UTC"),
                                    "stores": pl.Int64, "removes": pl.Int64, "live": pl.Int64, "churn": pl.Float64})
    lo, hi = counts["minute"].min(), pl.concat([counts["minute"], deltas["minute"]]).max()
    grid = counts.select("holder", "tier").unique().join(
        pl.DataFrame({"minute": pl.datetime_range(lo, hi, "1m", eager=True, time_zone="UTC")}), how="cross")
    out = (grid.join(counts, on=["holder", "tier", "minute"], how="left")
           .join(deltas, on=["holder", "tier", "minute"], how="left")
           .with_columns(pl.col("stores", "removes", "delta").fill_null(0))
           .sort("holder", "tier", "minute")
           .with_columns(live=pl.col("delta").cum_sum().over("holder", "tier")))
    return out.with_columns(
        churn=pl.when(pl.col("live") > 0).then(pl.col("removes") / pl.col("live")),
    ).drop("delta")


def sharing(life: pl.DataFrame, annotated: pl.DataFrame) -> tuple[pl.DataFrame, pl.DataFrame]:
    """(per tier and block: ``max_holders`` at once and ``holders`` ever; the life-opening stores
    with ``held_elsewhere``, the holders that had the block just before the store)."""
    deltas = pl.concat([
        life.select("tier", "block", ts=pl.col("start"), delta=pl.lit(1, pl.Int64)),
        life.filter(pl.col("end").is_not_null()).select("tier", "block", ts=pl.col("end"), delta=pl.lit(-1, pl.Int64)),
    ]).group_by("tier", "block", "ts").agg(pl.col("delta").sum()).sort("tier", "block", "ts").with_columns(
        after=pl.col("delta").cum_sum().over("tier", "block"),
    ).with_columns(before=pl.col("after") - pl.col("delta"))
    per_block = deltas.group_by("tier", "block").agg(max_holders=pl.col("after").max()).join(
        life.group_by("tier", "block").agg(holders=pl.col("holder").n_unique()), on=["tier", "block"])
    # a holder whose own life of the block ended at the very instant it stores it again (a clear and
    # a store in one batch) counts in ``before``: take it out, it is not another holder
    own = life.filter(pl.col("end").is_not_null()).select("holder", "tier", "block", ts=pl.col("end"), own=pl.lit(1))
    opens = (annotated.filter(pl.col("opening"))
             .join(deltas.select("tier", "block", "ts", "before"), on=["tier", "block", "ts"], how="left")
             .join(own.unique(), on=["holder", "tier", "block", "ts"], how="left")
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
        (pl.col("o_start") <= pl.col("ts")) & (pl.col("o_end").is_null() | (pl.col("o_end") > pl.col("ts")))
    ).group_by(tier=pl.col("other")).agg(kept=pl.col("row").n_unique())
    before = stores.join(other, on=["holder", "block"]).filter(
        (pl.col("o_start") < pl.col("ts")) & (pl.col("o_end").is_null() | (pl.col("o_end") >= pl.col("ts")))
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
                    pl.col("blocks").cast(pl.Int64), (pl.col("blocks") * pl.col("block_size")).cast(pl.Int64).alias("tokens"))
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
    ``mean_churn`` (mean over the minutes of the per-minute churn)."""
    t = annotated.group_by("holder", "tier").agg(
        stores=(pl.col("kind") == "store").sum(), removes=(pl.col("kind") == "remove").sum(),
        reannounced=pl.col("reannounce").sum())
    live = life.filter(pl.col("end").is_null()).group_by("holder", "tier").agg(live_end=pl.len())
    churn = ser.group_by("holder", "tier").agg(mean_churn=pl.col("churn").mean())
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


def compute(blocks: pl.DataFrame, framework_topic: str, incomplete: pl.DataFrame, dead_letters: pl.DataFrame,
            raw: pl.DataFrame | None = None, top_prefixes: int = 10) -> Report:
    """Every table of the report from the block-events table and the other topics' tables."""
    ann = annotate(blocks, framework_topic)
    life = lives(ann)
    ser = series(ann, life)
    per_block, opens = sharing(life, ann)
    return Report(
        blocks=blocks, annotated=ann, lives=life, series=ser,
        tiers=tier_table(ann, life, per_block, opens), holders=holder_table(ann, life, ser),
        sharing=per_block, prefixes=prefixes(ann, per_block, top_prefixes), offload=offload(ann, life),
        incomplete=incomplete_summary(incomplete), dead_letters=dead_letter_summary(dead_letters),
        raw=raw_summary(raw) if raw is not None else None,
    )
