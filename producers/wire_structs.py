"""Typed msgspec structs of the engines' wire events, used by :mod:`kvbus.producers.decode`.

The layouts are derived from the engine adapters' release tables (:mod:`kvbus.producers.engines`);
this module adds the msgspec type of each wire field (:data:`WIRE_TYPES`).

Three layouts exist (protocol doc §3, §4, §7):

- **maps** (vLLM >= 0.24, SGLang >= 0.5.20): ``{"type": "<ClassName>", field: value, ...}``.
  One struct per event type holds the union of every field vLLM and SGLang ever
  sent; keys we do not know are ignored, and every field but ``block_hashes``
  defaults to None/[]/0 so an engine that stops sending a field still decodes.
- **vLLM tagged arrays** (0.9.0 - 0.23): ``["BlockStored", f1, f2, ...]``. Each
  field vLLM added in the array era was appended at the end of the array at the
  time (``medium`` 0.10.2 and ``lora_name`` 0.14 were required fields added while
  no defaulted field existed yet), so element *k* means the same thing in every
  version and one struct decodes them all: elements an older version lacks take
  their default, elements a newer one adds are ignored by msgspec.
- **SGLang tagged arrays** (<= 0.5.19): same first seven elements as vLLM
  (``medium`` at index 6), then SGLang's own ``cache_salt, session_id, lora_name``.

Each BlockStored layout exists three times: with ``token_ids: list[int]`` (the fast
path), with SGLang's EAGLE bigram ``token_ids: list[[a, b]]``, and without the prompt's
tokens (:data:`TOKENLESS_STORED`, what bridges decode unless ``KVBUS_KEEP_TOKEN_IDS`` is on).

Integer fields carry the ranges the Avro schema can hold (``int`` = 32 bit,
``long`` = 64 bit) and lists carry the size limits below, so msgspec rejects
what kvbus cannot represent while it decodes, in C.
"""
from __future__ import annotations

from typing import Annotated, Any, Optional, Union

import msgspec
from msgspec import Meta, Raw

from kvbus.producers.engines import ADAPTERS, ENGINE_EVENTS, SENT
from kvbus.producers.engines.convert import RULES
from kvbus.schemas.events import TOKEN_FIELDS

MAX_EVENTS_PER_BATCH = 1_000_000
"""More events than this in one batch is rejected as absurd (vLLM publishes one batch per engine step)."""
MAX_HASHES_PER_EVENT = 1_000_000
"""More block hashes than this in one event is rejected (10^6 blocks of 16 tokens = 16M tokens)."""
MAX_TOKENS_PER_EVENT = 1 << 26
"""More token ids (or bigram pairs, or lookahead lists) than this in one event is rejected."""
MAX_DIGEST_BYTES = 64
"""A bytes block hash is a digest: 16 (xxh3_128) or 32 (sha256) bytes; 1..64 accepted."""

Int32 = Annotated[int, Meta(ge=-(2**31), le=2**31 - 1)]
"""Avro ``int``."""
NonNegInt32 = Annotated[int, Meta(ge=0, le=2**31 - 1)]
"""Avro ``int`` that cannot be negative (block_size, dp_rank)."""
Int64 = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]
"""Avro ``long``."""
Digest = Annotated[bytes, Meta(min_length=1, max_length=MAX_DIGEST_BYTES)]
"""A raw digest sent as msgpack ``bin``."""
Hash = Union[int, Digest]
"""An engine block hash: unsigned (vLLM) or signed (SGLang, vLLM builtin hash) 64-bit int, or a digest."""
Hashes = Annotated[list[Hash], Meta(max_length=MAX_HASHES_PER_EVENT)]
Tokens = Annotated[list[Int64], Meta(max_length=MAX_TOKENS_PER_EVENT)]
TokenLists = Annotated[
    list[Annotated[list[Int64], Meta(max_length=MAX_TOKENS_PER_EVENT)]],
    Meta(max_length=MAX_TOKENS_PER_EVENT),
]
"""SGLang bigram pairs, vLLM lookahead token lists."""

# (name, type, default); default _REQ = required (positional in arrays).
_REQ = object()
_TOKENS = object()
"""Placeholder type of ``token_ids``: :data:`Tokens` or, for bigram pairs, :data:`TokenLists`."""

