"""Record values of the streams stage: raw EventBatch in, BlockEvent/Incomplete/DeadLetter out.

Everything is Confluent wire format (magic byte, schema id, Avro body) as made by
:class:`schemas.serde.RecordSerde`. For throughput, two fast paths produce exactly the same
values (tests/test_streams_codec.py proves byte equality):

* decoding: when a value's schema id is one whose registered schema is our ``EventBatch``
  schema, its body is scanned by :func:`streams.avro_scan.scan`, which keeps each block
  event as its Avro bytes (:class:`~streams.raw_event.RawEvent`) instead of decoding token
  ids; anything else (other schema ids, non-canonical encodings, garbage) goes through
  ``RecordSerde.loads``, whose errors are the errors that send a record to the DLQ;
* encoding: the schema id of ``<topic>-value`` is learnt once from ``RecordSerde.dumps``;
  then values are written by :mod:`streams.avro_writer`.
"""
from __future__ import annotations

import io
import json
import logging
import struct
from typing import Any, Union

import fastavro
import msgspec
from confluent_kafka.schema_registry import SchemaRegistryClient

from schemas.avro import event_from_avro, parsed_schema, schema_str
from schemas.events import BlockEvent, DeadLetter, Event, EventBatch, Incomplete
from schemas.serde import RecordSerde
from streams import avro_writer
from streams.avro_scan import ScanError, scan
from streams.raw_event import RawEvent

log = logging.getLogger("kvbus.streams")

_HEADER = struct.Struct(">bI")


class Codec:
    """Decoder of raw values and encoder of output values for one schema registry."""

    def __init__(self, registry: SchemaRegistryClient, fast: bool = True):
        self.registry = registry
        self.fast = fast
        self._batch = RecordSerde(registry, "EventBatch")
        self._serdes = {k: RecordSerde(registry, k) for k in ("BlockEvent", "Incomplete", "DeadLetter")}
        self._reader_ids: dict[int, bool] = {}
        self._writer_ids: dict[tuple[str, str], bytes] = {}
        self._batch_schema = parsed_schema("EventBatch")
        self._canonical = _canonical(fastavro.parse_schema(json.loads(schema_str("EventBatch"))))

    # -- decoding -------------------------------------------------------------

    def decode(self, data: bytes, topic: str) -> EventBatch:
        """An EventBatch from a raw value; raises what RecordSerde.loads raises on bad input."""
        if self.fast and data and len(data) > 5 and data[0] == 0:
            schema_id = _HEADER.unpack_from(data)[1]
            same = self._reader_ids.get(schema_id)
            if same is None:
                same = self._reader_ids[schema_id] = self._is_our_schema(schema_id)
            if same:
                try:
                    return scan(data, 5)
                except ScanError:
                    pass  # not canonical, or broken: RecordSerde decodes it or gives the error
        return self._batch.loads(data, topic)

    def _is_our_schema(self, schema_id: int) -> bool:
        try:
            schema = self.registry.get_schema(schema_id)
            return _canonical(fastavro.parse_schema(json.loads(schema.schema_str))) == self._canonical
        except Exception as exc:  # unknown id etc.: the slow path will report it
            log.debug("schema id %s: no fast path (%s)", schema_id, exc)
            return False

    # -- encoding -------------------------------------------------------------

    def encode(self, value: Union[BlockEvent, Incomplete, DeadLetter], topic: str) -> bytes:
        """Confluent-wire-format value of a BlockEvent, Incomplete or DeadLetter for ``topic``."""
        kind = type(value).__name__
        key = (kind, topic)
        header = self._writer_ids.get(key)
        if header is None or not self.fast:
            if isinstance(getattr(value, "event", None), RawEvent):
                value = msgspec.structs.replace(value, event=materialize(value.event))
            data = self._serdes[kind].dumps(value, topic)
            self._writer_ids[key] = data[:5]
            return data
        return header + avro_writer.WRITERS[kind](value)


_EVENT_UNION = None


def materialize(event: RawEvent) -> Event:
    """The struct a RawEvent encodes."""
    global _EVENT_UNION
    if _EVENT_UNION is None:
        batch = parsed_schema("EventBatch")
        items = next(f for f in batch["fields"] if f["name"] == "events")["type"]["items"]
        _EVENT_UNION = fastavro.parse_schema(items)
    value = fastavro.schemaless_reader(io.BytesIO(event.avro), _EVENT_UNION, None, return_record_name=True)
    return event_from_avro(value)


def _canonical(schema: Any) -> str:
    """Parsing canonical form of a fastavro-parsed schema (docs and defaults ignored)."""
    return json.dumps(_strip(schema), sort_keys=True)


def _strip(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: _strip(v) for k, v in node.items()
                if not k.startswith("__") and k not in ("doc", "default", "aliases")}
    if isinstance(node, list):
        return [_strip(v) for v in node]
    return node
