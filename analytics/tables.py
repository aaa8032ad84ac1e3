"""Decoded records -> the report's tables (polars DataFrames, Arrow underneath).

``block events`` (:func:`block_events`, written as ``events.parquet``): one row per block of every
consolidated event, plus one row per ``AllBlocksCleared`` / ``Reset`` (``block`` null). Both block layouts
(:mod:`kvbus.schemas.topics`) are read: a ``BlockEvent`` record (layout 1) is one event, a ``BlockEvents``
record (layout 2, ``kvbus.blocks-packed*``) is one event per entry of its ``events`` (:func:`event_values`):

| column | meaning |
|---|---|
| ``topic``, ``partition``, ``offset`` | where the record was read (the events of a layout 2 record share them) |
| ``track`` | the position order the event belongs to: the layout 1 topic of its tier (``Topics.track``) |
| ``record_time`` | Kafka record timestamp (UTC), ``record_ts`` the same in epoch seconds (the report's clock) |
| ``holder`` | ``<replica>#<dp_rank>``; also ``replica``, ``dp_rank`` |
| ``epoch``, ``seq``, ``index`` | the event's position (docs/architecture.md) |
| ``time`` | engine time of the event's batch (UTC), ``ts`` the same in seconds since the epoch, as the engine sent it |
| ``clock_skew_s`` | ``ts - record_ts``: how far the engine's clock was from the record time (normally ms behind) |
| ``kind`` | ``store``, ``remove``, ``clear`` (AllBlocksCleared), ``reset`` (kvbus Reset marker) |
| ``medium``, ``ownership``, ``group_idx`` | the event's tier fields as sent |
| ``tier`` | tier label ``MEDIUM[@ownership][/g<group>]`` (the sink's labels; null medium: GPU); null for clear/reset |
| ``block`` | block hash as an unsigned 64-bit int (vLLM's int form); null for clear/reset |
| ``block_idx`` | index of the block within its event (0 = first) |
| ``parent`` | hash of the block before it: the previous block of the event, or ``parent_block_hash`` |
| ``event_root`` | the event's first block when the event starts a prefix (``parent_block_hash`` null), else null |
| ``block_size`` | tokens per block (stores; 0 in placeholders) |
| ``reason`` | Reset reason (reset rows) |

Every figure of the report is timed by the record time (:data:`TIME`): the stage that wrote the record
(the streams worker) stamps it, the residency view times its records the same way, and ``--since`` /
``--until`` select by it. An engine's clock can be wrong by any amount (a host without NTP, a replayed
trace); its ``ts`` is kept as a column and compared with the record time (``clock_skew_s``), never used
to place an event in time.

Flattening one decoded record into rows is the only per-record Python here (it is the decoding);
everything computed over the rows is polars (:mod:`kvbus.analytics.metrics`).
"""
from __future__ import annotations

from typing import Any, Iterable

import polars as pl

from kvbus.analytics.reader import Record
from kvbus.schemas import tiers
from kvbus.schemas.topics import Topics

TIME = "record_ts"
"""The column the report times events by: the Kafka record time, seconds since the Unix epoch."""

KINDS = pl.Enum(["store", "remove", "clear", "reset"])
"""The ``kind`` column's values."""

_KIND = {"kvbus.BlockStored": "store", "kvbus.BlockRemoved": "remove", "kvbus.AllBlocksCleared": "clear",
         "kvbus.Reset": "reset"}

_EVENT_SCHEMA = {
    "topic": pl.String, "partition": pl.Int32, "offset": pl.Int64, "track": pl.String, "record_ts": pl.Float64,
    "replica": pl.String, "dp_rank": pl.Int32, "epoch": pl.Int64, "seq": pl.Int64, "index": pl.Int32,
    "ts": pl.Float64, "kind": pl.String, "medium": pl.String, "ownership": pl.String, "group_idx": pl.Int32,
    "hashes": pl.List(pl.Binary), "parent_hash": pl.Binary, "block_size": pl.Int32, "reason": pl.String,
}


def utc(seconds: pl.Expr, unit: str = "ms") -> pl.Expr:
    """Seconds since the Unix epoch as a UTC datetime of ``unit`` (``ms``, ``us``), rounded to it."""
    scale = {"ms": 1e3, "us": 1e6}[unit]
    return pl.from_epoch((seconds * scale).round().cast(pl.Int64), time_unit=unit).dt.replace_time_zone("UTC")


