"""The normalized KV-cache event model shared by every kvbus stage.

Engines (vLLM 0.9 -> 0.33, SGLang 0.5.x, LMCache inside vLLM) send many wire
layouts; producers decode them all into these structs, which mirror the Avro
schemas in ``schemas/avro`` field for field (``kvbus.schemas.avro`` converts).

Normalization rules (see ``shared/docs/kv-events-protocol.md``):
- block hashes are 8 bytes big-endian (:func:`canonical_hash`); a full digest
  the engine sent as bytes is kept in ``block_digests``;
- ``medium`` is upper-cased, unknown values kept;
- ``extra_keys`` is carried losslessly as msgpack bytes.
"""
from __future__ import annotations

import struct
from typing import Any, Union

import msgspec

HASH_MASK = (1 << 64) - 1

#: Medium values vLLM and SGLang publish (after upper-casing). Others are kept as sent.
KNOWN_MEDIUMS = ("GPU", "CPU", "STORAGE", "FS", "OBJ", "CPU_PINNED", "DISK", "EXTERNAL")


_U64 = struct.Struct(">Q").pack
"""An unsigned 64-bit int as its canonical hash (8 bytes big-endian); struct.error for anything else."""


def _of_digest(d: bytes) -> bytes:
    """The canonical hash of a digest: its last 8 bytes (zero-padded on the left when shorter)."""
    return d[-8:] if len(d) >= 8 else d.rjust(8, b"\0")


def canonical_hash(value: int | bytes) -> bytes:
    """Map any engine block hash to kvbus's canonical 8-byte big-endian form.

    ``int``: unsigned vLLM values as is, signed SGLang values by their
    two's-complement bit pattern. ``bytes``: a raw digest, its last 8 bytes
    (what vLLM publishes as an int when VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1).
    """
    if isinstance(value, int):
        return _U64(value & HASH_MASK)
    if isinstance(value, (bytes, bytearray, memoryview)):
        return _of_digest(bytes(value))
    raise TypeError(f"block hash must be int or bytes, got {type(value).__name__}")


class MixedHashes(ValueError):
    """One event's block hashes mix int and bytes values (no engine sends that)."""


def canonical_hashes(hashes: list) -> tuple[list[bytes], list[bytes] | None]:
    """An event's engine block hashes as ``(canonical 8-byte hashes, digests)``: ints (vLLM
    unsigned, SGLang signed) give ``digests`` None; bytes digests give their last 8 bytes and the
    digests themselves (as ``bytes``), which events keep in ``block_digests``.

    ``hashes`` is a sequence (list or tuple). The one normalization of the bridge's decoder and the
    in-process publisher. Hot path: unsigned ints (vLLM) are packed by ``struct`` with no Python-level
    loop, one hash (vLLM evicts one per event) with no list to map over. Raises :class:`MixedHashes`
    for ints and bytes mixed."""
    try:
        if len(hashes) == 1:
            return [_U64(hashes[0])], None
        return list(map(_U64, hashes)), None
    except struct.error:  # signed ints (SGLang), or digests
        pass
    try:
        return [_U64(h & HASH_MASK) for h in hashes], None
    except TypeError:  # bytes & int
        pass
    if any(type(h) is int for h in hashes):
        raise MixedHashes("block_hashes mixes int and bytes hashes")
    digests = [h if type(h) is bytes else bytes(h) for h in hashes]
    return list(map(_of_digest, digests)), digests


def canonical_parent(value: int | bytes | None) -> tuple[bytes | None, bytes | None]:
    """A parent block hash as ``(canonical 8-byte hash, digest)``: None gives ``(None, None)``, an
    int ``(hash, None)``, bytes ``(last 8 bytes, the digest)`` (see :func:`canonical_hashes`)."""
    if value is None:
        return None, None
    if type(value) is int:
        try:
            return _U64(value), None
        except struct.error:  # signed
            return _U64(value & HASH_MASK), None
    d = value if type(value) is bytes else bytes(value)
    return _of_digest(d), d


def hash_to_int(h: bytes, signed: bool = False) -> int:
    """The canonical hash as the integer an engine publishes: unsigned 64-bit (vLLM's default), or with
    ``signed`` the int64 of the same bits (SGLang; vLLM 0.9's builtin hash). The inverse of
    :func:`canonical_hash` on ints."""
    return int.from_bytes(h, "big", signed=signed)


def normalize_medium(medium: Any) -> str | None:
    """The medium rule: a medium name upper-cased, unknown names kept; None stays None; any other value
    (an engine's enum member, say) by its ``str()``, upper-cased."""
    if isinstance(medium, str):
        return medium.upper()
    return None if medium is None else str(medium).upper()


