"""Prometheus metrics of ``kvbus serve`` (``kvbus_serve_*``), in a registry of their own, with the
process's own (:func:`kvbus.runtime.allocator.register`).

``rate(kvbus_serve_requests_total{path="/query"}[1m])`` is queries/s;
``histogram_quantile(0.99, rate(kvbus_serve_request_seconds_bucket[5m]))`` the p99 latency.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvbus.runtime import allocator

LATENCY_BUCKETS = (0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
"""Seconds: a lookup takes a fraction of a millisecond inside Redis, a few over HTTP."""

ERROR_KINDS = ("bad_request", "too_large", "not_found", "view_unavailable", "internal")
"""Values of the ``kind`` label of :attr:`ServeMetrics.errors`: a request the API refused (400), a
body over the limit (413), an unknown path or method (404, 405), the view could not be read (503:
Redis down, no function library, another layout), a server fault (500)."""


class ServeMetrics:
    """Requests, their latency, errors and requests in flight, by path (``/query``, ``/query_by_hash``,
    ``/healthz``, ``/readyz``, ``/metrics``; ``other`` for any other path)."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        allocator.register(r)
        self.requests = Counter("kvbus_serve_requests", "HTTP requests answered, by path and status code",
                                ["path", "code"], registry=r)
        self.seconds = Histogram("kvbus_serve_request_seconds",
                                 "Time from a request's arrival to its answer, by path",
                                 ["path"], buckets=LATENCY_BUCKETS, registry=r)
        self.lookup_seconds = Histogram("kvbus_serve_lookup_seconds",
                                        "Time of the lookup alone (hashing, the Redis call, the answer's ranking), "
                                        "including the wait for a lookup thread", buckets=LATENCY_BUCKETS, registry=r)
        self.errors = Counter("kvbus_serve_errors", f"Requests answered with an error, by kind "
                              f"({', '.join(ERROR_KINDS)})", ["path", "kind"], registry=r)
        self.in_flight = Gauge("kvbus_serve_requests_in_flight", "Requests being answered now", registry=r)
        self.instances = Histogram("kvbus_serve_answer_instances", "Instances in a query's answer",
                                   buckets=(0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024), registry=r)
