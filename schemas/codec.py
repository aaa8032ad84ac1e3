"""The fast Avro codec of kvbus's records, derived from the ``.avsc`` files at import: one facade
for encoding, decoding and scanning, and :class:`FastSerde`, the Confluent-wire-format serde.

:func:`build` parses ``schemas/avro`` (or a copy of it), has :mod:`kvbus.schemas.codegen` write the
Python source of an encoder, a decoder and a skipper per record, and executes it. Adding an
optional field to a record is then an edit of its ``.avsc`` and of its struct in
:mod:`kvbus.schemas.events`, nothing else (tests/test_codec.py shows it on a copy of the schemas).
The output is byte for byte what fastavro and confluent's ``AvroSerializer``
(:class:`kvbus.schemas.serde.RecordSerde`) write; the decoders return what ``RecordSerde.loads``
returns, reading the canonical encoding only and raising
:class:`~kvbus.schemas.codec_runtime.WireError` for anything else.

The generated source runs one of two ways, with the same results: its compiled build
(:mod:`kvbus.schemas.codec_build`, made by ``./dev setup``) when there is one of exactly this
source, else ``exec`` of the source, the reference path (also with ``KVBUS_COMPILED_CODEC=0``).
:attr:`Codec.compiled` says which; the first :class:`FastSerde` of a process logs it.

Module-level names are those of the codec of ``schemas/avro``:

* ``encode(record, obj)`` / ``decode(record, data, pos=0)``: bodies of the top-level records;
* ``event_writer(record, fields=None)``: the same from field values (no struct built),
  positional for the given ``fields``;
* ``encode_event(e)``: the event-union encoding (branch index + record) of an event struct, or
  the ``avro`` bytes of a pre-encoded one (any object with that attribute, e.g.
  :class:`kvbus.streams.raw_event.RawEvent`); ``encode_events`` / ``event_array``: an ``events``
  array; ``decode_event(data, pos=0)``;
* ``batch_head(replica, dp_rank, worker_rank, workers, engine, model)`` and
  ``batch_from_head(head, epoch, seq, ts, topic, events, first_index=0)``: an EventBatch body
  from a cached head and an encoded events array (the producers' hot path);
* ``batch_scanner(raw, shared=None)``: an EventBatch reader that keeps each BlockStored and
  BlockRemoved as its exact bytes, ``raw(avro, ownership, without_lora_name)``, so the streams
  stage routes events without decoding token ids; ``without_lora_name`` is the encoding with
  ``lora_name`` null when it was set (lora_name is not part of the event identity), else None.
"""
from __future__ import annotations

import json
import linecache
import logging
import os
import struct
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.error import SchemaRegistryError
from fastavro import parse_schema
from fastavro.schema import load_schema, to_parsing_canonical_form

from kvbus.runtime.env import declared
from kvbus.runtime.settings import Settings
from kvbus.schemas import codec_build, codec_runtime, events as _events
from kvbus.schemas.avro import RECORDS, SCHEMA_DIR
from kvbus.schemas.codec_runtime import HEADER_SIZE, READ_ERRORS, WireError, confluent_header
from kvbus.schemas.codegen import HEADER, generator, mangle
from kvbus.schemas.serde import RecordSerde, value_schema_id

log = logging.getLogger("kvbus.schemas")

SCAN = ("kvbus.EventBatch", "events", ("kvbus.BlockStored", "kvbus.BlockRemoved"), "ownership", "lora_name")
"""What :func:`batch_scanner` keeps raw: the block events of EventBatch.events, with their
``ownership`` read (the streams stage routes by it) and ``lora_name`` blanked for the identity."""
SPLIT = ("kvbus.EventBatch", ("replica", "dp_rank", "worker_rank", "workers", "engine", "model"), "events")
"""The EventBatch fields a producer encodes once per stream (``batch_head``), and the field it
passes already encoded (``batch_from_head``)."""

RawFactory = Callable[[bytes, Optional[str], Optional[bytes]], Any]
"""``raw(avro, ownership, without_lora_name)`` -> the object kept for a scanned block event."""


def default_structs() -> dict[str, type]:
    """Avro record full name -> struct: ``kvbus.X`` is :class:`kvbus.schemas.events.X`."""
    return {f"kvbus.{n}": c for n, c in vars(_events).items() if isinstance(c, type)}


