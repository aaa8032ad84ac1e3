"""``kvbus worker``: run one Faust worker of the streams stage.

    kvbus worker [--workdir DIR] [--window SEC] [--metrics-port P] [--app-id ID]
                 [--datadir DIR] [--store URL] [--loglevel LEVEL]

Every flag defaults to its ``KVBUS_STREAMS_*`` variable (see :mod:`kvbus.streams.options`);
Kafka, registry and topic names come from the Settings (``KVBUS_*``). The worker runs in this
process and stops cleanly on SIGTERM/SIGINT. ``python -m kvbus.streams worker -l info`` runs the
same app with options from the environment only.
"""
from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import replace
from pathlib import Path

from kvbus.schemas import logs
from kvbus.schemas.env import PORT, SECONDS, one_of
from kvbus.schemas.security import check_kafka_access
from kvbus.schemas.settings import Settings
from kvbus.streams.options import StreamsOptions

log = logging.getLogger("kvbus.streams")


LOG_LEVEL = one_of("debug", "info", "warning", "error", "critical")
"""The forms of ``--loglevel``."""


def add_worker_args(p: argparse.ArgumentParser) -> None:
    """Add the ``kvbus worker`` options to ``p``."""
    p.add_argument("--workdir", help="directory for the worker's data directory (KVBUS_STREAMS_WORKDIR; default .)")
    p.add_argument("--datadir", help="Faust data directory, one per worker process "
                                     "(KVBUS_STREAMS_DATADIR; default <workdir>/<app-id>-data)")
    p.add_argument("--window", type=SECONDS, help="seconds a partial aggregate waits for the other workers "
                                                "(KVBUS_STREAMS_WINDOW; default 5)")
    p.add_argument("--metrics-port", type=PORT, help="/metrics (Prometheus), /healthz and /readyz port, 0 = off "
                                                    "(KVBUS_STREAMS_METRICS_PORT; default 0)")
    p.add_argument("--app-id", help="Faust app id = consumer group (KVBUS_STREAMS_APP_ID; default kvbus-streams)")
    p.add_argument("--store", help="table store: memory:// or rocksdb:// (KVBUS_STREAMS_STORE; default memory://)")
    p.add_argument("--loglevel", default="info", type=LOG_LEVEL, help="log level (default info; kvbus -v: debug)")


def options_from_args(args: argparse.Namespace) -> StreamsOptions:
    """The StreamsOptions of ``kvbus worker``: its flags over the ``KVBUS_STREAMS_*`` variables."""
    flags = {f: getattr(args, f, None) for f in ("workdir", "datadir", "window", "metrics_port", "app_id", "store")}
    return replace(StreamsOptions.from_env(), **{f: v for f, v in flags.items() if v is not None})


def run_worker(args: argparse.Namespace, settings: Settings) -> int:
    """Run a streams worker until SIGTERM/SIGINT; returns the exit code."""
    from faust.worker import Worker

    from kvbus.streams.agents import build

    options = options_from_args(args)
    app = build(settings, options)  # serves /metrics, /healthz and /readyz from now on
    check_kafka_access(settings.kafka())  # aiokafka would fail with a bare "Unable to bootstrap" traceback
    options.data_dir.mkdir(parents=True, exist_ok=True)
    level = "debug" if getattr(args, "verbose", False) else getattr(args, "loglevel", None) or "info"
    logging.getLogger().setLevel(level.upper())
    log.info("starting streams worker app_id=%s datadir=%s", options.app_id, options.data_dir)
    # Faust logs through the handler kvbus configured (text or KVBUS_LOG_FORMAT=json) instead of
    # its own, without its terminal spinner; in JSON mode it prints no banner either (every line
    # of output is a JSON object).
    worker = Worker(app, loglevel=level, workdir=str(Path(options.workdir).resolve()), override_logging=False,
                    quiet=logs.json_enabled())
    worker.spinner = None
    try:
        worker.execute_from_commandline()
    except SystemExit as exc:
        return int(exc.code or 0)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Standalone entry: ``python -m kvbus.streams.cli [options]``, the same as ``kvbus worker [options]``."""
    from kvbus.cli import main as kvbus_main

    return kvbus_main(["worker", *(sys.argv[1:] if argv is None else argv)])
