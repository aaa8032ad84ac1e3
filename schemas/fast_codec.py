"""Fast Confluent-wire-format serde of kvbus records: :class:`FastSerde`, a drop-in for
:class:`schemas.serde.RecordSerde` (same ``dumps(obj, topic)`` / ``loads(data, topic)``)
built on the hand-written codec (:mod:`schemas.fast_encode`, :mod:`schemas.fast_decode`).

* Encoding: the schema id of ``<topic>-value`` is registered (or looked up) once per topic
  with :func:`schemas.serde.value_schema_id` and kept; a value is the 5-byte header + the
  hand-written body, byte for byte what ``RecordSerde.dumps`` writes.
* Decoding: a value whose writer schema id names exactly kvbus's current schema (Avro
  parsing canonical form: docs and defaults aside, asked once per id) is read by the
  hand-written decoder; any other value goes through ``RecordSerde.loads``: records written
  with an older or newer registered schema (schema evolution: the registry's schema is
  resolved against ours), non-canonical encodings, and broken input, whose error is then
  RecordSerde's own.
"""
from __future__ import annotations

import json
import logging
import struct
from typing import Any, Callable, Optional

from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.error import SchemaRegistryError
from fastavro import parse_schema
from fastavro.schema import to_parsing_canonical_form

from schemas.avro import parsed_schema
from schemas.fast_decode import BODY_READERS
from schemas.fast_encode import BODY_WRITERS
from schemas.serde import RecordSerde, value_schema_id
from schemas.wire import HEADER_SIZE, confluent_header
from schemas.wire_read import WireError

log = logging.getLogger("kvbus.schemas")

_SCHEMA_ID = struct.Struct(">I").unpack_from


def canonical_form(schema: str | dict) -> str:
    """Avro parsing canonical form of a schema (JSON text or parsed): what decides the
    binary encoding (names, types, field order), without docs, defaults or aliases."""
    node = json.loads(schema) if isinstance(schema, str) else schema
    return to_parsing_canonical_form(parse_schema(node))


class FastSerde:
    """Serializer and deserializer of one kvbus record kind (``EventBatch``, ``BlockEvent``,
    ``Incomplete``, ``DeadLetter``) in the Confluent wire format; see the module doc.

    ``auto_register``: as for RecordSerde (False: only look the schema up when encoding).
    ``reader``: decoder of a body at an offset, ``reader(data, 5)``, for the fast path
    (default: the record's full decoder; e.g. :func:`schemas.event_scan.batch_scanner`); it
    raises :class:`~schemas.wire_read.WireError` to hand a value to ``RecordSerde.loads``.
    ``slow`` is the RecordSerde used as the fallback.
    """

    def __init__(self, registry: SchemaRegistryClient, record: str, auto_register: bool = True,
                 reader: Optional[Callable[[bytes, int], Any]] = None):
        self.registry = registry
        self.record = record
        self.auto_register = auto_register
        self.slow = RecordSerde(registry, record, auto_register=auto_register)
        self._write = BODY_WRITERS[record]
        self._read = reader or BODY_READERS[record]
        self._headers: dict[str, bytes] = {}
        self._fast_ids: dict[int, bool] = {}
        self._canonical = canonical_form(parsed_schema(record))

    # -- encoding -------------------------------------------------------------

    def header(self, topic: str) -> bytes:
        """Magic byte + schema id of ``<topic>-value`` (registered or looked up once)."""
        h = self._headers.get(topic)
        if h is None:
            schema_id = value_schema_id(self.registry, topic, self.record, self.auto_register)
            h = self._headers[topic] = confluent_header(schema_id)
            self._fast_ids[schema_id] = True
        return h

    def schema_id(self, topic: str) -> int:
        """Writer schema id of this record kind on ``topic``."""
        return int.from_bytes(self.header(topic)[1:], "big")

    def dumps(self, obj: Any, topic: str) -> bytes:
        """Encode ``obj`` for ``topic`` (the bytes ``RecordSerde.dumps`` writes)."""
        h = self._headers.get(topic)
        if h is None:
            h = self.header(topic)
        return h + self._write(obj)

    # -- decoding -------------------------------------------------------------

    def loads(self, data: bytes, topic: str) -> Any:
        """Decode a value read from ``topic`` (what ``RecordSerde.loads`` returns; it
        raises what RecordSerde raises on bad input)."""
        if len(data) > HEADER_SIZE and data[0] == 0:
            (schema_id,) = _SCHEMA_ID(data, 1)
            fast = self._fast_ids.get(schema_id)
            if fast is None:
                fast = self.is_current(schema_id)
            if fast:
                try:
                    return self._read(data, HEADER_SIZE)
                except WireError:
                    pass  # not canonical, or broken: RecordSerde decodes it or gives the error
        return self.slow.loads(data, topic)

    def is_current(self, schema_id: int) -> bool:
        """Whether ``schema_id`` names this record's current schema (so the fast decoder
        applies). Asked once per id; a registry that cannot answer now is asked again later."""
        try:
            schema = self.registry.get_schema(schema_id)
        except SchemaRegistryError as exc:
            if 400 <= exc.http_status_code < 500:  # unknown id: RecordSerde.loads will say so
                self._fast_ids[schema_id] = False
            return False
        except Exception as exc:  # registry unreachable: ask again with the next record
            log.debug("schema id %s: no fast path for now (%s: %s)", schema_id, type(exc).__name__, exc)
            return False
        try:
            same = schema.schema_type in (None, "AVRO") and canonical_form(schema.schema_str) == self._canonical
        except Exception:  # not a valid Avro schema
            same = False
        self._fast_ids[schema_id] = same
        if not same:
            log.info("schema id %s is not the current %s schema: its records decode via RecordSerde",
                     schema_id, self.record)
        return same
