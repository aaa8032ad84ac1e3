"""Apache Flink SQL (PyFlink from PyPI, the Kafka SQL connector and the avro-confluent format from
Maven Central) reads the block topics of both layouts (kvbus.blocks and its tier topics: a BlockEvent
per event; kvbus.blocks-packed and its tier topics: BlockEvents records of several events, unnested)
and kvbus.raw through the registry's Confluent-compatible API, and analytics/flink/stores_per_minute.sql
gives the per-replica counts of events and blocks the records hold per minute of Kafka record time (the
engines' clocks, here a year behind, do not place them); they also equal ``kvbus report``'s per-minute
series of the same topics.

First run on a machine: PyFlink's venv (~300 MB from PyPI) and the two jars are made in
``$KVBUS_STATE_DIR/flink`` (infra/flink.py); later runs reuse them.
"""
from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import replace
from datetime import datetime, timezone

import polars as pl
import pytest
from confluent_kafka import Producer

from kvbus.analytics.cli import build_report, topics_to_read
from kvbus.analytics.flink_job import DEFAULT_SQL, JOB_TIMEOUT_S, run
from kvbus.analytics.reader import read
from kvbus.analytics.timerange import TimeRange
from kvbus.runtime.settings import Settings
from kvbus.schemas.events import (
    AllBlocksCleared,
    BlockEvent,
    BlockEvents,
    BlockRemoved,
    BlockStored,
    EventBatch,
    PositionedEvent,
    Reset,
    holder_key,
)
from kvbus.schemas.serde import RecordSerde, registry_client

pytestmark = [pytest.mark.integration, pytest.mark.analytics]

