"""Decode engine KV-event payloads (ZMQ frame 2) into :mod:`kvbus.schemas.events` structs.

Every wire format of ``shared/docs/kv-events-protocol.md`` is accepted:

- envelope ``[ts, events]`` (vLLM 0.9.0), ``[ts, events, dp_rank]`` (vLLM >= 0.9.2,
  SGLang); further elements (the reserved ``publisher_id`` of open vLLM PRs) are ignored;
- events as **maps** (vLLM >= 0.24, SGLang >= 0.5.20), decoded by name, unknown keys ignored;
- events as **tagged arrays** (vLLM 0.9.0 - 0.23, SGLang <= 0.5.19), decoded by position
  (see :mod:`kvbus.producers.wire_structs` for why one layout per engine covers every length).

Conversion: the one conversion of engine events, :data:`kvbus.producers.engines.CONVERSION`, shared
with the in-process publisher and generated from the release tables and the kvbus structs: hashes
become canonical 8-byte values (signed ints by their two's complement, bytes digests by their last 8
bytes with the digest kept in ``block_digests``); ``medium`` is upper-cased, unknown values kept;
``extra_keys`` is kept as the exact msgpack bytes the engine sent; SGLang bigram ``token_ids`` pairs go
to ``token_id_pairs`` (``token_ids`` then []); every other field is copied.

**vLLM vs SGLang arrays with engine="auto".** Up to index 6 (``medium``) both layouts agree; after it
they differ. Each array is read with the layout of the one family that could have sent it, by the
rule :func:`kvbus.producers.engines.array_layout` (whose module doc gives examples, and which
``--engine auto`` labelling uses too); an array that fits both families or neither is read as vLLM.
When index 7.. are all None both readings give the same event. (Per the protocol doc SGLang's arrays
stopped at ``medium``; the longer layout is accepted defensively.) ``engine="sglang"`` / ``"vllm"``
force a layout.

**Bad input** raises :class:`DecodeError` whose message says what is wrong; the bridge
dead-letters the whole batch. Unknown event types raise too (unless ``skip_unknown``).
Only what kvbus cannot represent or what no engine can send is rejected: values out of
the Avro ranges, negative ``block_size``/``dp_rank``, mixed int/bytes hashes in one
event, and the size limits ``MAX_*`` (re-exported from :mod:`kvbus.producers.wire_structs`).
``len(token_ids) == block_size * len(block_hashes)`` is deliberately **not** enforced:
LMCache's last chunk and vLLM's partial-block and placeholder events break it.

**Speed.** A batch is first decoded in one msgspec call with a typed decoder for the
common layouts (maps; vLLM or SGLang arrays). Anything unusual (bigram pairs, mixed
layouts, an ambiguous array, an error) falls back to a per-event path, which is the
reference and produces the precise error messages; both give identical results.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated, Any, Optional

import msgspec
from msgspec import Meta, Raw

from kvbus.producers.engines import CONVERSION, DEFAULT_ARRAY_LAYOUT, FORMATS, array_layout
from kvbus.producers.wire_structs import (
    ARRAY_FIELDS,
    CLEARED,
    ENVELOPE_DECODERS,
    EVENT_TAGS,
    LAYOUTS,
    MAX_DIGEST_BYTES,
    MAX_EVENTS_PER_BATCH,
    MAX_HASHES_PER_EVENT,
    MAX_TOKENS_PER_EVENT,
    REMOVED,
    STORED,
    STORED_PAIRS,
    TOKENLESS_ENVELOPE_DECODERS,
    TOKENLESS_STORED,
    NonNegInt32,
)
from kvbus.schemas.events import Event, MixedHashes

__all__ = [
    "ENGINE_FORMATS",
    "ENGINES",
    "END_SEQ",
    "DecodeError",
    "DecodedBatch",
    "decode_batch",
    "parse_frames",
    "parse_replay_reply",
    "MAX_EVENTS_PER_BATCH",
    "MAX_HASHES_PER_EVENT",
    "MAX_TOKENS_PER_EVENT",
    "MAX_DIGEST_BYTES",
    "MAX_SEQ",
]

ENGINE_FORMATS: tuple[str, ...] = FORMATS
"""Wire-format ids: each is the first release of a layout change, from the engine adapters' release
tables (:mod:`kvbus.producers.engines`; protocol doc §4 field history, §7, §8). A release between two ids
speaks the older one (vLLM 0.27 = "vllm-0.26"). ``kvbus.simulator.engine_wire.FORMATS`` is the same tuple."""

ENGINES = ("auto", *LAYOUTS[1:])
"""Values of ``decode_batch(engine=...)``: "auto", or a family's array layout ("vllm", "sglang")."""

