"""Record values of the streams stage: raw EventBatch in, BlockEvent/Incomplete/DeadLetter out.

Everything is Confluent wire format (magic byte, schema id, Avro body), exactly what
:class:`schemas.serde.RecordSerde` writes and reads, through the shared fast codec
(:class:`schemas.fast_codec.FastSerde`):

* decoding: a raw value written with kvbus's current ``EventBatch`` schema is scanned by
  :func:`schemas.event_scan.batch_scanner`, which keeps each block event as its Avro bytes
  (:class:`~streams.raw_event.RawEvent`) instead of decoding token ids. Every TP worker of a
  replica reports the same events, so the other workers' records of a batch usually carry the
  very same bytes between header and ``first_index``: :class:`SharedScan` scans those once and
  hands the later records the same event objects (only their header is read); anything else
  (other schema ids, non-canonical encodings, garbage) goes through ``RecordSerde.loads``,
  whose errors are the errors that send a record to the DLQ;
* encoding: outputs are written by :mod:`schemas.fast_encode` (a RawEvent is spliced in as
  its bytes) behind the schema id of ``<topic>-value``, registered once per topic.
"""
from __future__ import annotations

from typing import Callable, Union

import msgspec
from confluent_kafka.schema_registry import SchemaRegistryClient

from schemas import fast_decode
from schemas.event_scan import batch_scanner
from schemas.events import BlockEvent, DeadLetter, Event, EventBatch, Incomplete
from schemas.fast_codec import FastSerde
from schemas.fast_decode import batch_fields
from schemas.wire_read import READ_ERRORS, WireError, read_long
from streams.raw_event import RawEvent

SHARED_EVENTS = 4096
"""Events lists :class:`SharedScan` keeps for the other workers' records (oldest dropped first)."""


def tail_start(data: bytes, start: int) -> int:
    """Where the record's last field (``first_index``, a varint whose last byte alone is below
    0x80) begins, or -1 if it cannot begin after ``start``."""
    i = len(data) - 1
    if i < start or data[i] >= 0x80:
        return -1
    while i > start and data[i - 1] >= 0x80:
        i -= 1
    return i if i > start else -1


class SharedScan:
    """EventBatch body reader for :class:`FastSerde` that scans each distinct events array once.

    The first record whose bytes between header and ``first_index`` (the events array) are new
    is scanned by ``scan`` (and validated by it); its events list is kept for the batch's other
    ``workers - 1`` reports. A record with the same array bytes gets that list (the scan of
    identical bytes gives identical events; nothing mutates them) and only its header and
    ``first_index`` are read. At most ``limit`` lists are kept.
    """

    def __init__(self, scan: Callable[[bytes, int], EventBatch], limit: int = SHARED_EVENTS):
        self.scan = scan
        self.limit = limit
        self._kept: dict[bytes, list] = {}
        """events array bytes -> [events list, reports still expected]"""

    def __call__(self, data: bytes, pos: int) -> EventBatch:
        """The EventBatch whose body is ``data[pos:]``; WireError if it is not canonical."""
        try:
            replica, dp_rank, worker_rank, workers, engine, epoch, seq, ts, topic, start = batch_fields(data, pos)
            end = tail_start(data, start)
            if workers < 2 or end < 0:
                return self.scan(data, pos)
            key = data[start:end]
            kept = self._kept.get(key)
            if kept is None:
                batch = self.scan(data, pos)
                self._keep(key, batch.events, workers - 1)
                return batch
            first_index, after = read_long(data, end)
        except READ_ERRORS as exc:
            raise WireError(str(exc)) from exc
        if after != len(data):
            raise WireError("trailing bytes")
        kept[1] -= 1
        if kept[1] <= 0:
            del self._kept[key]
        return EventBatch(replica=replica, seq=seq, ts=ts, events=kept[0], dp_rank=dp_rank,
                          worker_rank=worker_rank, workers=workers, engine=engine, epoch=epoch,
                          topic=topic, first_index=first_index)

    def _keep(self, key: bytes, events: list, uses: int) -> None:
        kept = self._kept
        if len(kept) >= self.limit:
            del kept[next(iter(kept))]
        kept[key] = [events, uses]


class Codec:
    """Decoder of raw values and encoder of output values for one schema registry.

    ``fast=False`` uses RecordSerde only (the reference the fast paths are tested against).
    """

    def __init__(self, registry: SchemaRegistryClient, fast: bool = True):
        self.registry = registry
        self.fast = fast
        self._batch = FastSerde(registry, "EventBatch", reader=SharedScan(batch_scanner(RawEvent)))
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
