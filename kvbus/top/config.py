"""What ``kvbus top`` watches: metrics endpoints, consumer groups, the view, the refresh.

| variable | default | meaning |
|---|---|---|
| ``KVBUS_TOP_BRIDGES`` | the demo's bridge ports (``127.0.0.1:9410-9412``) | bridges' metrics endpoints |
| ``KVBUS_TOP_WORKERS`` | the demo's worker port (``127.0.0.1:9401``) | Faust workers' metrics endpoints |
| ``KVBUS_TOP_SINKS`` | the demo's sink port (``127.0.0.1:9402``) | sinks' metrics endpoints |
| ``KVBUS_TOP_INTERVAL`` | ``1`` | seconds between refreshes (and between ``--once``'s two samples) |

An endpoint list is comma-separated; each item is ``[host:]port`` or ``[host:]first-last`` (a port
range), host ``127.0.0.1`` when omitted. The worker's group is ``KVBUS_STREAMS_APP_ID``, the sink's
``KVBUS_SINK_GROUP``, the view's prefix ``KVBUS_SINK_PREFIX`` (the stages' own variables), each also a flag.
"""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from kvbus.schemas.env import SECONDS, read


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


def demo_endpoints() -> dict[str, str]:
    """The metrics endpoints ``kvbus demo`` gives its processes with its default options, per role."""
    from kvbus.demo import add_demo_args, metrics_endpoints

    p = argparse.ArgumentParser()
    add_demo_args(p)
    d = p.parse_args([])
    return metrics_endpoints(d.replicas * d.workers)


@dataclass(frozen=True)
class TopConfig:
    """Everything ``kvbus top`` watches besides :class:`kvbus.schemas.settings.Settings` (Kafka, Redis, topics)."""

    bridges: tuple[str, ...]
    """``host:port`` of each bridge's metrics endpoint."""
    workers: tuple[str, ...]
    """``host:port`` of each Faust worker's metrics endpoint."""
    sinks: tuple[str, ...]
    """``host:port`` of each sink's metrics endpoint."""
    worker_group: str
    """Consumer group of the Faust workers (their app id): the lag of hop ``raw -> worker``."""
    sink_group: str
    """Consumer group of the sinks: the lag of hop ``blocks -> sink``."""
    prefix: str
    """Redis key prefix of the residency view."""
    interval: float = 1.0
    """Seconds between refreshes; rates and latency quantiles are over this interval."""
    timeout: float = 2.0
    """Seconds one source (an endpoint, Kafka, Redis) may take before it counts as unreachable."""


def add_top_config_args(p: argparse.ArgumentParser) -> None:
    """The flags of :class:`TopConfig`, each defaulting to its variable (module doc)."""
    from kvbus.sinks.config import SinkConfig
    from kvbus.streams.options import StreamsOptions

    env, demo = os.environ, demo_endpoints()
    for role, what in (("bridges", "bridges"), ("workers", "Faust workers"), ("sinks", "sinks")):
        default = env.get(f"KVBUS_TOP_{role.upper()}", "").strip() or demo[role]
        p.add_argument(f"--{role}", default=default, metavar="ENDPOINTS",
                       help=f"metrics endpoints of the {what}: [host:]port or [host:]first-last, comma-separated "
                            f"(KVBUS_TOP_{role.upper()}; now {default})")
    sink = SinkConfig.from_env()
    worker_group = StreamsOptions.from_env().app_id
    p.add_argument("--worker-group", default=worker_group,
                   help=f"the Faust workers' consumer group (KVBUS_STREAMS_APP_ID; now {worker_group})")
    p.add_argument("--sink-group", default=sink.group,
                   help=f"the sinks' consumer group (KVBUS_SINK_GROUP; now {sink.group})")
    p.add_argument("--prefix", default=sink.prefix,
                   help=f"Redis key prefix of the view (KVBUS_SINK_PREFIX; now {sink.prefix})")
    interval = read(env, "KVBUS_TOP_INTERVAL", SECONDS, 1.0)
    p.add_argument("--interval", type=SECONDS, default=interval,
                   help=f"seconds between refreshes (KVBUS_TOP_INTERVAL; now {interval:g})")


def top_config(args: argparse.Namespace) -> TopConfig:
    """The TopConfig of ``kvbus top``'s flags (ValueError on a bad endpoint list)."""
    if args.interval <= 0:
        raise ValueError("--interval must be positive")
    return TopConfig(bridges=parse_endpoints(args.bridges), workers=parse_endpoints(args.workers),
                     sinks=parse_endpoints(args.sinks), worker_group=args.worker_group, sink_group=args.sink_group,
                     prefix=args.prefix, interval=args.interval, timeout=min(2.0, max(0.5, args.interval)))
