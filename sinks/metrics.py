"""Prometheus metrics of the sink (``kvbus_sink_*``), in a registry of their own."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvbus.sinks.view.store import ApplyResult


class SinkMetrics:
    """The sink's counters and gauges. ``rate(kvbus_sink_events_applied_total[1m])`` is applied/s."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.records = Counter("kvbus_sink_records", "Kafka records read", registry=r)
        self.applied = Counter("kvbus_sink_events_applied", "Events applied to the view", registry=r)
        self.duplicates = Counter("kvbus_sink_duplicates_skipped",
                                  "Events skipped as already applied (redelivery, older than a reset)", registry=r)
        self.resets = Counter("kvbus_sink_resets", "Reset markers applied", registry=r)
        self.clears = Counter("kvbus_sink_clears", "AllBlocksCleared applied", registry=r)
        self.dead_letters = Counter("kvbus_sink_dead_letters", "Records sent to the dead-letter topic",
                                    ["reason"], registry=r)
        self.expired = Counter("kvbus_sink_expired_holders", "Holders expired for staleness", registry=r)
        self.stale = Gauge("kvbus_sink_stale_holders", "Holders currently listed as stale", registry=r)
        self.entries = Gauge("kvbus_sink_view_entries", "(holder, block, tier) entries in the view", registry=r)
        self.blocks = Gauge("kvbus_sink_view_blocks",
                            "Distinct block hashes in the view (a sharded view: summed over shards)", registry=r)
        self.holders = Gauge("kvbus_sink_view_holders", "Live holders (seen within the stale window)", registry=r)
        self.lag = Gauge("kvbus_sink_partition_lag",
                         "Block-topic records not yet read, per assigned partition (last fetch's high watermark "
                         "minus the position)", ["topic", "partition"], registry=r)
        self.apply_seconds = Histogram(
            "kvbus_sink_apply_seconds", "Latency of one batch write to Redis",
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5), registry=r)

        self.resyncs = Counter("kvbus_sink_resyncs",
                               "Times the sink re-read the block topics from the view's stored offsets "
                               "(Redis failure or restart, view rebuilt)", registry=r)
        self.rebuilding = Gauge("kvbus_sink_view_rebuilding",
                                "1 while this sink rebuilds the view or replays after a rebuild", registry=r)
        self.rebuilds = Counter("kvbus_sink_view_rebuilds", "Views rebuilt from a snapshot by this sink", registry=r)
        self.rebuild_seconds = Gauge("kvbus_sink_view_rebuild_seconds",
                                     "Seconds the last rebuild took, restore and replay", registry=r)
        self.redis_full = Gauge("kvbus_sink_redis_oom",
                                "1 while Redis refuses the view's writes for lack of memory (OOM at maxmemory under "
                                "noeviction): the sink stops applying, loses nothing, goes on once Redis has memory",
                                registry=r)
        self.redis_full_refusals = Counter("kvbus_sink_redis_oom_refusals",
                                           "Batches Redis refused for lack of memory (read again later)", registry=r)
        self.evicted_keys = Counter("kvbus_sink_redis_evicted_keys",
                                    "Keys Redis evicted while this sink wrote the view (maxmemory-policy is not "
                                    "noeviction): each time, the view is rebuilt", registry=r)
        self.log_replaced = Counter("kvbus_sink_log_replaced",
                                    "Times a block partition's log ended before the view's stored offset (the topic "
                                    "was recreated or its log truncated): each time, the view is rebuilt", registry=r)
        self.snapshots = Counter("kvbus_sink_snapshots", "Snapshots of the view written to Kafka", registry=r)
        self.snapshot_seconds = Gauge("kvbus_sink_snapshot_seconds", "Seconds the last snapshot took", registry=r)
        self.snapshot_time = Gauge("kvbus_sink_snapshot_timestamp_seconds",
                                   "When the last snapshot began (epoch s): alert when it gets old", registry=r)

    def snapshot_taken(self, seconds: float, began: float) -> None:
        """Count one snapshot written."""
        self.snapshots.inc()
        self.snapshot_seconds.set(seconds)
        self.snapshot_time.set(began)

    def observe(self, res: ApplyResult) -> None:
        """Count what one apply did."""
        self.applied.inc(res.applied)
        self.duplicates.inc(res.skipped)
        self.resets.inc(res.resets)
        self.clears.inc(res.clears)

    def set_view(self, size: dict[str, int], stale: int) -> None:
        """Update the view-size gauges."""
        self.entries.set(size["entries"])
        self.blocks.set(size["blocks"])
        self.holders.set(size["holders"])
        self.stale.set(stale)