def tier_label(medium: pl.Expr, ownership: pl.Expr, group_idx: pl.Expr) -> pl.Expr:
    """The tier label of each row (``kvbus.schemas.tiers.tier_label``, the sink's rule): computed once per
    distinct (medium, ownership, group) in the batch and mapped back, so the rule is written once."""
    def labels(s: pl.Series) -> pl.Series:
        keys = s.unique().to_list()
        names = [None if k is None else tiers.tier_label(k["m"], k["o"], k["g"]) for k in keys]
        return s.replace_strict(pl.Series(keys, dtype=s.dtype), pl.Series(names, dtype=pl.String),
                                return_dtype=pl.String)

    return pl.struct(m=medium, o=ownership, g=group_idx).map_batches(labels, return_dtype=pl.String)


def _plain(v: Any) -> Any:
    """A union branch of a named non-record type (``["null", "kvbus.BlockHash"]``) comes from the
    deserializer as ``(type name, value)`` when it returns record names: the value."""
    return v[1] if isinstance(v, tuple) else v


def event_values(rec: Record, topics: Topics) -> list[dict[str, Any]]:
    """The consolidated events a decoded block-topic record holds, each as the value of a ``kvbus.BlockEvent``
    (the dict a plain Avro reader returns for one): on a layout 1 topic the value itself; on a layout 2
    topic (:meth:`Topics.is_packed`) one per entry of its ``BlockEvents`` value, in order: the record's
    fields (``replica``, ``dp_rank``, ``epoch``, ``seq``, ``ts``, ``model``) with the entry's ``index`` and
    ``event`` (what :meth:`kvbus.schemas.events.BlockEvents.unpacked` does with decoded structs). Empty for
    a record that was not decoded or is not a block record."""
    v = rec.value
    if not isinstance(v, dict):
        return []
    if topics.is_packed(rec.topic):
        shared = {k: x for k, x in v.items() if k != "events"}
        return [{**shared, **entry} for entry in v.get("events") or ()]
    return [v] if "event" in v else []


def _event_row(rec: Record, value: dict, track: str) -> dict[str, Any]:
    """The row of one event (``value``: a BlockEvent value, :func:`event_values`) of ``rec``."""
    name, ev = value["event"]
    kind = _KIND[name]
    return {
        "topic": rec.topic, "partition": rec.partition, "offset": rec.offset, "track": track,
        "record_ts": rec.timestamp,
        "replica": value["replica"], "dp_rank": value.get("dp_rank", 0), "epoch": value["epoch"],
        "seq": value["seq"], "index": value["index"], "ts": value["ts"], "kind": kind,
        "medium": ev.get("medium"), "ownership": ev.get("ownership"), "group_idx": ev.get("group_idx"),
        "hashes": ev.get("block_hashes") if kind in ("store", "remove") else None,
        "parent_hash": _plain(ev.get("parent_block_hash")), "block_size": ev.get("block_size"),
        "reason": ev.get("reason"),
    }


def block_events(records: Iterable[Record], topics: Topics) -> pl.DataFrame:
    """The block-events table (module doc) of the records of ``topics``' block topics, both layouts;
    records that are not decoded block records are left out."""
    rows = [_event_row(r, v, topics.track(r.topic)) for r in records for v in event_values(r, topics)]
    ev = pl.DataFrame(rows, schema=_EVENT_SCHEMA, orient="row")
    return explode_blocks(ev)


