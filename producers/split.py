"""Engine batches too large for one Kafka record: planned as several records (parts).

An engine batch is one ``EventBatch`` record on the raw topic, and a record must fit
librdkafka's ``message.max.bytes`` (1,000,000 bytes by default) and the topic's
``max.message.bytes``; a long prefill's ``BlockStored`` carries its token ids, so one batch can
reach several MB. Both producers (the bridge's :class:`~kvbus.producers.raw_producer.RawProducer` and the
in-process :class:`~kvbus.producers.publisher.KafkaEventPublisher`) therefore check the encoded value
against a limit (``KVBUS_MAX_RECORD_BYTES``, default 900,000) and, when it is larger, produce the
batch as consecutive parts, in order, under the same key, epoch and seq:
part k holds events ``[start_k, end_k)`` and says so with ``first_index = start_k``, so every
event keeps its position ``(epoch, seq, index)``. Consumers treat the parts as the batch
(docs/streams.md).

Packing is greedy (each part takes as many consecutive events as fit), from each event's
Avro size, which is the same whichever serializer writes the record. An event that alone
exceeds the limit can never be produced: it is counted (``kvbus_bridge_oversized_events``),
logged as an error naming replica, dp rank, worker, epoch, seq, index and size, and sent to the
dead-letter topic as a ``DeadLetter`` whose reason carries that metadata and whose payload is
the first :data:`DLQ_PAYLOAD_BYTES` of the event's Avro encoding (:func:`kvbus.schemas.events.dead_letter`;
for a ``BlockStored`` its block hashes come first). The events around it are produced as usual; its index is skipped.

:class:`Splitter` plans, counts, logs and dead-letters; each producer says how it encodes and
queues one part (a callback), so both paths share everything else.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from kvbus.producers.metrics import BridgeMetrics
from kvbus.runtime.settings import DEFAULT_MAX_RECORD_BYTES
from kvbus.schemas.events import DLQ_PAYLOAD_BYTES, DeadLetter, dead_letter, holder_key

log = logging.getLogger("kvbus.producers.split")

LIBRDKAFKA_MESSAGE_MAX_BYTES = 1_000_000
"""librdkafka's default ``message.max.bytes`` (kvbus does not override it)."""
RECORD_MARGIN = 4096
"""Bytes kept free below ``message.max.bytes`` for the key and the record framing."""
MIN_RECORD_BYTES = 1024
"""Smallest limit accepted (the fixed fields of a batch must fit with room for events)."""
_COUNTS_SLACK = 16
"""Room for the varints that grow with a part: its event count and its first_index."""
_EVENT_TYPES = {0: "BlockStored", 2: "BlockRemoved", 4: "AllBlocksCleared", 6: "Reset"}
"""Event-union branch byte -> event type (for messages)."""

__all__ = ["DEFAULT_MAX_RECORD_BYTES", "BatchRef", "SplitPlan", "Splitter", "plan_split", "record_limit"]


def record_limit(limit: int, producer_conf: Mapping[str, Any] | None = None) -> int:
    """The value-size limit to use with a producer configured by ``producer_conf``: ``limit``,
    lowered to ``message.max.bytes`` minus :data:`RECORD_MARGIN` if the producer takes less.
    Raises ValueError for a limit below :data:`MIN_RECORD_BYTES`."""
    if limit < MIN_RECORD_BYTES:
        raise ValueError(f"record limit {limit} bytes is below the minimum of {MIN_RECORD_BYTES}")
    conf = producer_conf or {}
    cap = int(conf.get("message.max.bytes", LIBRDKAFKA_MESSAGE_MAX_BYTES)) - RECORD_MARGIN
    if limit > cap:
        log.warning("record limit %d bytes exceeds the producer's message.max.bytes minus %d: using %d",
                    limit, RECORD_MARGIN, cap)
        return max(cap, MIN_RECORD_BYTES)
    return limit


@dataclass(frozen=True)
class SplitPlan:
    """How one engine batch is produced: ``parts`` as ``(start, end)`` event-index ranges in
    order (a part's ``first_index`` is its ``start``), and the indexes of ``oversized`` events
    that fit no record and are dead-lettered instead."""

    parts: list[tuple[int, int]] = field(default_factory=list)
    oversized: list[int] = field(default_factory=list)