class Codec:
    """The generated functions for one set of schemas (see the module doc); ``source`` is the
    generated Python source."""

    def __init__(self, records: dict[str, dict], structs: dict[str, type], compiled: bool = False):
        self.records = records
        self._gen = generator(records, structs, scan=SCAN, split=SPLIT)
        self.generated = HEADER + "\n\n\n".join(self._gen.out) + "\n"
        """The generated source of the codec's functions (what the compiled build is a build of)."""
        self.source = self.generated
        """:attr:`generated`, then the positional writers generated since (:meth:`event_writer`)."""
        ns: dict[str, Any] = {k: getattr(codec_runtime, k) for k in dir(codec_runtime) if not k.startswith("__")}
        ns.update({f"S_{mangle(name)}": cls for name, cls in structs.items()})
        self.ns = ns
        """The functions' globals: the compiled module's, or those ``exec`` gave the source."""
        built, self.path = codec_build.load(self.generated, ns) if compiled else (None, "compiled codec off")
        if built is not None:
            self.ns = built
        else:
            self._exec(self.generated, "generated")
        self.compiled = built is not None
        """Whether the functions are the compiled build's (:mod:`kvbus.schemas.codec_build`); else the
        source's, run by ``exec``. :attr:`path` says which build, or why not."""
        ns = self.ns
        self._positional: dict[tuple[str, tuple[str, ...]], Callable[..., bytes]] = {}
        self.writers: dict[str, Callable[[Any], bytes]] = {r: ns[f"w_kvbus_{r}"] for r in records}
        """Record short name -> writer of its Avro body."""
        self.readers: dict[str, Callable[..., Any]] = {r: ns[f"d_kvbus_{r}"] for r in records}
        """Record short name -> ``read(data, pos=0)`` of a whole body starting at ``pos``."""
        batch = mangle(SCAN[0])
        self.encode_event: Callable[[Any], bytes] = ns[f"wu_{ns['SCAN_UNION']}"]
        self._read_event = ns[f"ru_{ns['SCAN_UNION']}"]
        self._scan = ns[f"scan_{batch}"]
        self.batch_head: Callable[..., bytes] = ns[f"head_{mangle(SPLIT[0])}"]
        self.batch_from_head: Callable[..., bytes] = ns[f"tail_{mangle(SPLIT[0])}"]

    def encode(self, record: str, obj: Any) -> bytes:
        """Avro body of ``obj``, a ``kvbus.<record>`` struct."""
        return self.writers[record](obj)

    def decode(self, record: str, data: bytes, pos: int = 0) -> Any:
        """The ``kvbus.<record>`` struct whose body is ``data[pos:]``; WireError if not canonical."""
        return self.readers[record](data, pos)

    def _exec(self, source: str, what: str) -> None:
        filename = f"<kvbus.schemas.codec {what} {id(self):x}>"
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        exec(compile(source, filename, "exec"), self.ns)

    def event_writer(self, record: str, fields: Optional[tuple[str, ...]] = None) -> Callable[..., bytes]:
        """The event-union encoding of a ``kvbus.<record>`` event from its field values, for a
        producer that converts an engine's event without building the struct (kvbus.producers.publisher).

        ``fields`` None: ``write(<field>=value, ...)`` (fields with a default may be left out).
        ``fields`` given: ``write(<those values, in that order>)``, positional, every other field
        at its schema default: the writer of a producer's common event shape, generated on
        first request (:meth:`kvbus.schemas.codegen.Generator.positional_writer`) and kept."""
        union = self.ns["SCAN_UNION"]
        if fields is None:
            return self.ns[f"wv{union}_kvbus_{record}"]
        key = (record, tuple(fields))
        write = self._positional.get(key)
        if write is None:
            gen = self._gen
            name = f"kvbus.{record}"
            members = next(k for k, n in gen.unions.items() if n == union)
            start = len(gen.out)
            fn = gen.positional_writer(gen.named[name], key[1], prefix=gen._branch(members.index(name)))
            source = "\n\n\n".join(gen.out[start:]) + "\n"
            self.source += "\n\n" + source
            self._exec(source, f"writer {fn}")
            write = self._positional[key] = self.ns[fn]
        return write

    def encode_events(self, evs: list) -> bytes:
        """The ``events`` array of an EventBatch."""
        if not evs:
            return b"\x00"
        return codec_runtime.LONG[len(evs)] + b"".join(map(self.encode_event, evs)) + b"\x00"

    @staticmethod
    def event_array(encoded: list[bytes]) -> bytes:
        """The ``events`` array of already encoded events (each as ``encode_event`` writes it)."""
        if not encoded:
            return b"\x00"
        return codec_runtime.LONG[len(encoded)] + b"".join(encoded) + b"\x00"

    def decode_event(self, data: bytes, pos: int = 0) -> Any:
        """The event whose union encoding is ``data[pos:]``."""
        try:
            value, end = self._read_event(data, pos)
        except READ_ERRORS as exc:
            raise WireError(str(exc)) from exc
        if end != len(data):
            raise WireError("trailing bytes")
        return value

    def batch_scanner(self, raw: RawFactory, shared: Any = None) -> Callable[[bytes, int], Any]:
        """``scan(data, pos=0) -> EventBatch`` with block events made by ``raw`` (module doc).
        ``shared``: see :meth:`kvbus.schemas.codegen.Generator.scan_fn` (kvbus.streams.record_values.SharedEvents)."""
        scan = self._scan

        def scanner(data: bytes, pos: int = 0) -> Any:
            return scan(data, pos, raw, shared)

        return scanner