END_SEQ = b"\xff" * 8
"""Sequence frame of the replay end marker: (-1).to_bytes(8, "big", signed=True)."""


class DecodeError(ValueError):
    """A payload or frame set no engine could have sent; the message says what is wrong."""


@dataclass(slots=True)
class DecodedBatch:
    """One decoded engine batch."""

    ts: float
    """Engine wall-clock time of the batch, epoch seconds."""
    events: list[Event]
    """Normalized events in emission order."""
    dp_rank: int | None
    """Data-parallel rank from the envelope; None when absent (vLLM 0.9.0) or nil."""
    unknown_events: int = 0
    """Events of unknown type skipped; always 0 unless ``skip_unknown=True`` (else they raise)."""


_CONVERT: dict[type, Any] = {
    cls: CONVERSION.converter(cls, tag)
    for lay in LAYOUTS
    for tag, cls in (("BlockStored", STORED[lay]), ("BlockStored", STORED_PAIRS[lay]),
                     ("BlockStored", TOKENLESS_STORED[lay]),
                     ("BlockRemoved", REMOVED[lay]), ("AllBlocksCleared", CLEARED[lay]))
}
"""Wire struct -> its conversion to the kvbus struct (:data:`kvbus.producers.engines.CONVERSION`)."""
_DEFAULT_STORED = (STORED[DEFAULT_ARRAY_LAYOUT], TOKENLESS_STORED[DEFAULT_ARRAY_LAYOUT])
_NIL_OR_ARRAY = frozenset([0xC0, 0xDC, 0xDD, *range(0x90, 0xA0)])


# -- decode_batch --------------------------------------------------------------

def decode_batch(payload: bytes, engine: str = "auto", *, skip_unknown: bool = False,
                 keep_tokens: bool = True) -> DecodedBatch:
    """Decode one engine batch (ZMQ frame 2) of any supported engine/version.

    ``engine``: "auto" (detect per event, see module doc), "vllm" or "sglang" (use that
    engine's array layout; maps decode by name either way). ``skip_unknown``: skip and
    count events of unknown type instead of raising. ``keep_tokens=False``: the prompt's tokens
    (:data:`kvbus.schemas.events.TOKEN_FIELDS`) are skipped by msgspec, never built as Python
    ints, and the events carry the fields' defaults; nothing about them is validated then
    (the bridges' default, ``KVBUS_KEEP_TOKEN_IDS``). Raises :class:`DecodeError`.
    """
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    try:
        return _decode_batch(payload, engine, skip_unknown, keep_tokens)
    except RecursionError:
        # msgspec raises RecursionError (not a MsgspecError) for nesting deeper than the
        # interpreter's recursion limit, e.g. ``[[[[...]]]]`` 2,000 levels deep as an event or an
        # extra_keys value; uncaught, it would escape the bridge's DecodeError handling and kill
        # the bridge process. No engine nests that deep: reject the batch.
        raise DecodeError("payload is nested too deeply to decode") from None


def _decode_batch(payload: bytes, engine: str, skip_unknown: bool, keep_tokens: bool) -> DecodedBatch:
    decoders = ENVELOPE_DECODERS if keep_tokens else TOKENLESS_ENVELOPE_DECODERS
    for layout in ("map", DEFAULT_ARRAY_LAYOUT if engine == "auto" else engine):
        try:
            env = decoders[layout].decode(payload)
        except msgspec.MsgspecError:
            continue
        try:
            events = [_CONVERT[type(w)](w) for w in env.events]
        except MixedHashes:
            break
        if engine == "auto" and layout == DEFAULT_ARRAY_LAYOUT and any(
            type(w) in _DEFAULT_STORED and _maybe_other_layout(w) for w in env.events
        ):
            break
        return DecodedBatch(env.ts, events, env.dp_rank, 0)
    return _decode_per_event(payload, engine, skip_unknown, keep_tokens)


