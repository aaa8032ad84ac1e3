"""What ``kvbus top`` watches: metrics endpoints, consumer groups, the view, the refresh.

Each option is declared once on :class:`TopConfig` (its ``KVBUS_TOP_*`` variable, flag and default;
all of them: docs/configuration.md). An endpoint list is comma-separated; each item is ``[host:]port``
or ``[host:]first-last`` (a port range), host ``127.0.0.1`` when omitted. The worker's group is
``KVBUS_STREAMS_APP_ID``, the sink's ``KVBUS_SINK_GROUP``, the view's prefix ``KVBUS_SINK_PREFIX`` (the
stages' own variables, declared there), each also a flag.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from kvbus.demo_layout import REPLICAS, WORKERS, metrics_endpoints
from kvbus.runtime.env import SECONDS, Form, add_flags, from_flags, reuse, setting
from kvbus.sinks.config import SinkConfig
from kvbus.streams.options import StreamsOptions


def parse_endpoints(spec: str) -> tuple[str, ...]:
    """``"9410-9412,host:9401"`` -> ``("127.0.0.1:9410", "127.0.0.1:9411", "127.0.0.1:9412", "host:9401")``.
    Raises ValueError on an item that is not ``[host:]port`` or ``[host:]first-last``."""
    out: list[str] = []
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        host, _, ports = item.rpartition(":")
        host = host or "127.0.0.1"
        first, _, last = ports.partition("-")
        try:
            lo, hi = int(first), int(last or first)
        except ValueError:
            raise ValueError(f"not [host:]port or [host:]first-last: {item!r}") from None
        if not 0 < lo <= hi < 65536:
            raise ValueError(f"bad port range: {item!r}")
        out.extend(f"{host}:{p}" for p in range(lo, hi + 1))
    return tuple(out)


ENDPOINTS: Form[tuple[str, ...]] = Form("[host:]port or [host:]first-last, comma-separated", parse_endpoints)
"""An endpoint list (:func:`parse_endpoints`)."""
DEMO = metrics_endpoints(REPLICAS * WORKERS)
"""The demo's metrics endpoints per role: what ``kvbus top`` watches by default."""


def _endpoints(role: str, what: str) -> Any:
    return setting(f"KVBUS_TOP_{role.upper()}", ENDPOINTS, parse_endpoints(DEMO[role]),
                   f"metrics endpoints of the {what}: [host:]port or [host:]first-last, comma-separated",
                   flag=f"--{role}", shown=f"{DEMO[role]} (the demo's)", metavar="ENDPOINTS")


@dataclass(frozen=True)
class TopConfig:
    """Everything ``kvbus top`` watches besides :class:`kvbus.runtime.settings.Settings` (Kafka, Redis, topics)."""

    bridges: tuple[str, ...] = _endpoints("bridges", "bridges")
    workers: tuple[str, ...] = _endpoints("workers", "Faust workers")
    sinks: tuple[str, ...] = _endpoints("sinks", "sinks")
    worker_group: str = reuse(StreamsOptions, "app_id", flag="--worker-group",
                              doc="the Faust workers' consumer group (their app id): the lag of hop raw -> worker")
    sink_group: str = reuse(SinkConfig, "group", flag="--sink-group",
                            doc="the sinks' consumer group: the lag of hop blocks -> sink")
    prefix: str = reuse(SinkConfig, "prefix", flag="--prefix")
    interval: float = setting("KVBUS_TOP_INTERVAL", SECONDS, 1.0,
                              "seconds between refreshes (and between --once's two samples); rates and latency "
                              "quantiles are over this interval", flag="--interval")
    timeout: float = 2.0
    """Seconds one source (an endpoint, Kafka, Redis) may take before it counts as unreachable."""


def add_top_config_args(p: argparse.ArgumentParser) -> None:
    """The flags of :class:`TopConfig`, each defaulting to its variable (module doc)."""
    add_flags(p, TopConfig)


def top_config(args: argparse.Namespace) -> TopConfig:
    """The TopConfig of ``kvbus top``'s flags (ValueError on a non-positive interval)."""
    if args.interval <= 0:
        raise ValueError("--interval must be positive")
    return from_flags(TopConfig, args, timeout=min(2.0, max(0.5, args.interval)))