def load_records(schema_dir: Path | str = SCHEMA_DIR, records: tuple[str, ...] = RECORDS) -> dict[str, dict]:
    """Short name -> fastavro-parsed schema of each top-level ``kvbus.<record>.avsc`` in ``schema_dir``."""
    return {r: load_schema(str(Path(schema_dir) / f"kvbus.{r}.avsc")) for r in records}


def build(schema_dir: Path | str = SCHEMA_DIR, structs: Optional[dict[str, type]] = None,
          compiled: Optional[bool] = None) -> Codec:
    """The codec of the schemas in ``schema_dir`` for ``structs`` (default: :mod:`kvbus.schemas.events`).
    ``compiled``: use the compiled build of its generated source when there is one of exactly that
    source (:mod:`kvbus.schemas.codec_build`), else ``exec`` the source; None: as
    ``KVBUS_COMPILED_CODEC`` says (:attr:`kvbus.runtime.settings.Settings.compiled_codec`)."""
    if compiled is None:
        compiled = compiled_codec_setting()
    return Codec(load_records(schema_dir), structs or default_structs(), compiled)


def compiled_codec_setting(environ: Optional[Mapping[str, str]] = None) -> bool:
    """``KVBUS_COMPILED_CODEC`` of ``environ`` (default: the process's), as Settings declares it."""
    declared_as = dict(declared(Settings))["compiled_codec"]
    return declared_as.read(os.environ if environ is None else environ)


_announced = False


def announce(codec: Codec) -> None:
    """Log once per process which path ``codec`` runs (compiled build or generated Python), when
    the first serde is made (the process has set up its logging by then)."""
    global _announced
    if not _announced:
        _announced = True
        if codec.compiled:
            log.info("Avro codec: %s", codec.path)
        else:
            log.info("Avro codec: generated Python, the reference path (%s)", codec.path)


CODEC = build()
"""The codec of ``schemas/avro`` (compiled unless ``KVBUS_COMPILED_CODEC`` is off or there is no build of it)."""
encode = CODEC.encode
decode = CODEC.decode
encode_event = CODEC.encode_event
encode_events = CODEC.encode_events
event_array = CODEC.event_array
decode_event = CODEC.decode_event
batch_head = CODEC.batch_head
batch_from_head = CODEC.batch_from_head
batch_scanner = CODEC.batch_scanner
event_writer = CODEC.event_writer

_SCHEMA_ID = struct.Struct(">I").unpack_from


def canonical_form(schema: str | dict) -> str:
    """Avro parsing canonical form of a schema (JSON text or parsed): what decides the
    binary encoding (names, types, field order), without docs, defaults or aliases."""
    node = json.loads(schema) if isinstance(schema, str) else schema
    return to_parsing_canonical_form(parse_schema(node))


class FastSerde:
    """Serializer and deserializer of one kvbus record kind in the Confluent wire format, a
    drop-in for :class:`kvbus.schemas.serde.RecordSerde` (same ``dumps(obj, topic)`` /
    ``loads(data, topic)``), built on the generated codec.

    * Encoding: the schema id of ``<topic>-value`` is registered (or looked up) once per topic
      and kept; a value is the 5-byte header + the body, byte for byte what RecordSerde writes.
    * Decoding: a value whose writer schema id names exactly kvbus's current schema (parsing
      canonical form, asked once per id) is read by the generated decoder; any other value goes
      through ``RecordSerde.loads``: records of an older or newer registered schema (resolved
      against ours), non-canonical encodings, and broken input, whose error is then RecordSerde's.

    ``auto_register``: as for RecordSerde (False: only look the schema up when encoding).
    ``reader``: decoder of a body at an offset, ``reader(data, 5)`` (default: the record's
    decoder; e.g. :func:`batch_scanner`); it raises WireError to hand a value to RecordSerde.
    ``slow`` is the RecordSerde used as the fallback; ``codec`` the :class:`Codec` (default: ours).
    """

    def __init__(self, registry: SchemaRegistryClient, record: str, auto_register: bool = True,
                 reader: Optional[Callable[[bytes, int], Any]] = None, codec: Codec = CODEC):
        announce(codec)
        self.registry = registry
        self.record = record
        self.auto_register = auto_register
        self.slow = RecordSerde(registry, record, auto_register=auto_register)
        self._write = codec.writers[record]
        self._read = reader or codec.readers[record]
        self._headers: dict[str, bytes] = {}
        self._fast_ids: dict[int, bool] = {}
        self._canonical = canonical_form(codec.records[record])

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
