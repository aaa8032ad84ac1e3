"""Reading one Prometheus endpoint, and the metric names ``kvbus top`` reads from each role.

The names are the stages' public interface (``producers/metrics.py``, ``streams/metrics.py``,
``sinks/metrics.py``); ``tests/test_metric_names.py`` checks every name here against the registries
the processes serve, so a renamed metric fails a test instead of showing an empty column.
"""
from __future__ import annotations

import http.client
import math
import urllib.request
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True)
class Role:
    """The metrics of one kind of process that the console reads; each maps a field name (the key
    in ``--json``) to a sample name."""

    counters: dict[str, str]
    """Counters summed over their labels: field -> ``<name>_total``."""
    labelled: dict[str, tuple[str, str]] = field(default_factory=dict)
    """Counters split by one label: field -> (``<name>_total``, label)."""
    gauges: dict[str, str] = field(default_factory=dict)
    """Gauges summed over their labels: field -> name."""
    labelled_gauges: dict[str, tuple[str, str]] = field(default_factory=dict)
    """Gauges split by one label: field -> (name, label)."""
    histograms: dict[str, str] = field(default_factory=dict)
    """Histograms (seconds): field -> base name (``_bucket``, ``_count`` are read)."""

    def sample_names(self) -> set[str]:
        """Every sample name this role's fields read."""
        names = set(self.counters.values()) | set(self.gauges.values())
        names |= {n for n, _ in self.labelled.values()} | {n for n, _ in self.labelled_gauges.values()}
        names |= {f"{n}_bucket" for n in self.histograms.values()} | {f"{n}_count" for n in self.histograms.values()}
        return names


BRIDGE = Role(
    counters={
        "events_in": "kvbus_bridge_events_in_total",          # engine events decoded
        "events_acked": "kvbus_bridge_events_acked_total",    # events Kafka acknowledged: the pipeline's "in"
        "gaps": "kvbus_bridge_gaps_total",
        "replays": "kvbus_bridge_replays_total",
        "recovered": "kvbus_bridge_recovered_total",
        "resets": "kvbus_bridge_resets_total",
        "engine_restarts": "kvbus_bridge_engine_restarts_total",
        "dead_letters": "kvbus_bridge_dlq_total",
        "delivery_errors": "kvbus_bridge_delivery_errors_total",
    },
    gauges={"backlog": "kvbus_bridge_backlog", "producer_queue": "kvbus_bridge_producer_queue"},
    histograms={"delivery": "kvbus_bridge_delivery_latency_seconds"},
)
WORKER = Role(
    counters={
        "reports": "kvbus_streams_reports_total",
        "consolidated": "kvbus_streams_consolidated_total",
        "passthrough": "kvbus_streams_passthrough_total",
    },
    labelled={
        "incomplete": ("kvbus_streams_incomplete_total", "reason"),
        "dead_letters": ("kvbus_streams_dead_letters_total", "reason"),
    },
    gauges={"pending_aggregates": "kvbus_streams_pending_aggregates", "holders": "kvbus_streams_holders"},
    labelled_gauges={"partition_lag": ("kvbus_streams_partition_lag", "partition")},
    histograms={"batch": "kvbus_streams_batch_seconds"},
)
SINK = Role(
    counters={
        "records": "kvbus_sink_records_total",
        "events_applied": "kvbus_sink_events_applied_total",
        "duplicates_skipped": "kvbus_sink_duplicates_skipped_total",
        "resets": "kvbus_sink_resets_total",
        "clears": "kvbus_sink_clears_total",
        "expired_holders": "kvbus_sink_expired_holders_total",
        "resyncs": "kvbus_sink_resyncs_total",
    },
    labelled={"dead_letters": ("kvbus_sink_dead_letters_total", "reason")},
    gauges={
        "view_entries": "kvbus_sink_view_entries",
        "view_blocks": "kvbus_sink_view_blocks",
        "view_holders": "kvbus_sink_view_holders",
        "stale_holders": "kvbus_sink_stale_holders",
        "view_rebuilding": "kvbus_sink_view_rebuilding",
    },
    histograms={"apply": "kvbus_sink_apply_seconds"},
)
ROLES: dict[str, Role] = {"bridge": BRIDGE, "worker": WORKER, "sink": SINK}
"""Role name -> what the console reads from its processes."""


class Samples:
    """The samples of one scrape: ``(name, labels, value)``."""

    def __init__(self, samples: list[tuple[str, dict[str, str], float]]) -> None:
        self.samples = samples

    def total(self, name: str) -> float:
        """Sum of the samples called ``name`` (0 when there are none)."""
        return sum(v for n, _, v in self.samples if n == name)

    def by_label(self, name: str, label: str) -> dict[str, float]:
        """Samples called ``name`` summed per value of ``label``."""
        out: dict[str, float] = {}
        for n, labels, v in self.samples:
            if n == name:
                key = labels.get(label, "")
                out[key] = out.get(key, 0.0) + v
        return out

    def buckets(self, name: str) -> dict[float, float]:
        """Cumulative counts of histogram ``name`` per upper bound (``le``), summed over other labels."""
        return {float(le): n for le, n in self.by_label(f"{name}_bucket", "le").items()}


def fetch(endpoint: str, timeout: float) -> Samples:
    """Scrape ``http://<endpoint>/metrics``. Raises OSError (refused, timed out) or
    http.client.HTTPException (a response cut short by a dying process) when it cannot."""
    with urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=timeout) as r:
        text = r.read().decode()
    return Samples([(s.name, dict(s.labels), float(s.value))
                    for fam in text_string_to_metric_families(text) for s in fam.samples])


def describe_error(e: BaseException) -> str:
    """A short reason for an unreachable source: ``connection refused``, ``timed out``, ..."""
    reason = getattr(e, "reason", None)
    e = reason if isinstance(reason, BaseException) else e
    if isinstance(e, ConnectionRefusedError):
        return "connection refused"
    if isinstance(e, TimeoutError):
        return "timed out"
    if isinstance(e, http.client.HTTPException):
        return f"bad response ({type(e).__name__})"
    return str(e) or type(e).__name__


def quantile(q: float, buckets: dict[float, float]) -> float | None:
    """The ``q``-quantile (0..1) of observations counted in cumulative ``buckets`` (upper bound ->
    count), interpolated linearly inside a bucket as PromQL's ``histogram_quantile`` does; None when
    there is no observation. A quantile in the ``+Inf`` bucket is the largest finite bound."""
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return None
    rank = q * buckets[bounds[-1]]
    lower_bound, lower_count = 0.0, 0.0
    for b in bounds:
        count = buckets[b]
        if count >= rank:
            if math.isinf(b):
                return lower_bound
            if count == lower_count:
                return b
            return lower_bound + (b - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = b, count
    return lower_bound
