"""One snapshot of the pipeline: every metrics endpoint, Kafka and the view, read in parallel.

:meth:`Collector.collect` returns a JSON-ready dict (what ``kvbus top --once --json`` prints and what
the screen shows). Rates (``per_s``) and latency quantiles are over the time since the previous
collect of the same source, so the first snapshot has them as null. Keys:

- ``time``: epoch seconds of the snapshot; ``interval_s``: the configured refresh.
- ``flow``: ``in`` (events the bridges had acknowledged by Kafka), ``consolidated`` (the workers'
  consolidated and passed-through events), ``applied`` (events the sinks applied to the view), each
  ``{"total", "per_s"}`` summed over the processes that answered (null when none did).
- ``kafka``: :meth:`kvbus.top.sources.KafkaSource.read`, each hop with ``produced_per_s`` and
  ``consumed_per_s`` (records/s into its topics and committed by its group); or ``{"error"}``.
- ``freshness``: per hop, p50/p99 in ms and the observations behind them, from the processes'
  latency histograms (bridge produce -> ack, worker batch, sink apply to Redis).
- ``bridges``, ``workers``, ``sinks``: one entry per endpoint (:func:`process_entry`).
- ``incomplete``: the workers' incomplete events, total and per_s per reason, and ``share``:
  incomplete/s over TP-consolidated events/s in the interval (pass-through events of single-worker
  replicas cannot be incomplete and are not counted; null when nothing was consolidated), the
  ratio ``KvbusIncompleteShareHigh`` alerts on.
- ``dead_letters``: ``rows`` of ``{"stage", "reason", "total", "per_s"}`` from the processes' counters
  (a bridge's dead letters have no reason label: ``"-"``) and ``topic``: records in the dead-letter topic.
- ``view``: :meth:`kvbus.top.sources.ViewSource.read` plus ``url`` and ``prefix``; or ``{"error"}``.

A source that cannot be read has ``"error": "unreachable: <what> (<why>)"`` and nothing else is lost.
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from kvbus.runtime.security import redact_url
from kvbus.runtime.settings import Settings
from kvbus.top.metrics import ROLES, Role, Samples, describe_error, fetch, quantile
from kvbus.top.sources import KafkaSource, ViewSource
from kvbus.top.top_config import TopConfig

Prev = tuple[float, Samples]
"""(monotonic time, samples) of an endpoint's previous good scrape."""

LATENCY_HOPS = (("bridge", "delivery", "bridge: produce -> Kafka ack"),
                ("worker", "batch", "worker: one batch"),
                ("sink", "apply", "sink: one batch -> Redis"))
"""(role, histogram field, label) of the freshness panel's rows, in pipeline order."""


def _rate(now: float, before: float | None, dt: float | None) -> float | None:
    """Growth per second; None without a previous value, or when the counter went back (a restart)."""
    if before is None or not dt or now < before:
        return None
    return (now - before) / dt


def process_entry(role: Role, endpoint: str, got: Samples | BaseException, prev: Prev | None, t: float) -> dict:
    """One process's panel row: ``{"endpoint", "up", "error", "counters": {field: {"total", "per_s"}},
    "labelled": {field: {label value: {"total", "per_s"}}}, "gauges": {field: value},
    "labelled_gauges": {field: {label value: value}}, "latency": {field: {"p50_ms", "p99_ms",
    "observations"}}}``, latency over the time since ``prev``. While collecting, ``_buckets`` holds each
    histogram's cumulative bucket growth since ``prev`` (empty without one) for :func:`latency`."""
    if isinstance(got, BaseException):
        return {"endpoint": endpoint, "up": False, "error": f"unreachable: {endpoint} ({describe_error(got)})"}
    before, dt = (prev[1], t - prev[0]) if prev else (None, None)
    counters = {f: {"total": got.total(n), "per_s": _rate(got.total(n), before.total(n) if before else None, dt)}
                for f, n in role.counters.items()}
    labelled = {}
    for f, (n, label) in role.labelled.items():
        old = before.by_label(n, label) if before else {}
        labelled[f] = {k: {"total": v, "per_s": _rate(v, old.get(k, 0.0) if before else None, dt)}
                       for k, v in sorted(got.by_label(n, label).items())}
    histograms = {}
    for f, n in role.histograms.items():
        if before is not None:
            now_b, old_b = got.buckets(n), before.buckets(n)
            grown = {b: c - old_b.get(b, 0.0) for b, c in now_b.items()}
            histograms[f] = grown if min(grown.values(), default=0.0) >= 0 else {}  # a restart: no interval
    return {
        "endpoint": endpoint, "up": True, "error": None, "counters": counters, "labelled": labelled,
        "gauges": {f: got.total(n) for f, n in role.gauges.items()},
        "labelled_gauges": {f: dict(sorted(got.by_label(n, label).items()))
                            for f, (n, label) in role.labelled_gauges.items()},
        "latency": {f: latency([{"_buckets": histograms}], f) for f in role.histograms},
        "_buckets": histograms,
    }


