"""Each block's lives on each holder's tier: from the store that made it resident to the remove,
``AllBlocksCleared`` or ``Reset`` that ended it (or the end of the range).

The rules are the residency view's (sinks/view/store.py, docs/sinks-layout.md), on set semantics:

* a holder's events are ordered by position ``(epoch, seq, index)`` and, within an event, by block;
* a store of a block the tier does not hold opens a life; a store of a block it holds already is a
  **re-announcement** (as engines send under ``kv_cache_report_mode=full``, or offloading connectors
  once per chunk) and changes nothing here (the sink reference-counts CPU-like tiers; this report
  counts such stores as re-announcements and ends the life at the first remove);
* a remove of a held block ends its life; a remove of a block not held (stored before the range, or
  removed twice) is **unmatched**;
* ``AllBlocksCleared`` (on ``kvbus.blocks`` or ``kvbus.blocks-packed``: the framework's track) ends every
  life of the holder on the tiers of that track (the framework's own cache); a ``Reset`` marker ends
  every life of the holder on every tier.

Times are Kafka record times (:data:`kvbus.analytics.tables.TIME`), not the engine's ``ts``: a life
of a holder whose engine clock is off is as long as the records say, and lives of different holders
compare on one clock.

Lives that began before the range was read are unknown: with ``--since``, live counts start at 0
and removes of older blocks are unmatched. From the beginning of the topics (and with retention
longer than the run) they are exact.
"""
from __future__ import annotations

import polars as pl

from kvbus.analytics.tables import TIME

ORDER = ["holder", "epoch", "seq", "index", "block_idx", "track"]
"""Sort order of a holder's rows: position, then block within the event."""

LIFE_KEY = ["holder", "tier", "block", "gen"]
"""One block on one holder's tier between two clears/resets that apply to it."""


def annotate(blocks: pl.DataFrame, framework_track: str) -> pl.DataFrame:
    """The store and remove rows of ``blocks`` (:func:`kvbus.analytics.tables.block_events`), in holder
    order, with:

    ``gen`` (clears and resets that apply to the row's tier before it), ``reannounce`` (a store of
    a held block), ``opening`` (a store that opened a life), ``closing`` (a remove that ended one),
    ``unmatched`` (a remove of a block not held), ``open_ts`` (record time the current life began),
    ``lifetime_s`` (closing removes: seconds since the life began), ``end_ts`` / ``ended`` (the
    last row of a life still open at its last event: time and kind of the clear or reset that ended
    it, null while it is live at the end of the range).

    ``framework_track`` is the track (``Topics.track``) of the framework-owned topics: the layout 1 name
    ``kvbus.blocks``, which names the events of ``kvbus.blocks-packed`` too."""
    df = blocks.sort(ORDER)
    fw = pl.col("track") == framework_track
    is_reset = (pl.col("kind") == "reset") & fw  # a Reset comes on every track the holder uses: count it once
    is_clear = pl.col("kind") == "clear"
    df = df.with_columns(
        resets_before=is_reset.cast(pl.Int32).cum_sum().over("holder"),
        clears_before=is_clear.cast(pl.Int32).cum_sum().over("holder"),
        # time and kind of the next marker that ends lives of a framework tier / any tier
        next_end_fw=pl.when(is_reset | is_clear).then(pl.col(TIME)).backward_fill().over("holder"),
        next_end_fw_kind=pl.when(is_reset | is_clear).then(pl.col("kind").cast(pl.String))
        .backward_fill().over("holder"),
        next_end_any=pl.when(is_reset).then(pl.col(TIME)).backward_fill().over("holder"),
    )
    df = df.filter(pl.col("kind").is_in(["store", "remove"])).with_columns(
        gen=pl.col("resets_before") + pl.when(fw).then(pl.col("clears_before")).otherwise(0),
    )
    prev = pl.col("kind").shift(1).over(LIFE_KEY)
    store, remove = pl.col("kind") == "store", pl.col("kind") == "remove"
    df = df.with_columns(
        reannounce=(store & (prev == "store")).fill_null(False),
        opening=store & (prev.is_null() | (prev == "remove")),
        closing=(remove & (prev == "store")).fill_null(False),
        last_of_life=pl.int_range(pl.len()).over(LIFE_KEY) == pl.len().over(LIFE_KEY) - 1,
    ).with_columns(
        unmatched=remove & ~pl.col("closing"),
        open_ts=pl.when(pl.col("opening")).then(pl.col(TIME)).forward_fill().over(LIFE_KEY),
    )
    open_at_end = pl.col("last_of_life") & store
    return df.with_columns(
        lifetime_s=pl.when(pl.col("closing")).then(pl.col(TIME) - pl.col("open_ts")),
        end_ts=pl.when(open_at_end).then(pl.when(fw).then(pl.col("next_end_fw")).otherwise(pl.col("next_end_any"))),
        ended=pl.when(open_at_end).then(pl.when(fw).then(pl.col("next_end_fw_kind")).otherwise(
            pl.when(pl.col("next_end_any").is_not_null()).then(pl.lit("reset")))),
    ).drop("resets_before", "clears_before", "next_end_fw", "next_end_fw_kind", "next_end_any")


def lives(annotated: pl.DataFrame) -> pl.DataFrame:
    """One row per life: ``holder``, ``tier``, ``block``, ``start`` (record time of the opening
    store, seconds since the epoch), ``end`` (of the remove, clear or reset that ended it; null while
    live at the end of the range), ``ended`` (``remove``, ``clear``, ``reset`` or null), ``seconds``."""
    cols = ["holder", "tier", "block"]
    closed = annotated.filter(pl.col("closing")).select(
        *cols, start=pl.col("open_ts"), end=pl.col(TIME), ended=pl.lit("remove"))
    tail = annotated.filter(pl.col("last_of_life") & (pl.col("kind") == "store")).select(
        *cols, start=pl.col("open_ts"), end=pl.col("end_ts"), ended=pl.col("ended"))
    return pl.concat([closed, tail]).with_columns(seconds=pl.col("end") - pl.col("start"))
