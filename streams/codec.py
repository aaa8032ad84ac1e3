"""Record values of the streams stage: raw EventBatch in, BlockEvent/Incomplete/DeadLetter out.

Everything is Confluent wire format (magic byte, schema id, Avro body), exactly what
:class:`schemas.serde.RecordSerde` writes and reads, through the shared fast codec
(:class:`schemas.fast_codec.FastSerde`):

* decoding: a raw value written with kvbus's current ``EventBatch`` schema is scanned by
  :func:`schemas.event_scan.batch_scanner`, which keeps each block event as its Avro bytes
  (:class:`~streams.raw_event.RawEvent`) instead of decoding token ids; anything else
  (other schema ids, non-canonical encodings, garbage) goes through ``RecordSerde.loads``,
  whose errors are the errors that send a record to the DLQ;
* encoding: outputs are written by :mod:`schemas.fast_encode` (a RawEvent is spliced in as
  its bytes) behind the schema id of ``<topic>-value``, registered once per topic.
"""
from __future__ import annotations

from typing import Union

import msgspec
from confluent_kafka.schema_registry import SchemaRegistryClient

from schemas import fast_decode
from schemas.event_scan import batch_scanner
from schemas.events import BlockEvent, DeadLetter, Event, EventBatch, Incomplete
from schemas.fast_codec import FastSerde
from streams.raw_event import RawEvent


class Codec:
    """Decoder of raw values and encoder of output values for one schema registry.

    ``fast=False`` uses RecordSerde only (the reference the fast paths are tested against).
    """

    def __init__(self, registry: SchemaRegistryClient, fast: bool = True):
        self.registry = registry
        self.fast = fast
        self._batch = FastSerde(registry, "EventBatch", reader=batch_scanner(RawEvent))
        self._outputs = {k: FastSerde(registry, k) for k in ("BlockEvent", "Incomplete", "DeadLetter")}

    def decode(self, data: bytes, topic: str) -> EventBatch:
        """An EventBatch from a raw value; raises what RecordSerde.loads raises on bad input."""
        if self.fast:
            return self._batch.loads(data, topic)
        return self._batch.slow.loads(data, topic)

    def encode(self, value: Union[BlockEvent, Incomplete, DeadLetter], topic: str) -> bytes:
        """Confluent-wire-format value of a BlockEvent, Incomplete or DeadLetter for ``topic``."""
        serde = self._outputs[type(value).__name__]
        if self.fast:
            return serde.dumps(value, topic)
        if isinstance(getattr(value, "event", None), RawEvent):
            value = msgspec.structs.replace(value, event=materialize(value.event))
        return serde.slow.dumps(value, topic)


def materialize(event: RawEvent) -> Event:
    """The struct a RawEvent encodes."""
    return fast_decode.event(event.avro)