def _sum(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def role_counter(entries: list[dict], *fields: str) -> dict[str, float | None]:
    """``{"total", "per_s"}`` of counter ``fields`` added up over the processes that answered."""
    up = [e for e in entries if e["up"]]
    if not up:
        return {"total": None, "per_s": None}
    return {"total": sum(e["counters"][f]["total"] for e in up for f in fields),
            "per_s": _sum([e["counters"][f]["per_s"] for e in up for f in fields])}


def role_labelled(entries: list[dict], field: str) -> dict[str, dict[str, float | None]]:
    """``{label value: {"total", "per_s"}}`` of labelled counter ``field`` over the processes that answered."""
    out: dict[str, dict[str, Any]] = {}
    for e in entries:
        if not e["up"]:
            continue
        for k, v in e["labelled"][field].items():
            acc = out.setdefault(k, {"total": 0.0, "per_s": None})
            acc["total"] += v["total"]
            acc["per_s"] = _sum([acc["per_s"], v["per_s"]])
    return dict(sorted(out.items()))


def latency(entries: list[dict], field: str) -> dict[str, float | None]:
    """``{"p50_ms", "p99_ms", "observations"}`` of histogram ``field`` over the interval, all processes
    of a role merged; nulls when nothing was observed in it."""
    merged: dict[float, float] = {}
    for e in entries:
        for b, c in e.get("_buckets", {}).get(field, {}).items():
            merged[b] = merged.get(b, 0.0) + c
    count = max(merged.values(), default=0.0)
    if count <= 0:
        return {"p50_ms": None, "p99_ms": None, "observations": 0}
    ms = {q: quantile(q, merged) for q in (0.5, 0.99)}
    return {"p50_ms": ms[0.5] * 1000, "p99_ms": ms[0.99] * 1000, "observations": int(count)}


class Collector:
    """Reads every source of a :class:`TopConfig` once per :meth:`collect`, keeping what rates need."""

    def __init__(self, cfg: TopConfig, settings: Settings) -> None:
        self.cfg, self.settings = cfg, settings
        self.kafka = KafkaSource(settings, cfg.worker_group, cfg.sink_group, cfg.timeout)
        self.view = ViewSource(settings, cfg.prefix, cfg.timeout)
        self.endpoints = [("bridge", e) for e in cfg.bridges] + [("worker", e) for e in cfg.workers] + \
                         [("sink", e) for e in cfg.sinks]
        self._prev: dict[str, Prev] = {}
        self._prev_kafka: tuple[float, dict] | None = None
        self._pool = ThreadPoolExecutor(max_workers=min(16, len(self.endpoints) + 2), thread_name_prefix="kvbus-top")

    def _try(self, read: Callable[[], Any]) -> Any:
        try:
            return read()
        except Exception as e:  # noqa: BLE001 - any failure of a source is shown as its panel's error
            return e

    def collect(self) -> dict:
        """One snapshot (module doc)."""
        t = time.monotonic()
        kafka_f = self._pool.submit(self._try, self.kafka.read)
        view_f = self._pool.submit(self._try, self.view.read)
        scraped = list(self._pool.map(lambda re: self._try(lambda: fetch(re[1], self.cfg.timeout)), self.endpoints))
        entries: dict[str, list[dict]] = {"bridge": [], "worker": [], "sink": []}
        for (role, endpoint), got in zip(self.endpoints, scraped):
            entries[role].append(process_entry(ROLES[role], endpoint, got, self._prev.get(endpoint), t))
            if isinstance(got, Samples):
                self._prev[endpoint] = (t, got)
        bridges, workers, sinks = entries["bridge"], entries["worker"], entries["sink"]
        consolidated = role_counter(workers, "consolidated", "passthrough")
        incomplete = role_labelled(workers, "incomplete")
        inc_rate = _sum([v["per_s"] for v in incomplete.values()])
        tp_rate = role_counter(workers, "consolidated")["per_s"]
        kafka = self._kafka(kafka_f.result(), t)
        freshness = [{"hop": label, **latency(entries[role], field)} for role, field, label in LATENCY_HOPS]
        for e in bridges + workers + sinks:
            e.pop("_buckets", None)
        return {
            "time": time.time(),
            "interval_s": self.cfg.interval,
            "flow": {"in": role_counter(bridges, "events_acked"), "consolidated": consolidated,
                     "applied": role_counter(sinks, "events_applied")},
            "kafka": kafka,
            "freshness": freshness,
            "bridges": bridges, "workers": workers, "sinks": sinks,
            "incomplete": {"reasons": incomplete,
                           "share": (inc_rate or 0.0) / tp_rate if tp_rate else None},
            "dead_letters": self._dead_letters(bridges, workers, sinks, kafka),
            "view": self._view(view_f.result()),
        }

    def _kafka(self, got: dict | BaseException, t: float) -> dict:
        if isinstance(got, BaseException):
            return {"error": f"unreachable: Kafka at {self.settings.bootstrap} ({describe_error(got)})"}
        prev, self._prev_kafka = self._prev_kafka, (t, got)
        before = {h["hop"]: h for h in prev[1]["hops"]} if prev else {}
        dt = t - prev[0] if prev else None
        for hop in got["hops"]:
            old = before.get(hop["hop"])
            hop["produced_per_s"] = _rate(hop["end"], old["end"] if old else None, dt)
            hop["consumed_per_s"] = _rate(hop["committed"], old["committed"] if old else None, dt)
        return {"error": None, "bootstrap": self.settings.bootstrap, **got}

    def _dead_letters(self, bridges: list[dict], workers: list[dict], sinks: list[dict], kafka: dict) -> dict:
        rows = []
        if any(b["up"] for b in bridges):
            rows.append({"stage": "bridge", "reason": "-", **role_counter(bridges, "dead_letters")})
        for stage, entries in (("worker", workers), ("sink", sinks)):
            rows += [{"stage": stage, "reason": reason, **v}
                     for reason, v in role_labelled(entries, "dead_letters").items()]
        return {"rows": rows, "topic": kafka.get("dlq")}

    def _view(self, got: dict | BaseException) -> dict:
        where = {"url": redact_url(self.settings.redis_url), "prefix": self.cfg.prefix}
        if isinstance(got, BaseException):
            return {**where, "error": f"unreachable: Redis at {where['url']} ({describe_error(got)})"}
        return {**where, "error": None, **got}

    def close(self) -> None:
        """Stop the threads and close the Kafka clients."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.kafka.close()