def _maybe_other_layout(w: Any) -> bool:
    """Fast-path guard: could engine="auto" read this BlockStored array, decoded with the default layout,
    as another family's (:func:`kvbus.producers.engines.array_layout`) and get another event? The
    readings agree up to ``medium``, and an int at index 9 or more than 10 elements rule SGLang out, so
    only index 7 and 8 can differ: a list at index 8 rules SGLang out (its ``session_id`` is a string),
    anything else there but nil goes to the per-event path, which applies the rule; a string at index 7
    asks the rule."""
    ek = w.extra_keys
    if ek:
        first = memoryview(ek)[0]
        if first not in _NIL_OR_ARRAY:
            return True
        if first != 0xC0:
            return False
    if w.lora_name is None:
        return False
    tokens = getattr(w, "token_ids", [])  # a tokenless struct skipped them: any list reads alike here
    head = ["BlockStored", w.block_hashes, w.parent_block_hash, tokens, w.block_size, w.lora_id, w.medium, w.lora_name]
    return array_layout(head) != DEFAULT_ARRAY_LAYOUT


_PARTS = msgspec.msgpack.Decoder(list[Raw])
_TS = msgspec.msgpack.Decoder(float)
_EVENTS = msgspec.msgpack.Decoder(Annotated[list[Raw], Meta(max_length=MAX_EVENTS_PER_BATCH)])
_RANK = msgspec.msgpack.Decoder(Optional[NonNegInt32])
_ANY = msgspec.msgpack.Decoder()
_DECODERS: dict[type, msgspec.msgpack.Decoder] = {
    cls: msgspec.msgpack.Decoder(cls) for cls in _CONVERT
}
_STRUCTS = {
    (lay, tag): cls
    for lay in LAYOUTS
    for tag, cls in (("BlockRemoved", REMOVED[lay]), ("AllBlocksCleared", CLEARED[lay]))
}
_AT_INDEX = re.compile(r"at `\$\[(\d+)\]")


def _part(decoder: msgspec.msgpack.Decoder, raw: Raw, what: str) -> Any:
    try:
        return decoder.decode(raw)
    except msgspec.MsgspecError as e:
        raise DecodeError(f"{what}: {e}") from None


def _decode_per_event(payload: bytes, engine: str, skip_unknown: bool, keep_tokens: bool = True) -> DecodedBatch:
    """Reference decoder: envelope element by element, then each event on its own."""
    try:
        parts = _PARTS.decode(payload)
    except msgspec.ValidationError as e:
        raise DecodeError(f"envelope must be an array [ts, events, dp_rank]: {e}") from None
    except msgspec.DecodeError as e:
        raise DecodeError(f"payload is not valid msgpack: {e}") from None
    if len(parts) < 2:
        raise DecodeError(f"envelope has {len(parts)} element(s), expected [ts, events] or [ts, events, dp_rank]")
    ts = _part(_TS, parts[0], "envelope ts")
    raws = _part(_EVENTS, parts[1], "envelope events")
    dp_rank = _part(_RANK, parts[2], "envelope dp_rank") if len(parts) > 2 else None
    events: list[Event] = []
    unknown = 0
    for i, raw in enumerate(raws):
        ev = _decode_event(raw, engine, i, skip_unknown, keep_tokens)
        if ev is None:
            unknown += 1
        else:
            events.append(ev)
    return DecodedBatch(ts, events, dp_rank, unknown)