class BlockStored(msgspec.Struct, tag=True, omit_defaults=True, kw_only=True):
    """A run of consecutive full blocks is now cached. Fields: see ``kvbus.BlockStored.avsc``."""

    block_hashes: list[bytes]
    """Canonical 8-byte hashes of consecutive full blocks, oldest first."""
    parent_block_hash: bytes | None = None
    """Hash of the block before ``block_hashes[0]``; None at the start of a prefix."""
    token_ids: list[int] = []
    """``len(block_hashes) * block_size`` tokens; [] in placeholder events or with token_id_pairs."""
    block_size: int = 0
    """Tokens per block of the emitting KV group; 0 in placeholder events."""
    lora_id: int | None = None
    """LoRA adapter id; None without LoRA."""
    medium: str | None = None
    """GPU, CPU, STORAGE, FS, OBJ, CPU_PINNED, DISK, EXTERNAL or any other upper-cased value; None if unsaid."""
    lora_name: str | None = None
    """LoRA adapter name; None without LoRA. Not part of the event identity."""
    extra_keys: bytes | None = None
    """msgpack encoding of the engine's per-block extra keys; None when absent."""
    group_idx: int | None = None
    """KV-cache group index (hybrid models); None when not sent."""
    kv_cache_spec_kind: str | None = None
    """Attention kind of the group (full_attention, sliding_window, mamba, ...); None when not sent."""
    kv_cache_spec_sliding_window: int | None = None
    """Window size of sliding-window groups; None otherwise."""
    locality: str | None = None
    """LOCAL or REMOTE relative to the publisher; None = unspecified."""
    ownership: str | None = None
    """Secondary offloading tier that holds the blocks (e.g. "kvcr"); None = the framework's own cache."""
    session_id: str | None = None
    """Request/session that triggered the report; attribution only."""
    lookahead_token_ids: list[list[int]] | None = None
    """Per block, lookahead tokens that were part of its hash; None when unused."""
    cache_salt: str | None = None
    """SGLang cache salt; None when absent."""
    token_id_pairs: list[list[int]] | None = None
    """SGLang EAGLE bigram token pairs; None otherwise."""
    block_digests: list[bytes] | None = None
    """Full digests when the engine sent bytes hashes; None when it sent ints."""
    parent_block_digest: bytes | None = None
    """Full digest of the parent when the engine sent bytes; None otherwise."""


TOKEN_FIELDS: tuple[str, ...] = ("token_ids", "lookahead_token_ids", "token_id_pairs")
"""The BlockStored fields that hold the prompt's tokens. Producers leave them at their defaults unless
``KVBUS_KEEP_TOKEN_IDS`` is on (:attr:`kvbus.runtime.settings.Settings.keep_token_ids`): the block hashes
already commit to the tokens, no stage reads them, and they are the users' prompts."""


_TOKENLESS: dict[str, Any] = {
    f.name: f.default_factory() if f.default_factory is not msgspec.NODEFAULT else f.default
    for f in msgspec.structs.fields(BlockStored) if f.name in TOKEN_FIELDS
}
"""The defaults of :data:`TOKEN_FIELDS`."""


def without_tokens(event: Event) -> Event:
    """``event`` with its :data:`TOKEN_FIELDS` at their defaults (the same object when they are)."""
    if type(event) is not BlockStored or all(getattr(event, f) == d for f, d in _TOKENLESS.items()):
        return event
    return msgspec.structs.replace(event, **_TOKENLESS)


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True, kw_only=True):
    """Blocks were evicted from the given medium. Fields: see ``kvbus.BlockRemoved.avsc``."""

    block_hashes: list[bytes]
    """Canonical 8-byte hashes of the evicted blocks."""
    medium: str | None = None
    """Medium the blocks left (upper-cased); None when unsaid."""
    group_idx: int | None = None
    """KV-cache group; None when not sent."""
    locality: str | None = None
    """LOCAL or REMOTE; None = unspecified."""
    ownership: str | None = None
    """Secondary tier the blocks left; None = the framework's own cache."""
    block_digests: list[bytes] | None = None
    """Full digests when the engine sent bytes; None otherwise."""


class AllBlocksCleared(msgspec.Struct, tag=True):
    """The engine's whole prefix cache was reset."""


class Reset(msgspec.Struct, tag=True, omit_defaults=True, kw_only=True):
    """kvbus reset marker: drop everything known about this (replica, dp_rank)."""

    reason: str
    """engine-restart, gap-unrecoverable or bridge-start."""
    missing_from: int | None = None
    """First lost sequence number for a gap; None otherwise."""
    missing_to: int | None = None
    """Last lost sequence number (inclusive) for a gap; None otherwise."""


