"""Prometheus metrics of the streams stage (served on ``--metrics-port`` with ``/healthz`` and
``/readyz``: :mod:`kvbus.runtime.probes`).

| metric | type | meaning |
|---|---|---|
| ``kvbus_streams_reports_total`` | counter | worker reports applied (one event of one worker) |
| ``kvbus_streams_duplicates_total`` | counter | reports in redelivered batches, ignored |
| ``kvbus_streams_consolidated_total`` | counter | consolidated events emitted (rate: consolidated/s) |
| ``kvbus_streams_passthrough_total`` | counter | events of single-worker replicas passed through |
| ``kvbus_streams_incomplete_total{reason}`` | counter | Incomplete records: window, cleared, disordered |
| ``kvbus_streams_resets_total{kind}`` | counter | Reset markers: forwarded or coalesced |
| ``kvbus_streams_dropped_by_reset_total`` | counter | partial aggregates dropped by a Reset |
| ``kvbus_streams_dead_letters_total{reason}`` | counter | raw records sent to the DLQ: decode or invariant |
| ``kvbus_streams_offset_gaps_total{outcome}`` | counter | gaps in a raw partition's delivered offsets: reread, gone |
| ``kvbus_streams_pending_aggregates`` | gauge | partial aggregates held by this process |
| ``kvbus_streams_holders`` | gauge | (replica, dp_rank) states held by this process |
| ``kvbus_streams_partition_lag{partition}`` | gauge | raw records not yet processed, per assigned partition |
| ``kvbus_streams_batch_seconds`` | histogram | time to process one batch (decode to state write) |
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvbus.runtime.probes import Readiness, serve
from kvbus.streams.aggregation import Stats


class StreamsMetrics:
    """The stage's metrics in their own registry (served by :meth:`serve`)."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.reports = Counter("kvbus_streams_reports", "Worker reports applied", registry=r)
        self.duplicates = Counter("kvbus_streams_duplicates", "Reports in redelivered batches", registry=r)
        self.consolidated = Counter("kvbus_streams_consolidated", "Consolidated events emitted", registry=r)
        self.passthrough = Counter("kvbus_streams_passthrough", "Single-worker events passed through", registry=r)
        self.incomplete = Counter("kvbus_streams_incomplete", "Incomplete records emitted", ["reason"], registry=r)
        self.resets = Counter("kvbus_streams_resets", "Reset markers", ["kind"], registry=r)
        self.dropped = Counter("kvbus_streams_dropped_by_reset", "Partial aggregates dropped by a Reset", registry=r)
        self.dead_letters = Counter("kvbus_streams_dead_letters", "Raw records sent to the DLQ", ["reason"], registry=r)
        self.offset_gaps = Counter("kvbus_streams_offset_gaps", "Gaps in a raw partition's delivered offsets",
                                   ["outcome"], registry=r)
        self.pending = Gauge("kvbus_streams_pending_aggregates", "Partial aggregates held", registry=r)
        self.holders = Gauge("kvbus_streams_holders", "(replica, dp_rank) states held", registry=r)
        self.lag = Gauge("kvbus_streams_partition_lag", "Raw records not yet processed", ["partition"], registry=r)
        self.batch_seconds = Histogram("kvbus_streams_batch_seconds", "Time to process one batch", registry=r,
                                       buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5))
        self._seen = Stats()

    def serve(self, port: int, readiness: Readiness) -> None:
        """Expose ``/metrics``, ``/healthz`` and ``/readyz`` (``readiness``) on 0.0.0.0:``port``
        (no-op for port 0)."""
        if port:
            serve(port, self.registry, readiness)

    def sync(self, stats: Stats) -> None:
        """Add what ``stats`` counted since the previous sync."""
        s, seen = stats, self._seen
        for name, counter in (
            ("reports", self.reports), ("duplicates", self.duplicates), ("consolidated", self.consolidated),
            ("passthrough", self.passthrough), ("dropped_by_reset", self.dropped),
        ):
            delta = getattr(s, name) - getattr(seen, name)
            if delta:
                counter.inc(delta)
        for name, reason in (("incomplete", "window"), ("cleared", "cleared"), ("disordered", "disordered")):
            delta = getattr(s, name) - getattr(seen, name)
            if delta:
                self.incomplete.labels(reason).inc(delta)
        for name, kind in (("resets", "forwarded"), ("resets_coalesced", "coalesced")):
            delta = getattr(s, name) - getattr(seen, name)
            if delta:
                self.resets.labels(kind).inc(delta)
        self._seen = Stats(**vars(s))
