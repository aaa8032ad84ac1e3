"""Topics, the state table and the agents of the streams stage (a thin shell over
:mod:`kvbus.streams.runtime` and :mod:`kvbus.streams.aggregation`), declared on an app by :func:`build`.

* ``consolidate``: reads raw EventBatch records in batches and hands them to the runtime.
* ``sweep`` (timer): expires partial aggregates older than the window.
* a warm-up (a thread): the runtime's Kafka clients connect while Faust starts.
* an unready watch (a thread): exits the worker when it has been unready longer than its recovery
  timeout (:mod:`kvbus.streams.unready_watch`).
* ``STATE`` table: the durable copy of the aggregation state, keyed ``<holder>\\0`` (meta) and
  ``<holder>\\0<identity>`` (open aggregates); its changelog has the raw topic's partition count
  and every entry lives in the partition of its holder's raw records.

Why a plain Table swept by a timer rather than a windowed table: see docs/streams.md
("Expiry").
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any, Optional

import faust
from faust.types import AppT, Message

from kvbus.runtime.settings import Settings
from kvbus.streams.app import create_app
from kvbus.streams.faust_adapter import hold, look_up_offsets_with, take_batches
from kvbus.streams.options import StreamsOptions
from kvbus.streams.runtime import Runtime, start_warm_up
from kvbus.streams.unready_watch import UnreadyWatch, exit_on_failure, start_watch

log = logging.getLogger("kvbus.streams")

WATCH_EVERY = 5.0
"""Seconds between two looks at how long the worker has been unready (KVBUS_STREAMS_RECOVERY_TIMEOUT)."""
EXIT_GRACE = 30.0
"""Seconds a worker past its recovery timeout has to stop cleanly before it exits at once."""


class RawBytes(faust.Schema):
    """Keys and values as the bytes Kafka delivered (what the "raw" serializer returns, without
    the serializer registry's per-record lookups)."""

    def loads_key(self, app: AppT, message: Message, **kwargs: Any) -> Optional[bytes]:
        """The record key as is."""
        return message.key

    def loads_value(self, app: AppT, message: Message, **kwargs: Any) -> Optional[bytes]:
        """The record value as is."""
        return message.value


def build(settings: Settings, options: StreamsOptions) -> faust.App:
    """The streams stage's Faust app (:func:`kvbus.streams.app.create_app`) with its topic, table and agents."""
    app = create_app(settings, options)

    raw = app.topic(
        settings.topics.raw,
        schema=RawBytes(key_serializer="raw", value_serializer="raw"),
        partitions=settings.partitions,
    )  # raw EventBatch records (Confluent-wire Avro), keyed <replica>#<dp_rank>; pre-created by infra

    state = app.Table(
        "state",
        key_type=bytes,  # bytes key/value types make Faust use the "raw" codec for the changelog
        value_type=bytes,
        partitions=settings.partitions,
        help="Aggregation state: holder meta and open aggregates (msgpack).",
    )  # durable aggregation state; changelog topic <app id>-state-changelog (compacted)

    runtime = Runtime(app, settings, options, state)
    start_warm_up(runtime)  # its Kafka clients connect while Faust starts and joins the group

    @app.agent(raw, name="consolidate")
    async def consolidate(stream: Any) -> None:
        """Aggregate worker reports into consolidated events, a batch of raw records at a time."""
        async for events in take_batches(stream, options.batch, options.batch_within, options.batch_from):
            # take_batches acks the batch when this body returns; hold each record until the runtime has
            # delivered its outputs and written its state (Runtime releases it then).
            hold(events)
            try:
                await runtime.process(events)
            except Exception as exc:  # never leave held records behind in a running worker
                log.exception("processing a batch failed; stopping the worker so the batch is replayed")
                await app.crash(exc)
                raise

    @app.timer(interval=options.sweep, name="sweep")
    async def sweep() -> None:
        """Expire partial aggregates that waited longer than the window."""
        await runtime.sweep()

    def exit_with(verdict: str) -> None:
        """Crash the app (the worker exits with 1); exit at once if it has not within EXIT_GRACE s."""
        asyncio.run_coroutine_threadsafe(app.crash(RuntimeError(verdict)), app.loop)
        time.sleep(EXIT_GRACE)
        os._exit(1)

    if options.recovery_timeout:
        start_watch(UnreadyWatch(options.recovery_timeout), runtime.recovering, exit_with, WATCH_EVERY)

    # Table recovered after a rebalance: rebuild the working state of our partitions.
    state.on_recover(exit_on_failure("rebuilding the state after a rebalance", runtime.rebuild, exit_with))

    @app.on_partitions_revoked.connect
    async def on_revoked(sender: Any, revoked: Any, **kwargs: Any) -> None:
        """Forget the working state of partitions moving to another worker. Every rebalance starts
        here, the consumer built: the table recovery that follows looks its offsets up through the
        runtime's client, not behind the consumer's fetch."""
        look_up_offsets_with(app, runtime.log_offsets)
        runtime.revoke(tp.partition for tp in revoked if tp.topic == settings.topics.raw)

    @app.on_before_shutdown.connect
    def on_shutdown(sender: Any, **kwargs: Any) -> None:
        """Deliver queued outputs before the worker stops."""
        runtime.stop()

    return app
