"""The Faust application of the streams stage (topics, tables and agents: :mod:`streams.agents`).

Configured from the environment at import (:class:`schemas.settings.Settings`,
:class:`streams.options.StreamsOptions`): ``kvbus worker`` sets the variables first.
"""
from __future__ import annotations

import faust

from schemas.settings import Settings
from streams.options import StreamsOptions

SETTINGS = Settings.from_env()
"""Services and topic names (KVBUS_*)."""
OPTIONS = StreamsOptions.from_env()
"""Streams-stage options (KVBUS_STREAMS_*)."""


def broker_url(bootstrap: str) -> str:
    """Faust broker URL for comma-separated bootstrap servers: ``kafka://h1:p1;h2:p2``."""
    return "kafka://" + ";".join(s.strip() for s in bootstrap.split(",") if s.strip())


app = faust.App(
    OPTIONS.app_id,
    broker=broker_url(SETTINGS.bootstrap),
    # every kvbus topic and the changelog have this many partitions (co-partitioning)
    topic_partitions=SETTINGS.partitions,
    topic_replication_factor=OPTIONS.replication,
    store=OPTIONS.store,
    table_standby_replicas=OPTIONS.standby_replicas,
    datadir=str(OPTIONS.data_dir),
    processing_guarantee="at_least_once",
    consumer_auto_offset_reset="earliest",
    broker_commit_interval=OPTIONS.commit_interval,
    broker_session_timeout=OPTIONS.session_timeout,
    broker_heartbeat_interval=max(0.5, OPTIONS.session_timeout / 5),
    broker_request_timeout=max(90.0, OPTIONS.session_timeout * 2),
    producer_acks=-1,
    stream_buffer_maxsize=max(4096, OPTIONS.batch * 2),
    web_enabled=OPTIONS.web_port is not None,
    web_port=OPTIONS.web_port or 6066,
    web_host="127.0.0.1",
    autodiscover=False,
)
