"""Kafka side of the bridge: :class:`RawProducer` turns the bridge's EventBatch structs into records
of the shared :class:`~kvbus.producers.record_producer.RecordProducer` (backlog, delivery reports,
splitting, dead-letter topic, metrics: see there for the delivery contract and memory bounds).

When the backlog reaches its bound, :meth:`RawProducer.accepting` turns False and the
bridge stops accepting *live* batches (it keeps draining ZMQ so the engine is never
slowed, but drops what it reads, counting ``shed_batches``); it resumes once the
backlog is down to half. Dropped live batches are not lost silently: the next
accepted batch shows a sequence gap, which the bridge fills from the engine's
replay buffer, or announces with a ``Reset(gap-unrecoverable)`` marker.

A batch whose value exceeds ``max_record_bytes`` is produced as several records (parts, in
order, consecutive ``first_index``); an event too large for any record is dead-lettered
(:mod:`kvbus.producers.split`).
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Mapping

import msgspec

from kvbus.producers.metrics import BridgeMetrics
from kvbus.producers.record_producer import (
    DEFAULT_MAX_BACKLOG,
    DEFAULT_MAX_BACKLOG_BYTES,
    DEFAULT_PRODUCER_CONF,
    RecordProducer,
    producer_conf,
)
from kvbus.producers.split import DEFAULT_MAX_RECORD_BYTES, BatchRef
from kvbus.schemas.codec import encode_event
from kvbus.schemas.events import DeadLetter, EventBatch, holder_key

log = logging.getLogger("kvbus.producers.kafka")

__all__ = ["DEFAULT_MAX_BACKLOG", "DEFAULT_MAX_BACKLOG_BYTES", "DEFAULT_PRODUCER_CONF", "RawProducer", "producer_conf"]


class RawProducer(RecordProducer):
    """Produces EventBatch records to the raw topic and DeadLetters to the DLQ topic.

    ``producer``: a confluent-kafka ``Producer`` (or a stand-in); ``serialize_batch(batch) -> bytes``
    and ``serialize_dead_letter(dl) -> bytes`` give the Confluent-wire-format values (built once by
    the caller from the registry). Call :meth:`service` on every loop pass (delivery callbacks,
    backlog drain). ``max_record_bytes``: largest value produced as one record; larger batches are
    split. ``max_backlog`` / ``max_backlog_bytes``: records / bytes held beyond librdkafka's queue
    before the bridge sheds live batches.
    """

    def __init__(
        self,
        producer: Any,
        raw_topic: str,
        dlq_topic: str,
        serialize_batch: Callable[[EventBatch], bytes],
        serialize_dead_letter: Callable[[DeadLetter], bytes],
        metrics: BridgeMetrics,
        *,
        max_backlog: int = DEFAULT_MAX_BACKLOG,
        max_backlog_bytes: int = DEFAULT_MAX_BACKLOG_BYTES,
        max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
        conf: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(raw_topic, dlq_topic, serialize_dead_letter, metrics, stage="bridge", producer=producer,
                         conf=conf, max_record_bytes=max_record_bytes, max_backlog=max_backlog,
                         max_backlog_bytes=max_backlog_bytes)
        self._ser = serialize_batch

    @classmethod
    def build(
        cls,
        kafka: str | Mapping[str, Any],
        raw_topic: str,
        dlq_topic: str,
        serialize_batch: Callable[[EventBatch], bytes],
        serialize_dead_letter: Callable[[DeadLetter], bytes],
        metrics: BridgeMetrics,
        conf_overrides: dict[str, Any] | None = None,
        *,
        max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
        **kw: Any,
    ) -> "RawProducer":
        """A sink with its own producer configured by :func:`producer_conf` (``kafka``: a bootstrap
        string or ``Settings.kafka()``); ``max_record_bytes``
        is lowered to what the producer's ``message.max.bytes`` takes (:func:`~kvbus.producers.split.record_limit`)."""
        return cls(None, raw_topic, dlq_topic, serialize_batch, serialize_dead_letter, metrics,
                   max_record_bytes=max_record_bytes, conf=producer_conf(kafka, conf_overrides), **kw)

    def produce_batch(self, batch: EventBatch) -> None:
        """Queue one EventBatch, keyed ``<replica>#<dp_rank>``: as one record, or as several
        (in order) when its value exceeds the record limit (:mod:`kvbus.producers.split`)."""
        value = self._ser(batch)
        key = holder_key(batch.replica, batch.dp_rank).encode()
        if self.splitter.fits(len(value)):
            self.produce(self.raw_topic, key, value, len(batch.events))
            return

        def part_value(start: int, end: int) -> bytes:
            return self._ser(msgspec.structs.replace(batch, events=batch.events[start:end],
                                                     first_index=batch.first_index + start))

        ref = BatchRef(batch.replica, batch.dp_rank, batch.worker_rank, batch.epoch, batch.seq)
        fixed = len(self._ser(msgspec.structs.replace(batch, events=[])))
        self.produce_split(key, len(value), ref, [encode_event(e) for e in batch.events], fixed, part_value,
                           batch.first_index)

    def close(self, timeout: float = 30.0) -> int:
        """Deliver what is queued within ``timeout`` seconds; returns records left undelivered."""
        left = self.flush(timeout)
        if left:
            log.error("exiting with %d records not acknowledged by Kafka (lost unless the engine replays them)", left)
        self.update_gauges()
        return left