T0 = float(int(time.time()) // 60 * 60 - 3600)
"""Record times from here: a whole minute an hour ago (records older than the topics' 7-day retention
would be deleted by the broker's next retention check)."""
ENGINE_CLOCK = -365 * 86400.0
"""The engines' ``ts`` is a year behind the record times."""


def minute(m: int) -> str:
    return datetime.fromtimestamp(T0 + 60 * m, timezone.utc).replace(tzinfo=None).isoformat()


def hashes(first: int, n: int) -> list[bytes]:
    return [(first + i).to_bytes(8, "big") for i in range(n)]


# (replica, minute, second, topic suffix ("" or "kvcr"), event)
HISTORY = [
    ("replica-0", 0, 1, "", BlockStored(block_hashes=hashes(1, 4), block_size=16, medium="GPU")),
    ("replica-0", 0, 2, "", BlockStored(block_hashes=hashes(5, 2), parent_block_hash=hashes(4, 1)[0],
                                        block_size=16, medium="GPU")),
    ("replica-0", 0, 3, "kvcr", BlockStored(block_hashes=hashes(1, 3), block_size=16, medium="CPU", ownership="kvcr")),
    ("replica-0", 1, 5, "", BlockRemoved(block_hashes=hashes(1, 2), medium="GPU")),
    ("replica-0", 1, 6, "", AllBlocksCleared()),
    ("replica-1", 0, 10, "", BlockStored(block_hashes=hashes(1, 4), block_size=16, medium="GPU")),
    ("replica-1", 2, 0, "", BlockRemoved(block_hashes=hashes(3, 1), medium="GPU")),
    ("replica-1", 2, 1, "", Reset(reason="engine-restart")),
    ("replica-1", 2, 2, "kvcr", Reset(reason="engine-restart")),
    ("replica-1", 2, 3, "kvcr", BlockStored(block_hashes=hashes(9, 5), block_size=16, medium="CPU", ownership="kvcr")),
]


# (replica, minute, second, topic suffix, events): BlockEvents records (block layout 2), several events each;
# replica-0's minute 1 has events of both layouts
PACKED = [
    ("replica-2", 0, 4, "", [BlockStored(block_hashes=hashes(1, 4), block_size=16, medium="GPU"),
                             BlockStored(block_hashes=hashes(20, 2), block_size=16, medium="GPU"),
                             BlockRemoved(block_hashes=hashes(1, 1), medium="GPU")]),
    ("replica-2", 0, 4, "kvcr", [BlockStored(block_hashes=hashes(1, 2), block_size=16, medium="CPU",
                                             ownership="kvcr")]),
    ("replica-2", 1, 7, "", [AllBlocksCleared(), BlockStored(block_hashes=hashes(30, 3), block_size=16, medium="GPU"),
                             BlockRemoved(block_hashes=hashes(30, 2), medium="GPU")]),
    ("replica-0", 1, 30, "", [BlockStored(block_hashes=hashes(40, 2), block_size=16, medium="GPU"),
                              BlockRemoved(block_hashes=hashes(40, 1), medium="GPU")]),
    ("replica-2", 2, 8, "kvcr", [Reset(reason="engine-restart")]),
]


def expected_blocks() -> dict[tuple[str, str], dict[str, int]]:
    out: dict[tuple[str, str], dict[str, int]] = defaultdict(lambda: defaultdict(int))
    events = [(replica, m, e) for replica, m, _, _, e in HISTORY]
    events += [(replica, m, e) for replica, m, _, _, es in PACKED for e in es]
    for replica, m, e in events:
        row = out[(replica, minute(m))]
        row.setdefault("stored_blocks", 0), row.setdefault("removed_blocks", 0)
        if isinstance(e, BlockStored):
            row["stored_blocks"] += len(e.block_hashes)
            row["store_events"] += 1
        elif isinstance(e, BlockRemoved):
            row["removed_blocks"] += len(e.block_hashes)
            row["remove_events"] += 1
        elif isinstance(e, AllBlocksCleared):
            row["clears"] += 1
    return {k: {c: v.get(c, 0) for c in ("stored_blocks", "removed_blocks", "store_events", "remove_events", "clears")}
            for k, v in out.items()}


RAW = [  # (replica, worker, minute, second, events): two workers' reports of replica-0
    ("replica-0", 0, 0, 1, [BlockStored(block_hashes=hashes(1, 4), block_size=16, medium="GPU")]),
    ("replica-0", 1, 0, 1, [BlockStored(block_hashes=hashes(1, 4), block_size=16, medium="GPU")]),
    ("replica-0", 0, 1, 5, [BlockRemoved(block_hashes=hashes(1, 2), medium="GPU"), AllBlocksCleared()]),
    ("replica-0", 1, 1, 5, [BlockRemoved(block_hashes=hashes(1, 2), medium="GPU"), AllBlocksCleared()]),
    ("replica-0", 0, 1, 9, [Reset(reason="bridge-start")]),
]


@pytest.fixture
def topics_with_history(stack: Settings, unique_topics):
    from kvbus.infra.dev_topics import ensure_topics

    settings = replace(stack, topics=unique_topics)
    tier = unique_topics.for_ownership("kvcr")
    packed_tier = unique_topics.for_ownership("kvcr", packed=True)
    ensure_topics(settings.bootstrap, [tier, unique_topics.packed, packed_tier], settings.partitions, 1)
    serde = RecordSerde(registry_client(settings.registry_url), "BlockEvent")
    p = Producer({"bootstrap.servers": settings.bootstrap, "enable.idempotence": True})
    for seq, (replica, m, s, suffix, e) in enumerate(HISTORY):
        topic = tier if suffix else unique_topics.blocks
        at = T0 + 60 * m + s
        value = BlockEvent(replica=replica, epoch=1, seq=seq, index=0, ts=at + ENGINE_CLOCK, event=e)
        p.produce(topic, serde.dumps(value, topic), holder_key(replica, 0).encode(), timestamp=int(at * 1000))
    packed_serde = RecordSerde(registry_client(settings.registry_url), "BlockEvents")
    for seq, (replica, m, s, suffix, events) in enumerate(PACKED, start=len(HISTORY)):
        topic = packed_tier if suffix else unique_topics.packed
        at = T0 + 60 * m + s
        packed = BlockEvents(replica=replica, epoch=1, seq=seq, ts=at + ENGINE_CLOCK,
                             events=[PositionedEvent(index=i, event=e) for i, e in enumerate(events)])
        p.produce(topic, packed_serde.dumps(packed, topic), holder_key(replica, 0).encode(), timestamp=int(at * 1000))
    raw_serde = RecordSerde(registry_client(settings.registry_url), "EventBatch")
    for seq, (replica, worker, m, s, events) in enumerate(RAW):
        at = T0 + 60 * m + s
        batch = EventBatch(replica=replica, worker_rank=worker, workers=2, epoch=1, seq=seq, ts=at + ENGINE_CLOCK,
                           events=events)
        p.produce(unique_topics.raw, raw_serde.dumps(batch, unique_topics.raw), holder_key(replica, 0).encode(),
                  timestamp=int(at * 1000))
    assert p.flush(30) == 0
    return settings


FIRST_RUN_INSTALL_S = 600.0
"""Budget for making PyFlink's venv (~300 MB from PyPI) and the connector jars on a machine's first run."""


@pytest.mark.timeout(FIRST_RUN_INSTALL_S + JOB_TIMEOUT_S + 60)  # the job's own bound gives up first, with its log
def test_flink_sql_counts_stores_and_removes_per_replica_and_minute(topics_with_history, tmp_path) -> None:
    from kvbus.infra.flink import ensure

    settings = topics_with_history
    runtime = ensure()
    rows = run(DEFAULT_SQL, settings, runtime.python, runtime.jars, tmp_path / "flink")
    blocks = {(r["row"]["replica"], r["row"]["minute"]): {k: r["row"][k] for k in
              ("stored_blocks", "removed_blocks", "store_events", "remove_events", "clears")}
              for r in rows if r["query"] == "stores_per_minute"}
    assert blocks == expected_blocks()
    raw = {(r["row"]["replica"], r["row"]["worker_rank"], r["row"]["minute"]): (r["row"]["records"], r["row"]["events"])
           for r in rows if r["query"] == "raw_per_minute"}
    assert raw == {("replica-0", 0, minute(0)): (1, 1), ("replica-0", 1, minute(0)): (1, 1),
                   ("replica-0", 0, minute(1)): (2, 3), ("replica-0", 1, minute(1)): (1, 2)}

    # the same figures from kvbus report's per-minute series (summed over tiers)
    assert {("replica-2", minute(0)), ("replica-2", minute(1))} <= set(blocks)  # packed records were read
    records = list(read(settings, topics_to_read(settings, raw=False), TimeRange()))
    series = build_report(settings, records, raw=False).series.group_by("holder", "minute").agg(
        pl.col("stores", "removes").sum())
    from_report = {(r["holder"].removesuffix("#0"), r["minute"].replace(tzinfo=None).isoformat()):
                   (r["stores"], r["removes"]) for r in series.iter_rows(named=True) if r["stores"] or r["removes"]}
    assert from_report == {k: (v["stored_blocks"], v["removed_blocks"]) for k, v in blocks.items()
                           if v["stored_blocks"] or v["removed_blocks"]}
