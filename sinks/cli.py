"""``kvbus sink``: argparse wiring for the ``kvbus`` command.

    kvbus sink [--group G] [--prefix kvbus:] [--stale-after SEC] [--metrics-port P] [--batch N] ...
                                                    (every flag, its variable and default: docs/configuration.md)
"""
from __future__ import annotations

import argparse
import logging
import signal
import threading

from kvbus.runtime.collector import tune_gc
from kvbus.runtime.env import add_flags, from_flags
from kvbus.runtime.security import check_kafka_access, redact_url
from kvbus.runtime.settings import Settings
from kvbus.sinks.config import SinkConfig

log = logging.getLogger("kvbus.sinks")


# -------------------------------------------------------------------------- sink


def add_sink_args(p: argparse.ArgumentParser) -> None:
    """Options of ``kvbus sink``: the flags of :class:`~kvbus.sinks.config.SinkConfig`, each defaulting to
    its ``KVBUS_SINK_*`` variable."""
    add_flags(p, SinkConfig)


def sink_config(args: argparse.Namespace) -> SinkConfig:
    """The SinkConfig of ``kvbus sink``'s flags."""
    return from_flags(SinkConfig, args)


def check_topics(settings: Settings, config: SinkConfig) -> None:
    """Refuse block topics that retain less than one snapshot interval, warn about the doubtful ones
    (:mod:`kvbus.sinks.retention`); a cluster that does not let this sink read topic configurations is
    warned about only."""
    from confluent_kafka import KafkaException

    from kvbus.sinks.retention import INTERVAL_SETTING, check_retention, retentions

    try:
        found = retentions(settings.kafka(), settings.topics.blocks_pattern())
    except KafkaException as e:
        log.warning("could not read the block topics' retention (%s): make sure they retain records longer than %s",
                    e, INTERVAL_SETTING)
        return
    check_retention(found, config.snapshot_every)


def run_sink(args: argparse.Namespace, settings: Settings) -> int:
    """Run the sink until SIGTERM/SIGINT."""
    from kvbus.runtime.probes import Readiness, serve
    from kvbus.sinks.consumer import SinkConsumer
    from kvbus.sinks.metrics import SinkMetrics
    from kvbus.sinks.view.redis_memory import check_no_eviction
    from kvbus.sinks.view.store_url import open_store

    config = sink_config(args)
    metrics, readiness = SinkMetrics(), Readiness(starting="Kafka")
    if config.metrics_port:  # first: /healthz answers, and /readyz says what the sink waits for
        serve(config.metrics_port, metrics.registry, readiness)
        log.info("metrics on :%d/metrics, probes on /healthz and /readyz", config.metrics_port)
    check_kafka_access(settings.kafka())  # refused credentials or protocol: exit 2 naming the setting
    # a redis+cluster:// URL: the sharded view
    store = open_store(settings.redis_url, config.prefix, client_kwargs=settings.redis_kwargs())
    check_no_eviction(store.servers())  # a Redis that evicts keys would delete parts of the view: exit 2
    check_topics(settings, config)  # retention shorter than the snapshot interval: exit 2 naming both
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    sink = SinkConsumer(settings, store, config, metrics=metrics)
    probe_view = open_store(settings.redis_url, config.prefix, load=False, client_kwargs=settings.redis_kwargs())
    readiness.add(lambda: sink.not_ready(probe_view))
    readiness.starting = None
    log.info("sink writing the view to %s under prefix %r", redact_url(settings.redis_url), config.prefix)
    snapshotter = None
    if config.snapshot_every > 0:
        from kvbus.sinks.snapshot import Snapshotter

        reader = open_store(settings.redis_url, config.prefix, load=False, client_kwargs=settings.redis_kwargs())
        snapshotter = Snapshotter(settings, reader, config.snapshot_every, metrics)
        snapshotter.start()
    tune_gc()
    try:
        sink.run(stop)
    finally:
        if snapshotter is not None:
            snapshotter.stop.set()
    return 0