def plan_split(sizes: Sequence[int], fixed: int, limit: int) -> SplitPlan:
    """Pack events of Avro sizes ``sizes`` greedily into consecutive parts whose values stay
    within ``limit`` bytes, ``fixed`` being the size of the value with no events."""
    budget = limit - fixed - _COUNTS_SLACK
    plan = SplitPlan()
    start = total = 0
    for i, size in enumerate(sizes):
        if size > budget:
            if i > start:
                plan.parts.append((start, i))
            plan.oversized.append(i)
            start, total = i + 1, 0
            continue
        if total + size > budget and i > start:
            plan.parts.append((start, i))
            start, total = i, 0
        total += size
    if len(sizes) > start or not sizes:
        plan.parts.append((start, len(sizes)))
    return plan


@dataclass(frozen=True)
class BatchRef:
    """Which engine batch a split concerns (for logs and dead letters)."""

    replica: str
    dp_rank: int
    worker_rank: int
    epoch: int
    seq: int

    def __str__(self) -> str:
        return (f"{holder_key(self.replica, self.dp_rank)} worker {self.worker_rank} "
                f"epoch {self.epoch} seq {self.seq}")


class Splitter:
    """The split policy of one producer: its limit, and the metrics, logs and dead letters of
    split batches and oversized events. ``stage`` is the DeadLetter stage (bridge, publisher)."""

    def __init__(self, limit: int, metrics: BridgeMetrics, stage: str) -> None:
        self.limit = limit
        self.metrics = metrics
        self.stage = stage

    def fits(self, value_size: int) -> bool:
        """Whether a value of ``value_size`` bytes is produced as one record."""
        return value_size <= self.limit

    def split(
        self,
        ref: BatchRef,
        value_size: int,
        encoded: Sequence[bytes],
        fixed: int,
        produce_part: Callable[[int, int], None],
        produce_dead_letter: Callable[[DeadLetter], None],
        first_index: int = 0,
    ) -> SplitPlan:
        """Produce a batch whose value (``value_size`` bytes) is over the limit as parts, in order.

        ``encoded``: the Avro encoding of each event; ``fixed``: size of the batch's value with no
        events; ``produce_part(start, end)`` queues the record of events ``[start, end)`` with
        ``first_index + start``; ``produce_dead_letter`` queues the DeadLetter of an event too
        large for any record (``first_index``: index in the engine batch of ``encoded[0]``)."""
        plan = plan_split([len(e) for e in encoded], fixed, self.limit)
        self.metrics.split_batches.inc()
        self.metrics.split_parts.inc(len(plan.parts))
        log.info("batch %s: %d bytes, %d events, above the %d-byte record limit: produced as %d records",
                 ref, value_size, len(encoded), self.limit, len(plan.parts))
        for start, end in plan.parts:
            produce_part(start, end)
        for i in plan.oversized:
            produce_dead_letter(self._dead_letter(ref, first_index + i, encoded[i]))
        return plan

    def _dead_letter(self, ref: BatchRef, index: int, avro: bytes) -> DeadLetter:
        """The DeadLetter of event ``index`` (Avro encoding ``avro``) that fits no record;
        counts it and logs the error."""
        kind = _EVENT_TYPES.get(avro[0], "event") if avro else "event"
        self.metrics.oversized_events.inc()
        self.metrics.dlq.inc()
        log.error("batch %s: %s at index %d is %d bytes encoded, above the %d-byte record limit on its own: "
                  "not produced; dead-lettered with its first %d bytes", ref, kind, index, len(avro), self.limit,
                  min(len(avro), DLQ_PAYLOAD_BYTES))
        reason = (f"OversizedEvent: {kind} at index {index} of {ref} is {len(avro)} bytes encoded, above the "
                  f"{self.limit}-byte record limit; payload: its Avro encoding")
        return dead_letter(self.stage, holder_key(ref.replica, ref.dp_rank), reason, [avro], time.time())