Event = Union[BlockStored, BlockRemoved, AllBlocksCleared, Reset]
"""Any event kvbus carries."""

EVENT_TYPES: tuple[type, ...] = (BlockStored, BlockRemoved, AllBlocksCleared, Reset)


class EventBatch(msgspec.Struct, omit_defaults=True, kw_only=True):
    """One engine batch as a bridge received it, or one part of it (topic ``kvbus.raw``).

    A batch too large for one Kafka record is produced as several records sharing key, epoch and
    seq, in order, each with a consecutive run of the events (``first_index``).
    """

    replica: str
    """Engine replica id, unique in the fleet."""
    seq: int
    """Publisher sequence number (per dp_rank, from 0); -1 for kvbus-synthesised batches."""
    ts: float
    """Engine wall-clock time of the batch, epoch seconds."""
    events: list[Event]
    """Events in emission order; event i is event ``first_index + i`` of the engine batch."""
    dp_rank: int = 0
    """Data-parallel rank (0 when DP is off)."""
    worker_rank: int = 0
    """Tensor-parallel worker that reported it, 0..workers-1."""
    workers: int = 1
    """Workers that each report the same events; 1 = no aggregation needed."""
    engine: str = "vllm"
    """Wire format decoded: vllm, sglang, kvbus."""
    epoch: int = 0
    """Publisher run id (ms timestamp when kvbus first saw this sequence stream)."""
    topic: str = ""
    """ZMQ topic frame."""
    first_index: int = 0
    """Index in the engine batch of this record's first event: the position of ``events[i]`` is
    ``(epoch, seq, first_index + i)``. 0 for a whole batch (or its first part)."""
    model: str | None = None
    """The model the engine serves (its served model name, what requests name as their model), as
    the bridge (``--model``) or the publisher (``model=``) was told; None when not told."""


class BlockEvent(msgspec.Struct, omit_defaults=True, kw_only=True):
    """One consolidated event (topics ``kvbus.blocks`` and ``kvbus.blocks.<ownership>``).

    ``(epoch, seq, index)`` is its position: it only grows per (replica, dp_rank).
    """

    replica: str
    """Engine replica id."""
    epoch: int
    """Publisher run id."""
    seq: int
    """Sequence number of the batch that carried the event."""
    index: int
    """Index of the event in its batch."""
    ts: float
    """Engine wall-clock time, epoch seconds."""
    event: Event
    """The event."""
    dp_rank: int = 0
    """Data-parallel rank."""
    model: str | None = None
    """The model the replica serves, from the raw batch that carried the event (``EventBatch.model``);
    None when unknown."""

    @property
    def position(self) -> tuple[int, int, int]:
        """(epoch, seq, index): compare to tell a redelivered event from a new one."""
        return (self.epoch, self.seq, self.index)


class PositionedEvent(msgspec.Struct, kw_only=True):
    """One event of a :class:`BlockEvents` record and the index that completes its position."""

    index: int
    """Index of the event in its engine batch."""
    event: Event
    """The event."""


class BlockEvents(msgspec.Struct, omit_defaults=True, kw_only=True):
    """The consolidated events of one engine batch, one holder and one topic, in order (topics
    ``kvbus.blocks-packed`` and ``kvbus.blocks-packed.<ownership>``): what a :class:`BlockEvent` per event carried,
    the fields the events share written once. Event ``i``'s position is ``(epoch, seq, events[i].index)``."""

    replica: str
    """Engine replica id."""
    epoch: int
    """Publisher run id."""
    seq: int
    """Sequence number of the batch that carried the events."""
    ts: float
    """Engine wall-clock time of the batch, epoch seconds."""
    events: list[PositionedEvent]
    """The events, in order of position."""
    dp_rank: int = 0
    """Data-parallel rank."""
    model: str | None = None
    """The model the replica serves (``EventBatch.model``); None when unknown."""

    def unpacked(self) -> list[BlockEvent]:
        """The events as one :class:`BlockEvent` each, in order."""
        replica, epoch, seq, ts, dp_rank, model = self.replica, self.epoch, self.seq, self.ts, self.dp_rank, self.model
        return [BlockEvent(replica=replica, epoch=epoch, seq=seq, index=p.index, ts=ts, event=p.event,
                           dp_rank=dp_rank, model=model) for p in self.events]


class Incomplete(msgspec.Struct, omit_defaults=True, kw_only=True):
    """An event not every worker reported within the window (topic ``kvbus.incomplete``)."""

    replica: str
    epoch: int
    seq: int
    index: int
    workers: int
    reported: list[int]
    missing: list[int]
    event: Event
    dp_rank: int = 0


