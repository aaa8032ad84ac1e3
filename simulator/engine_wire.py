"""Encode KV events exactly as a given engine release puts them on the wire.

Used by the synthetic fleet (``kvbus fleet``) and by tests. Pure functions, no zmq.
What each release writes comes from the engine adapters' release tables
(:mod:`kvbus.producers.engines`, the same tables the bridge's decoder is built from); format ids are
:data:`FORMATS` = ``kvbus.producers.engines.FORMATS``.

What each format writes (protocol doc §3-§8, §11):

- envelope ``[ts, events]`` (vllm-0.9.0) or ``[ts, events, dp_rank]`` (all others; a None
  rank is written as nil, as msgspec does for ``array_like`` structs);
- vLLM <= 0.23 and SGLang 0.5.10: events as tagged arrays with **all** fields the release
  declares, trailing None included; later releases: maps ``{"type": ..., ...}`` in
  declaration order with fields that have a default omitted when None (vLLM always writes
  block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name;
  SGLang block_hashes, parent_block_hash, token_ids, block_size, lora_id);
- hashes: unsigned 64-bit ints (vLLM >= 0.10.2), signed int64 (SGLang; vLLM 0.9.x whose
  default ``builtin`` hash was Python's signed ``hash()``), or with ``raw_hashes`` the
  digests of ``block_digests``/``parent_block_digest`` as ``bin`` (vLLM >= 0.10.2 and LMCache);
- ``extra_keys`` (msgpack bytes) is written verbatim; SGLang writes ``token_id_pairs`` as its
  ``token_ids``; lmcache-0.5.6 writes BlockStored mediums lower-case (LMCache's in-process
  path sends "cpu");
- fields a release does not have are dropped; :func:`project` says what a decoder then yields.
"""
from __future__ import annotations

import msgspec
from msgspec import Raw

from kvbus.producers import engines
from kvbus.schemas.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    canonical_hash,
    hash_to_int,
    normalize_medium,
)

__all__ = [
    "FORMATS",
    "WireFormat",
    "wire_format",
    "resolve_format",
    "encode_batch",
    "encode_frames",
    "encode_replay_reply",
    "replay_end",
    "project",
    "END_SEQ",
]

FORMATS = engines.FORMATS
"""Wire-format ids, the first release of each layout change (the engine adapters' release tables)."""

END_SEQ = b"\xff" * 8
"""Sequence frame of the replay end marker."""

WireFormat = engines.Release
"""How one engine release encodes a batch (a row of an adapter's release table)."""

wire_format = engines.release
resolve_format = engines.resolve_format


# -- events ---------------------------------------------------------------------

def _wire_hashes(fmt: WireFormat, ev: BlockStored | BlockRemoved, raw: bool) -> tuple[list, object]:
    parent = getattr(ev, "parent_block_hash", None)
    if raw:
        if ev.block_digests is None or len(ev.block_digests) != len(ev.block_hashes):
            raise ValueError("raw_hashes needs block_digests, one per block hash")
        if parent is not None:
            if ev.parent_block_digest is None:
                raise ValueError("raw_hashes needs parent_block_digest when parent_block_hash is set")
            return list(ev.block_digests), ev.parent_block_digest
        return list(ev.block_digests), None
    s = fmt.signed_hashes
    return [hash_to_int(h, s) for h in ev.block_hashes], (None if parent is None else hash_to_int(parent, s))


def _stored_values(fmt: WireFormat, ev: BlockStored, raw: bool) -> dict[str, object]:
    hashes, parent = _wire_hashes(fmt, ev, raw)
    tokens: list = ev.token_ids
    if fmt.engine == "sglang" and ev.token_id_pairs:
        tokens = ev.token_id_pairs
    medium = ev.medium
    if fmt.lower_stored_medium and medium is not None:
        medium = medium.lower()
    extra = None
    if ev.extra_keys is not None:
        try:
            msgspec.msgpack.decode(ev.extra_keys)
        except msgspec.DecodeError as e:
            raise ValueError(f"extra_keys is not one msgpack value: {e}") from None
        extra = Raw(ev.extra_keys)
    values = {f: getattr(ev, f) for f in fmt.stored}
    values.update(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, medium=medium)
    if "extra_keys" in values:
        values["extra_keys"] = extra
    return values


def _encode_event(fmt: WireFormat, ev: Event, raw: bool) -> object:
    if isinstance(ev, BlockStored):
        tag, fields, required, values = "BlockStored", fmt.stored, fmt.stored_required, _stored_values(fmt, ev, raw)
    elif isinstance(ev, BlockRemoved):
        hashes, _ = _wire_hashes(fmt, ev, raw)
        values = {f: getattr(ev, f) for f in fmt.removed}
        values["block_hashes"] = hashes
        tag, fields, required = "BlockRemoved", fmt.removed, fmt.removed_required
    elif isinstance(ev, AllBlocksCleared):
        return {"type": "AllBlocksCleared"} if fmt.maps else ["AllBlocksCleared"]
    else:
        raise ValueError(f"{type(ev).__name__} is not an engine event "
                         "(engines send BlockStored, BlockRemoved, AllBlocksCleared)")
    if not fmt.maps:
        return [tag, *(values[f] for f in fields)]
    out: dict[str, object] = {"type": tag}
    for k, f in enumerate(fields):
        v = values[f]
        if v is not None or k < required:
            out[f] = v
    return out