def explode_blocks(ev: pl.DataFrame) -> pl.DataFrame:
    """One row per block of each event (``hashes`` exploded), clear/reset rows kept with a null block."""
    ev = ev.with_columns(
        pl.col("hashes").fill_null(pl.lit([None], dtype=pl.List(pl.Binary))),
    ).with_columns(
        pl.int_ranges(0, pl.col("hashes").list.len()).alias("block_idx"),
        pl.concat_list([pl.col("parent_hash"), pl.col("hashes").list.head(pl.col("hashes").list.len() - 1)])
        .alias("parents"),
    )
    out = ev.explode(["hashes", "block_idx", "parents"])
    u64 = lambda c: pl.col(c).bin.reinterpret(dtype=pl.UInt64, endianness="big")  # noqa: E731
    return out.select(
        "topic", "partition", "offset", "track",
        utc(pl.col("record_ts")).alias("record_time"), "record_ts",
        pl.concat_str([pl.col("replica"), pl.lit("#"), pl.col("dp_rank").cast(pl.String)]).alias("holder"),
        "replica", "dp_rank", "epoch", "seq", "index",
        utc(pl.col("ts"), "us").alias("time"), "ts", (pl.col("ts") - pl.col("record_ts")).alias("clock_skew_s"),
        pl.col("kind").cast(KINDS), "medium", "ownership", "group_idx",
        pl.when(pl.col("kind").is_in(["store", "remove"]))
        .then(tier_label(pl.col("medium"), pl.col("ownership"), pl.col("group_idx"))).alias("tier"),
        u64("hashes").alias("block"), pl.col("block_idx").cast(pl.Int32),
        u64("parents").alias("parent"),
        pl.when(pl.col("parent_hash").is_null() & (pl.col("kind") == "store"))
        .then(u64("hashes").first().over("topic", "partition", "offset", "index")).alias("event_root"),
        "block_size", "reason",
    )


def incomplete_table(records: Iterable[Record]) -> pl.DataFrame:
    """``kvbus.incomplete`` as rows: holder, position, workers, reported, missing, the event's kind
    and how many blocks it named."""
    rows = []
    for r in records:
        v = r.value
        if not isinstance(v, dict) or "missing" not in v:
            continue
        name, ev = v["event"]
        rows.append({"record_ts": r.timestamp, "holder": f"{v['replica']}#{v.get('dp_rank', 0)}",
                     "epoch": v["epoch"], "seq": v["seq"], "index": v["index"], "workers": v["workers"],
                     "reported": v["reported"], "missing": v["missing"], "kind": _KIND[name],
                     "blocks": len(ev.get("block_hashes") or ())})
    return pl.DataFrame(rows, schema={"record_ts": pl.Float64, "holder": pl.String, "epoch": pl.Int64,
                                      "seq": pl.Int64, "index": pl.Int32, "workers": pl.Int32,
                                      "reported": pl.List(pl.Int32), "missing": pl.List(pl.Int32),
                                      "kind": pl.String, "blocks": pl.Int32}, orient="row")


def dead_letter_table(records: Iterable[Record]) -> pl.DataFrame:
    """``kvbus.dlq`` as rows: stage, source, reason, ``reason_kind`` (the reason up to its first
    ``:``, e.g. the exception type), payload bytes, time."""
    rows = [{"stage": v["stage"], "source": v["source"], "reason": v["reason"], "ts": v["ts"],
             "payload_bytes": sum(len(p) for p in v["payload"])}
            for v in (r.value for r in records) if isinstance(v, dict) and "stage" in v]
    df = pl.DataFrame(rows, schema={"stage": pl.String, "source": pl.String, "reason": pl.String,
                                    "ts": pl.Float64, "payload_bytes": pl.Int64}, orient="row")
    return df.with_columns(pl.col("reason").str.split(":").list.first().str.strip_chars().alias("reason_kind"))


def raw_table(records: Iterable[Record]) -> pl.DataFrame:
    """``kvbus.raw`` as one row per record (an engine batch or part of one): holder, worker rank and
    count, engine, epoch, seq, first_index, ts, events per kind."""
    rows = []
    for r in records:
        v = r.value
        if not isinstance(v, dict) or "events" not in v:
            continue
        kinds = [_KIND[name] for name, _ in v["events"]]
        rows.append({"holder": f"{v['replica']}#{v.get('dp_rank', 0)}", "worker_rank": v.get("worker_rank", 0),
                     "workers": v.get("workers", 1), "engine": v.get("engine", ""), "epoch": v.get("epoch", 0),
                     "seq": v["seq"], "first_index": v.get("first_index", 0), "ts": v["ts"],
                     "events": len(kinds), "stores": kinds.count("store"), "removes": kinds.count("remove"),
                     "clears": kinds.count("clear"), "resets": kinds.count("reset")})
    return pl.DataFrame(rows, schema={"holder": pl.String, "worker_rank": pl.Int32, "workers": pl.Int32,
                                      "engine": pl.String, "epoch": pl.Int64, "seq": pl.Int64,
                                      "first_index": pl.Int32, "ts": pl.Float64, "events": pl.Int32,
                                      "stores": pl.Int32, "removes": pl.Int32, "clears": pl.Int32,
                                      "resets": pl.Int32}, orient="row")