class DeadLetter(msgspec.Struct, kw_only=True):
    """Input a stage could not process (topic ``kvbus.dlq``)."""

    stage: str
    """bridge, publisher, streams or sink."""
    source: str
    """ZMQ endpoint, or topic[partition]@offset; ``<replica>#<dp_rank>`` for an event too large
    for any record."""
    reason: str
    """Exception type and message."""
    payload: list[bytes]
    """Raw frames / record value."""
    ts: float
    """When it was rejected, epoch seconds."""


DLQ_PAYLOAD_BYTES = 64 * 1024
"""Bytes of rejected input a DeadLetter keeps at most: an input near Kafka's record size limit (~1 MB)
would make a DeadLetter larger than a record may be, which the producer refuses (the letter lost,
or the stage crashed on it again at every restart)."""


def dead_letter(stage: str, source: str, reason: str, frames: list[bytes], ts: float) -> DeadLetter:
    """A DeadLetter keeping the first :data:`DLQ_PAYLOAD_BYTES` of ``frames`` in all; the reason
    says how much was cut, if anything."""
    payload, budget, cut = [], DLQ_PAYLOAD_BYTES, 0
    for f in frames:
        b = bytes(f)
        payload.append(b[:budget])
        cut += len(b) - len(payload[-1])
        budget -= len(payload[-1])
    if cut:
        reason += f" (payload truncated to its first {DLQ_PAYLOAD_BYTES} bytes, {cut} bytes cut)"
    return DeadLetter(stage=stage, source=source, reason=reason, payload=payload, ts=ts)


class ViewPosition(msgspec.Struct, kw_only=True):
    """A holder's applied position on one topic (in a :class:`ViewSnapshot`)."""

    topic: str
    epoch: int
    seq: int
    index: int


class ViewTier(msgspec.Struct, kw_only=True):
    """The blocks a holder holds on one tier (in a :class:`ViewSnapshot`)."""

    descriptor: str
    """``<MEDIUM>|<ownership>|<group>``."""
    refcounted: bool
    """Whether repeated stores are counted on this tier."""
    origin: str
    """Topic the tier's events come from."""
    blocks: bytes
    """Block hashes held, 8 bytes each."""
    extra: bytes = b""
    """Hashes held more than once: once more per extra count."""


class ViewGroup(msgspec.Struct, kw_only=True):
    """What a holder's events said of one of its KV cache groups (in a :class:`ViewSnapshot`)."""

    group: int
    """The group index (``group_idx``)."""
    spec: str
    """``<kv_cache_spec_kind>,<kv_cache_spec_sliding_window or empty>,<largest block_size>,<smallest
    block_size>``, as the view keeps it."""


class ViewOffset(msgspec.Struct, kw_only=True):
    """Where a snapshot's replay starts on one partition: the next offset to apply."""

    topic: str
    partition: int
    offset: int


class ViewSnapshot(msgspec.Struct, kw_only=True):
    """A record of topic ``kvbus.snapshots``: one holder's saved state (``holder`` set), or the manifest
    of a snapshot (``holder`` None: ``offsets`` and ``holders`` set). See kvbus.ViewSnapshot.avsc."""

    snapshot: int
    """Snapshot id: epoch milliseconds when it began."""
    taken: float
    """When this record was read from the view, epoch seconds."""
    holder: str | None = None
    replica: str = ""
    dp_rank: int = 0
    seen: float | None = None
    """Staleness clock of the holder (epoch s); None if expired."""
    floor: float | None = None
    """Reset floor epoch; None if none."""
    model: str | None = None
    """The model the view records for the holder; None if unknown."""
    positions: list[ViewPosition] = []
    tiers: list[ViewTier] = []
    offsets: list[ViewOffset] = []
    holders: list[str] = []
    groups: list[ViewGroup] = []
    """The holder's KV cache groups (hybrid models); empty when its engine names none."""


def check_model(model: str | None) -> str | None:
    """A model name as events and lookups carry it (``EventBatch.model``, ``BlockEvent.model``, a lookup's
    ``model``): any non-empty string, or None for "not named". ValueError for anything else (an empty
    name would be indistinguishable from an unknown model in the view)."""
    if model is None or (isinstance(model, str) and model):
        return model
    raise ValueError(f"a model name must be a non-empty string or None, got {model!r}")


def holder_key(replica: str, dp_rank: int) -> str:
    """Kafka key and display name of a (replica, dp_rank): ``"<replica>#<dp_rank>"``."""
    return f"{replica}#{dp_rank}"