WIRE_TYPES: dict[str, tuple[Any, Any]] = {
    "block_hashes": (Hashes, _REQ),
    "parent_block_hash": (Optional[Hash], None),
    "token_ids": (_TOKENS, []),
    "block_size": (NonNegInt32, 0),
    "lora_id": (Optional[Int64], None),
    "extra_keys": (Raw, None),  # exact msgpack bytes of the value; None = absent
    "group_idx": (Optional[Int32], None),
    "kv_cache_spec_sliding_window": (Optional[Int32], None),
    "lookahead_token_ids": (Optional[TokenLists], None),
}
"""Wire field -> (msgspec type, default when absent) of the fields whose wire type is not the kvbus
event struct's: engine hashes (ints or digests), the Avro ranges of ints, size limits, raw msgpack,
bigram pairs. Any other field a release table names (``medium``, ``lora_name``, ``session_id``, ...)
is decoded with its type and default in :mod:`kvbus.schemas.events` (:func:`wire_type`), so a new
optional field that engines send as kvbus stores it needs no entry here."""


def wire_type(name: str) -> tuple[Any, Any]:
    """(msgspec type, default) of wire field ``name``: :data:`WIRE_TYPES`, else the field of the same
    name in the kvbus BlockStored / BlockRemoved struct."""
    if name in WIRE_TYPES:
        return WIRE_TYPES[name]
    for cls in ENGINE_EVENTS.values():
        for f in msgspec.structs.fields(cls):
            if f.name == name:
                if f.default is not msgspec.NODEFAULT:
                    return f.type, f.default
                if f.default_factory is not msgspec.NODEFAULT:
                    return f.type, f.default_factory()
                return f.type, _REQ
    raise KeyError(f"wire field {name!r} has no type: not in WIRE_TYPES nor in the kvbus event structs")


ARRAY_REQUIRED = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id")
"""Fields every tagged array carries (vLLM 0.9.0's five positions after the tag): required there."""


def _layouts() -> dict[str, tuple[tuple[str, ...], tuple[str, ...]]]:
    """Decoding layout -> (BlockStored fields, BlockRemoved fields), from the release tables: "map"
    takes every field of every family, each array layout its family's (:meth:`Adapter.array_fields`)."""
    out = {"map": (SENT["BlockStored"], SENT["BlockRemoved"])}
    for adapter in ADAPTERS.values():
        if adapter.array_layout:
            out[adapter.array_layout] = adapter.array_fields()
    return out


LAYOUT_FIELDS = _layouts()
"""Decoding layout ("map", "vllm", "sglang") -> (BlockStored fields, BlockRemoved fields) in wire order."""


def _spec(layout: str, names: tuple[str, ...], tokens: Any) -> list[tuple[str, Any, Any]]:
    out = []
    for n in names:
        t, d = wire_type(n)
        if layout != "map" and n in ARRAY_REQUIRED:
            d = _REQ
        out.append((n, tokens if t is _TOKENS else t, d))
    return out


def _fields(spec: list[tuple[str, Any, Any]]) -> list[tuple]:
    return [(n, t) if d is _REQ else (n, t, d) for n, t, d in spec]


def _stored_spec(layout: str, tokens: Any) -> list[tuple[str, Any, Any]]:
    """Field list of BlockStored in ``layout``."""
    return _spec(layout, LAYOUT_FIELDS[layout][0], tokens)


def _removed_spec(layout: str) -> list[tuple[str, Any, Any]]:
    """Field list of BlockRemoved in ``layout``."""
    return _spec(layout, LAYOUT_FIELDS[layout][1], None)


def _struct(name: str, tag: str, layout: str, spec: list[tuple[str, Any, Any]]) -> type:
    if layout == "map":
        return msgspec.defstruct(name, _fields(spec), tag=tag, tag_field="type", kw_only=True, gc=False)
    return msgspec.defstruct(name, _fields(spec), tag=tag, array_like=True, gc=False)


LAYOUTS = tuple(LAYOUT_FIELDS)
"""Decoding layouts: "map", then each family's tagged-array layout."""

