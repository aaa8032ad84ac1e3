"""``kvbus worker``: run one Faust worker of the streams stage.

    kvbus worker [--workdir DIR] [--window SEC] [--metrics-port P] [--app-id ID]
                 [--datadir DIR] [--store URL] [--loglevel LEVEL]

Every flag defaults to its ``KVBUS_STREAMS_*`` variable (:mod:`kvbus.streams.options`; all of them:
docs/configuration.md);
Kafka, registry and topic names come from the Settings (``KVBUS_*``). The worker runs in this
process and stops cleanly on SIGTERM/SIGINT. ``python -m kvbus.streams worker -l info`` runs the
same app with options from the environment only.
"""
from __future__ import annotations

import argparse
import logging
from pathlib import Path

from kvbus.runtime import logs
from kvbus.runtime.env import Setting, add_flag, add_flags, from_flags, one_of
from kvbus.runtime.kafka_clients import ensure_topics
from kvbus.runtime.security import check_kafka_access
from kvbus.runtime.settings import Settings
from kvbus.streams.options import StreamsOptions

log = logging.getLogger("kvbus.streams")


LOG_LEVEL = one_of("debug", "info", "warning", "error", "critical")
"""The forms of ``--loglevel``."""
LOG_LEVEL_FLAG = Setting(None, LOG_LEVEL, "info", "log level (kvbus -v: debug)", flag="--loglevel")
"""``--loglevel``: a flag of the worker process only."""


def add_worker_args(p: argparse.ArgumentParser) -> None:
    """Add the ``kvbus worker`` options to ``p``: the flags of :class:`StreamsOptions`, each defaulting to
    its ``KVBUS_STREAMS_*`` variable, and ``--loglevel``."""
    add_flags(p, StreamsOptions)
    add_flag(p, "loglevel", LOG_LEVEL_FLAG)


def options_from_args(args: argparse.Namespace) -> StreamsOptions:
    """The StreamsOptions of ``kvbus worker``: its flags, and the ``KVBUS_STREAMS_*`` variables of the others."""
    return from_flags(StreamsOptions, args)


def run_worker(args: argparse.Namespace, settings: Settings) -> int:
    """Run a streams worker until SIGTERM/SIGINT; returns the exit code."""
    from faust.worker import Worker

    from kvbus.streams.agents import build
    from kvbus.streams.app import changelog_specs

    options = options_from_args(args)
    app = build(settings, options)  # serves /metrics, /healthz and /readyz from now on
    check_kafka_access(settings.kafka())  # aiokafka would fail with a bare "Unable to bootstrap" traceback
    options.data_dir.mkdir(parents=True, exist_ok=True)
    level = "debug" if getattr(args, "verbose", False) else getattr(args, "loglevel", None) or "info"
    logging.getLogger().setLevel(level.upper())
    ensure_topics(settings.kafka(), changelog_specs(app))  # in the consumer's first metadata answer
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
