"""The Faust application of the streams stage: :func:`create_app` (its topics, table and agents are
declared by :func:`kvbus.streams.agents.build`).

Configured by objects (:class:`kvbus.runtime.settings.Settings`, :class:`kvbus.streams.options.StreamsOptions`),
never by the environment at import: ``kvbus worker`` builds them from its flags, ``python -m
streams worker`` from the ``KVBUS_*`` variables.
"""
from __future__ import annotations

from typing import Any

import faust
from faust.sensors import Monitor
from mode.utils.times import want_seconds

from kvbus.runtime.settings import Settings
from kvbus.schemas.topics import TopicSpec
from kvbus.streams import faust_adapter
from kvbus.streams.options import StreamsOptions

CHANGELOG_LINGER = 0.005
"""Seconds Faust's producer (the table changelog only) waits to batch records: without it every
table write became its own produce request (a quarter of the worker's time in profiles)."""


class RecordQuietMonitor(Monitor):
    """Faust's Monitor without its per-record, per-table-write and per-send statistics (they
    feed Faust's web views, off here; kvbus exports its own metrics: :mod:`kvbus.streams.metrics`).
    Offsets, commits and rebalances are still tracked."""

    def on_message_in(self, *args: Any) -> None:
        """Not counted."""

    def on_stream_event_in(self, *args: Any) -> None:
        """Not counted (no per-event state)."""

    def on_stream_event_out(self, *args: Any, **kwargs: Any) -> None:
        """Not counted."""

    def on_message_out(self, *args: Any) -> None:
        """Not counted."""

    def on_table_get(self, *args: Any) -> None:
        """Not counted."""

    def on_table_set(self, *args: Any) -> None:
        """Not counted."""

    def on_table_del(self, *args: Any) -> None:
        """Not counted."""

    def on_send_initiated(self, *args: Any) -> None:
        """Not counted (no per-send state)."""

    def on_send_completed(self, *args: Any) -> None:
        """Not counted."""

MAX_FETCH_BYTES = 8 * 1024**2
"""Bytes per partition one fetch may return (Faust's ``consumer_max_fetch_size``; Faust's default is
1 MiB). aiokafka keeps one fetch in flight per broker, so this bounds how much a worker under a backlog
gets per round trip (why 8 MiB: docs/performance.md, "Tuning values")."""


def heartbeat_interval(session_timeout: float) -> float:
    """Seconds between a worker's group heartbeats for a session of ``session_timeout`` s: a tenth
    of it, at least 0.1 s (a session survives nine lost heartbeats)."""
    return max(0.1, session_timeout / 10)


def broker_url(bootstrap: str, scheme: str = faust_adapter.SCHEME) -> str:
    """Faust broker URL for comma-separated bootstrap servers: ``kvbus://h1:p1;h2:p2``
    (:class:`kvbus.streams.faust_adapter.Transport`: Faust's aiokafka transport, cheaper per fetched record)."""
    return f"{scheme}://" + ";".join(s.strip() for s in bootstrap.split(",") if s.strip())


def create_app(settings: Settings, options: StreamsOptions) -> faust.App:
    """The streams stage's Faust app for ``settings`` (Kafka, topics) and ``options``, without its
    agents (:func:`kvbus.streams.agents.build` declares them)."""
    return faust_adapter.App(
        options.app_id,
        broker=broker_url(settings.bootstrap),
        broker_credentials=settings.security.kafka.faust_credentials(),
        # every kvbus topic and the changelog have this many partitions (co-partitioning)
        topic_partitions=settings.partitions,
        topic_replication_factor=options.replication,
        store=options.store,
        table_standby_replicas=options.standby_replicas,
        datadir=str(options.data_dir),
        processing_guarantee="at_least_once",
        consumer_auto_offset_reset="earliest",
        broker_commit_interval=options.commit_interval,
        broker_session_timeout=options.session_timeout,
        # heartbeats every tenth of the session (as the sink's, kvbus.sinks.consumer): after a broker
        # crash moves the group coordinator, the member reaches the new one well within its session
        broker_heartbeat_interval=heartbeat_interval(options.session_timeout),
        broker_request_timeout=max(90.0, options.session_timeout * 2),
        producer_acks=-1,
        # Faust's producer only writes the changelog: batch it (it is flushed before each commit)
        producer_linger=CHANGELOG_LINGER,
        stream_buffer_maxsize=max(4096, options.batch * 2),
        consumer_max_fetch_size=MAX_FETCH_BYTES,
        web_enabled=options.web_port is not None,
        web_port=options.web_port or 6066,
        web_host="127.0.0.1",
        autodiscover=False,
        Monitor=RecordQuietMonitor,
        TableManager=faust_adapter.TableManager,
    )


def changelog_specs(app: faust.App) -> list[TopicSpec]:
    """The changelog topics of ``app``'s tables, as Faust declares them when it starts: the table's
    partitions and replicas (else the app's), ``cleanup.policy`` from compacting/deleting,
    ``retention.ms`` from a retention, and the topic's own configuration.

    ``kvbus worker`` creates them before Faust starts (:func:`kvbus.streams.cli.run_worker`). Left to
    Faust, a changelog created at the worker's start may be missing from the consumer's first metadata
    answer; Faust's check of the table's partitions at the first table write then compares the raw
    topic's partitions with none and stops the worker (``PartitionsMismatch``)."""
    specs = []
    for table in app.tables.values():
        topic = table.changelog_topic
        cleanup = [policy for policy, on in (("compact", topic.compacting), ("delete", topic.deleting)) if on]
        config: dict[str, str] = {"cleanup.policy": ",".join(cleanup)} if cleanup else {}
        if topic.retention:
            config["retention.ms"] = str(int(want_seconds(topic.retention) * 1000))
        config.update({k: str(v) for k, v in (topic.config or {}).items()})
        for name in topic.topics:
            specs.append(TopicSpec(name, topic.partitions or app.conf.topic_partitions,
                                   topic.replicas or app.conf.topic_replication_factor, config))
    return specs
