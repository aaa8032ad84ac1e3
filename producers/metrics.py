"""Prometheus metrics of the bridge and the in-process publisher (which counts only splits,
oversized events and dead letters in them).

Each :class:`BridgeMetrics` lives in its own ``CollectorRegistry`` (several bridges
can run in one test process); :meth:`BridgeMetrics.serve` exposes it over HTTP, beside
``/healthz`` and ``/readyz`` (:mod:`kvbus.runtime.probes`).
Metric names start with ``kvbus_bridge_``.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvbus.producers.sequencer import SequencerStats
from kvbus.runtime.probes import Readiness, serve

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


class BridgeMetrics:
    """Counters, gauges and histograms of one bridge (or publisher)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or CollectorRegistry()
        p = "kvbus_bridge_"
        self.batches_in = Counter(p + "batches_in", "Engine batches received (live and replayed)", registry=r)
        self.events_in = Counter(p + "events_in", "Engine events decoded", registry=r)
        self.batches_out = Counter(p + "batches_out", "EventBatch records handed to the producer (incl. reset markers)",
                                   registry=r)
        self.events_out = Counter(p + "events_out", "Events in records handed to the producer", registry=r)
        self.batches_acked = Counter(p + "batches_acked", "EventBatch records acknowledged by Kafka", registry=r)
        self.events_acked = Counter(p + "events_acked", "Events in records acknowledged by Kafka", registry=r)
        self.delivery_errors = Counter(p + "delivery_errors", "Records Kafka failed to take (delivery callback error)",
                                       registry=r)
        self.split_batches = Counter(p + "split_batches",
                                     "Engine batches too large for one record, produced as several", registry=r)
        self.split_parts = Counter(p + "split_parts", "Records produced for split engine batches", registry=r)
        self.oversized_events = Counter(p + "oversized_events", "Events too large for any record on their own: "
                                        "dead-lettered with a truncated payload, not produced", registry=r)
        self.delivery_latency = Histogram(p + "delivery_latency_seconds", "produce() to broker acknowledgement",
                                          buckets=_LATENCY_BUCKETS, registry=r)
        self.gaps = Counter(p + "gaps", "Sequence gaps detected on the live stream", registry=r)
        self.replays = Counter(p + "replays", "Replay requests sent to the engine", registry=r)
        self.replays_incomplete = Counter(p + "replays_incomplete", "Replays that timed out before the end marker",
                                          registry=r)
        self.recovered = Counter(p + "recovered", "Batches recovered through replay", registry=r)
        self.duplicates = Counter(p + "duplicates", "Replayed batches dropped as already produced", registry=r)
        self.resets = Counter(p + "resets", "Reset markers produced", registry=r)
        self.restarts = Counter(p + "engine_restarts", "Engine restarts detected (sequence went back)", registry=r)
        self.lost = Counter(p + "lost_batches", "Sequence numbers declared lost in gap resets", registry=r)
        self.dlq = Counter(p + "dlq", "Inputs sent to the dead-letter topic", registry=r)
        self.unknown_events = Counter(p + "unknown_events", "Events of unknown type skipped by the decoder", registry=r)
        self.shed = Counter(p + "shed_batches",
                            "Live batches not accepted while the backlog was full (recovered by replay or reset)",
                            registry=r)
        self.queue_depth = Gauge(p + "producer_queue", "Messages in librdkafka's queue (not yet acknowledged)",
                                 registry=r)
        self.backlog = Gauge(p + "backlog", "Records held by the bridge because librdkafka's queue is full", registry=r)
        self.backlog_bytes = Gauge(p + "backlog_bytes", "Bytes of the backlog", registry=r)
        self.held = Gauge(p + "held", "Live batches held while a replay runs", registry=r)
        self._seq_seen = SequencerStats()

    def sync_sequencer(self, stats: SequencerStats, seen: SequencerStats | None = None) -> None:
        """Add the sequencer counters' growth since the last call; ``seen``: the counters as last
        added (updated here), one per stream when several share these metrics (default: one of its own)."""
        seen = self._seq_seen if seen is None else seen
        for name, counter in (
            ("gaps", self.gaps), ("replays", self.replays), ("replays_incomplete", self.replays_incomplete),
            ("recovered", self.recovered), ("duplicates", self.duplicates), ("resets", self.resets),
            ("restarts", self.restarts), ("lost", self.lost),
        ):
            delta = getattr(stats, name) - getattr(seen, name)
            if delta:
                counter.inc(delta)
                setattr(seen, name, getattr(stats, name))

    def value(self, name: str) -> float:
        """Current value of a metric by its short name (tests, logs): e.g. ``value("dlq")``."""
        metric = getattr(self, name)
        for family in metric.collect():
            for sample in family.samples:
                if sample.name.endswith("_total") or sample.name == family.name:
                    return sample.value
        return 0.0

    def serve(self, port: int, readiness: Readiness | None = None, addr: str = "0.0.0.0") -> None:
        """Expose the metrics at ``http://addr:port/metrics``, with ``/healthz`` and ``/readyz``
        (``readiness``'s checks; none: always ready)."""
        serve(port, self.registry, readiness or Readiness(), addr)