_ENCODER = msgspec.msgpack.Encoder()


def encode_batch(
    fmt: str,
    ts: float,
    events: list[Event],
    dp_rank: int | None = 0,
    *,
    raw_hashes: bool = False,
    publisher_id: bytes | None = None,
) -> bytes:
    """The payload (ZMQ frame 2) engine release ``fmt`` publishes for ``events``.

    ``raw_hashes``: send digests (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0); events must carry
    ``block_digests`` (and ``parent_block_digest`` when they have a parent). ``publisher_id``:
    append the reserved 4th envelope element of open vLLM PRs (no release sends it).
    ValueError for an unknown format, a Reset event, or raw_hashes the release cannot send.
    """
    spec = wire_format(fmt)
    if raw_hashes and not spec.bytes_hashes:
        raise ValueError(f"{fmt} cannot send bytes block hashes")
    body = [_encode_event(spec, ev, raw_hashes) for ev in events]
    envelope: list[object] = [float(ts), body]
    if spec.dp_rank:
        envelope.append(dp_rank)
    if publisher_id is not None:
        if not spec.dp_rank:
            envelope.append(None)
        envelope.append(publisher_id)
    return _ENCODER.encode(envelope)


# -- frames ---------------------------------------------------------------------

def encode_frames(topic: str, seq: int, payload: bytes) -> list[bytes]:
    """The live PUB message: ``[topic utf-8, seq 8-byte big-endian, payload]``."""
    return [topic.encode("utf-8"), seq.to_bytes(8, "big"), payload]


def encode_replay_reply(fmt: str, topic: str, seq: int, payload: bytes) -> list[bytes]:
    """One replay reply as the ROUTER sends it after the client identity (and as a DEALER
    receives it): ``[b"", topic, seq8, payload]`` when the release sends the topic frame,
    else ``[b"", seq8, payload]``. The server prepends the identity frame."""
    head = [b"", topic.encode("utf-8")] if wire_format(fmt).replay_topic else [b""]
    return [*head, seq.to_bytes(8, "big"), payload]


def replay_end(fmt: str) -> list[bytes]:
    """The replay end marker after the identity: ``[b"", b"", END_SEQ, b""]`` (with topic
    frame, empty) or ``[b"", END_SEQ, b""]``."""
    head = [b"", b""] if wire_format(fmt).replay_topic else [b""]
    return [*head, END_SEQ, b""]


# -- projection -----------------------------------------------------------------

_STORED_DEFAULTS = {f.name: f.default for f in msgspec.structs.fields(BlockStored) if f.required is False}
_REMOVED_DEFAULTS = {f.name: f.default for f in msgspec.structs.fields(BlockRemoved) if f.required is False}


def project(fmt: str, event: Event, *, raw_hashes: bool = False) -> Event:
    """The normalized event a decoder yields for ``event`` after ``encode_batch(fmt, ...)``.

    Fields the release lacks take their default; medium as the decoder normalizes what
    was sent; digests only with ``raw_hashes`` (hashes then derived from them); SGLang's
    bigram pairs replace token_ids, other engines drop them.
    """
    spec = wire_format(fmt)
    if isinstance(event, AllBlocksCleared):
        return AllBlocksCleared()
    if isinstance(event, BlockStored):
        keep, defaults, cls = spec.stored, _STORED_DEFAULTS, BlockStored
    elif isinstance(event, BlockRemoved):
        keep, defaults, cls = spec.removed, _REMOVED_DEFAULTS, BlockRemoved
    else:
        raise ValueError(f"{type(event).__name__} is not an engine event")
    values = {f: (getattr(event, f) if f in keep else defaults.get(f)) for f in msgspec.structs.asdict(event)}
    for f, d in defaults.items():  # fresh copies of mutable defaults
        if f not in keep and isinstance(d, list):
            values[f] = []
    medium = event.medium
    if medium is not None and "medium" in keep:
        if cls is BlockStored and spec.lower_stored_medium:
            medium = medium.lower()
        values["medium"] = normalize_medium(medium)
    if raw_hashes:
        values["block_hashes"] = [canonical_hash(d) for d in event.block_digests or []]
        values["block_digests"] = list(event.block_digests or []) or None  # [] on the wire says nothing
        if cls is BlockStored:
            pd = None if event.parent_block_hash is None else event.parent_block_digest
            values["parent_block_hash"] = None if pd is None else canonical_hash(pd)
            values["parent_block_digest"] = pd
    if cls is BlockStored:
        pairs = event.token_id_pairs if spec.engine == "sglang" else None
        values["token_id_pairs"] = pairs or None
        if pairs:
            values["token_ids"] = []
    return cls(**values)