STORED: dict[str, type] = {
    lay: _struct(f"Stored_{lay}", "BlockStored", lay, _stored_spec(lay, Tokens)) for lay in LAYOUTS
}
"""BlockStored per layout, token_ids as ints."""
STORED_PAIRS: dict[str, type] = {
    lay: _struct(f"StoredPairs_{lay}", "BlockStored", lay, _stored_spec(lay, TokenLists)) for lay in LAYOUTS
}
"""BlockStored per layout, token_ids as SGLang bigram pairs."""


def carries_tokens(name: str) -> bool:
    """Whether wire field ``name`` becomes only prompt-token fields of the kvbus event
    (:data:`kvbus.schemas.events.TOKEN_FIELDS`): ``token_ids``, ``lookahead_token_ids``."""
    outputs = RULES[name].outputs if name in RULES else (name,)
    return set(outputs) <= set(TOKEN_FIELDS)


def _tokenless_spec(layout: str) -> list[tuple[str, Any, Any]]:
    """BlockStored's field list in ``layout`` without the token fields (:func:`carries_tokens`): a map
    leaves them out, and msgspec skips unknown keys without building their values; an array keeps each
    position as ``skipped_<field>``, a :class:`msgspec.Raw` (a view of the bytes), which no conversion reads."""
    out = []
    for n, t, d in _stored_spec(layout, Tokens):
        if not carries_tokens(n):
            out.append((n, t, d))
        elif layout != "map":
            out.append((f"skipped_{n}", Raw, d))
    return out


TOKENLESS_STORED: dict[str, type] = {
    lay: _struct(f"Tokenless_{lay}", "BlockStored", lay, _tokenless_spec(lay)) for lay in LAYOUTS
}
"""BlockStored per layout, its prompt tokens skipped (``KVBUS_KEEP_TOKEN_IDS`` off): the kvbus event
gets the token fields' defaults."""
REMOVED: dict[str, type] = {
    lay: _struct(f"Removed_{lay}", "BlockRemoved", lay, _removed_spec(lay)) for lay in LAYOUTS
}
CLEARED: dict[str, type] = {lay: _struct(f"Cleared_{lay}", "AllBlocksCleared", lay, []) for lay in LAYOUTS}

ARRAY_FIELDS: dict[tuple[str, str], tuple[str, ...]] = {
    (lay, tag): tuple(f[0] for f in spec)
    for lay in LAYOUTS[1:]
    for tag, spec in (("BlockStored", _stored_spec(lay, Tokens)), ("BlockRemoved", _removed_spec(lay)))
}
"""Field name at array index k+1, for error messages."""

EVENT_TAGS = tuple(ENGINE_EVENTS)
"""Event types the engines publish."""


def envelope(layout: str, stored: dict[str, type] = STORED) -> type:
    """The batch envelope ``[ts, events, dp_rank?, ...]`` with events of one layout, BlockStored as
    ``stored`` has it (:data:`STORED` or :data:`TOKENLESS_STORED`).

    Elements after dp_rank (the reserved ``publisher_id`` of open vLLM PRs) are ignored.
    """
    union = Union[stored[layout], REMOVED[layout], CLEARED[layout]]  # type: ignore[valid-type]
    return msgspec.defstruct(
        f"Envelope_{stored[layout].__name__}",
        [
            ("ts", float),
            ("events", Annotated[list[union], Meta(max_length=MAX_EVENTS_PER_BATCH)]),
            ("dp_rank", Optional[NonNegInt32], None),
        ],
        array_like=True,
        gc=False,
    )


ENVELOPE_DECODERS: dict[str, msgspec.msgpack.Decoder] = {
    lay: msgspec.msgpack.Decoder(envelope(lay)) for lay in LAYOUTS
}
"""Fast-path decoders: a whole batch whose events all use one layout."""
TOKENLESS_ENVELOPE_DECODERS: dict[str, msgspec.msgpack.Decoder] = {
    lay: msgspec.msgpack.Decoder(envelope(lay, TOKENLESS_STORED)) for lay in LAYOUTS
}
"""The same, prompt tokens skipped (:data:`TOKENLESS_STORED`)."""
