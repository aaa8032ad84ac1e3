"""Record values of the streams stage: raw EventBatch in, BlockEvent/Incomplete/DeadLetter out.

Everything is Confluent wire format (magic byte, schema id, Avro body), exactly what
:class:`kvbus.schemas.serde.RecordSerde` writes and reads, through the codec generated from the
schemas (:class:`kvbus.schemas.codec.FastSerde`):

* decoding: a raw value written with kvbus's current ``EventBatch`` schema is scanned by
  :func:`kvbus.schemas.codec.batch_scanner`, which keeps each block event as its Avro bytes
  (:class:`~kvbus.streams.raw_event.RawEvent`) instead of decoding token ids. Every TP worker of a
  replica reports the same events, so the other workers' records of a batch usually carry the
  very same bytes from the events array on: :class:`SharedEvents` lets the scanner scan those
  once and hand the later records the same event objects (only their other fields are read);
  anything else (other schema ids, non-canonical encodings, garbage) goes through
  ``RecordSerde.loads``, whose errors are the errors that send a record to the DLQ;
* encoding: outputs (BlockEvent, BlockEvents, Incomplete, DeadLetter) are written by the generated
  encoders (a RawEvent is spliced in as its bytes) behind the schema id of ``<topic>-value``, registered
  once per topic.
"""
from __future__ import annotations

from typing import Union

import msgspec
from confluent_kafka.schema_registry import SchemaRegistryClient

from kvbus.schemas.codec import FastSerde, batch_scanner, decode_event
from kvbus.schemas.events import BlockEvent, BlockEvents, DeadLetter, Event, EventBatch, Incomplete
from kvbus.streams.raw_event import RawEvent

SHARED_EVENTS = 4096
"""Events lists :class:`SharedEvents` keeps for the other workers' records (oldest dropped first)."""


class SharedEvents:
    """The scanned events lists of recent EventBatch records, for the batch's other
    ``workers - 1`` reports (the ``shared`` of :func:`kvbus.schemas.codec.batch_scanner`).

    ``key`` is a record's events array bytes (up to the int fields that end the record:
    ``first_index``); the scan of identical bytes gives identical events and
    nothing mutates them. At most ``limit`` lists are kept.
    """

    def __init__(self, limit: int = SHARED_EVENTS):
        self.limit = limit
        self._kept: dict[bytes, list] = {}
        """events array bytes -> [events list, reports still expected]"""

    def get(self, key: bytes) -> list | None:
        """The events list scanned from ``key``, if a report of the batch is still expected."""
        kept = self._kept.get(key)
        if kept is None:
            return None
        kept[1] -= 1
        if kept[1] <= 0:
            del self._kept[key]
        return kept[0]

    def put(self, key: bytes, batch: EventBatch) -> None:
        """Keep the events of a batch just scanned from ``key`` for its other workers' reports."""
        if batch.workers < 2:
            return
        kept = self._kept
        if len(kept) >= self.limit:
            del kept[next(iter(kept))]
        kept[key] = [batch.events, batch.workers - 1]


class Codec:
    """Decoder of raw values and encoder of output values for one schema registry.

    ``fast=False`` uses RecordSerde only (the reference the fast paths are tested against).
    """

    def __init__(self, registry: SchemaRegistryClient, fast: bool = True):
        self.registry = registry
        self.fast = fast
        self._batch = FastSerde(registry, "EventBatch", reader=batch_scanner(RawEvent, SharedEvents()))
        self._outputs = {k: FastSerde(registry, k) for k in ("BlockEvent", "BlockEvents", "Incomplete", "DeadLetter")}

    def decode(self, data: bytes, topic: str) -> EventBatch:
        """An EventBatch from a raw value; raises what RecordSerde.loads raises on bad input."""
        if self.fast:
            return self._batch.loads(data, topic)
        return self._batch.slow.loads(data, topic)

    def encode(self, value: Union[BlockEvent, BlockEvents, Incomplete, DeadLetter], topic: str) -> bytes:
        """Confluent-wire-format value of a BlockEvent, BlockEvents, Incomplete or DeadLetter for ``topic``."""
        serde = self._outputs[type(value).__name__]
        if self.fast:
            return serde.dumps(value, topic)
        if isinstance(getattr(value, "event", None), RawEvent):
            value = msgspec.structs.replace(value, event=materialize(value.event))
        if isinstance(value, BlockEvents):
            value = msgspec.structs.replace(value, events=[
                msgspec.structs.replace(p, event=materialize(p.event)) if isinstance(p.event, RawEvent) else p
                for p in value.events])
        return serde.slow.dumps(value, topic)


def materialize(event: RawEvent) -> Event:
    """The struct a RawEvent encodes."""
    return decode_event(event.avro)