def _decode_event(raw: Raw, engine: str, i: int, skip_unknown: bool, keep_tokens: bool) -> Event | None:
    obj = _ANY.decode(raw)
    if isinstance(obj, dict):
        layout, tag, tokens = "map", obj.get("type"), obj.get("token_ids")
        if not isinstance(tag, str):
            raise DecodeError(f"event {i}: map without a string 'type' key")
    elif isinstance(obj, list):
        if not obj or not isinstance(obj[0], str):
            raise DecodeError(f"event {i}: array does not start with an event type string")
        tag, tokens = obj[0], (obj[3] if len(obj) > 3 else None)
        layout = engine if engine != "auto" else array_layout(obj)
    else:
        raise DecodeError(f"event {i}: expected a map or a tagged array, got {type(obj).__name__}")
    if tag not in EVENT_TAGS:
        if skip_unknown:
            return None
        raise DecodeError(f"event {i}: unknown event type {tag!r}")
    if tag == "BlockStored":
        pairs = isinstance(tokens, list) and bool(tokens) and isinstance(tokens[0], list)
        cls = (TOKENLESS_STORED if not keep_tokens else STORED_PAIRS if pairs else STORED)[layout]
    else:
        cls = _STRUCTS[(layout, tag)]
    try:
        w = _DECODERS[cls].decode(raw)
        return _CONVERT[cls](w)
    except msgspec.ValidationError as e:
        raise DecodeError(f"event {i} ({tag}): {_describe(str(e), layout, tag)}") from None
    except MixedHashes as e:
        raise DecodeError(f"event {i} ({tag}): {e}") from None


def _describe(msg: str, layout: str, tag: str) -> str:
    """Name the field an array-position error is about."""
    m = _AT_INDEX.search(msg)
    names = ARRAY_FIELDS.get((layout, tag))
    if m and names and 0 < int(m.group(1)) <= len(names):
        return f"{msg} ({layout} array field {names[int(m.group(1)) - 1]})"
    return msg


# -- frames ---------------------------------------------------------------------

def _b(frame: Any) -> bytes:
    return frame if type(frame) is bytes else bytes(frame)


def _seq(frame: Any) -> int:
    b = _b(frame)
    if len(b) != 8:
        raise DecodeError(f"sequence frame must be 8 bytes (big-endian uint64), got {len(b)}")
    return int.from_bytes(b, "big")


def _topic(frame: Any) -> str:
    try:
        return _b(frame).decode("utf-8")
    except UnicodeDecodeError as e:
        raise DecodeError(f"topic frame is not UTF-8: {e}") from None


MAX_SEQ = 2**63 - 1
"""Largest sequence number kvbus can carry (``EventBatch.seq`` is an Avro long)."""


def _in_range(seq: int) -> int:
    # A seq frame of 2^63 or more (e.g. ff*8 on the live socket) would be sequenced and then written
    # by the fast encoder as a varint no Avro reader decodes to the same number (fast reader
    # -2^64, fastavro -2^63): an invalid record on kvbus.raw. No engine counts that far; reject the
    # frame set instead.
    if seq > MAX_SEQ:
        raise DecodeError(f"sequence number {seq} is beyond the int64 range EventBatch.seq can hold")
    return seq


def parse_frames(frames: list[bytes]) -> tuple[str, int, bytes]:
    """A live PUB message ``[topic, seq8, payload]`` -> ``(topic, seq, payload)``.

    Raises :class:`DecodeError` on a frame count other than 3, a seq frame not 8 bytes or a seq
    above :data:`MAX_SEQ`.
    """
    if len(frames) != 3:
        raise DecodeError(f"live message must have 3 frames [topic, seq, payload], got {len(frames)}")
    topic, seq, payload = frames
    return _topic(topic), _in_range(_seq(seq)), _b(payload)


def parse_replay_reply(frames: list[bytes]) -> tuple[str, int, bytes] | None:
    """A replay reply as a DEALER receives it, empty delimiter first.

    ``[b"", topic, seq8, payload]`` (vLLM >= 0.26, SGLang 0.5.23) or ``[b"", seq8, payload]``
    (vLLM <= 0.25; topic returned as ""). Returns None for the end marker (seq ff*8 or an
    empty payload). Raises :class:`DecodeError` on any other shape.
    """
    n = len(frames)
    if n not in (3, 4):
        raise DecodeError(f"replay reply must have 3 or 4 frames ([b'', topic?, seq, payload]), got {n}")
    if len(_b(frames[0])) != 0:
        raise DecodeError("replay reply must start with the empty delimiter frame")
    if n == 4:
        topic, seq, payload = _topic(frames[1]), _seq(frames[2]), _b(frames[3])
    else:
        topic, seq, payload = "", _seq(frames[1]), _b(frames[2])
    if seq == 0xFFFF_FFFF_FFFF_FFFF or not payload:
        return None
    return topic, _in_range(seq), payload
