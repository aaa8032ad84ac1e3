"""Hand-written Avro decoders of kvbus's records (bodies written with the current
``schemas/avro`` schemas, no Confluent header): the structs ``RecordSerde.loads`` returns,
about ten times faster.

They read the canonical encoding only (see :mod:`schemas.wire_read`) and raise
:class:`~schemas.wire_read.WireError` for anything else; :class:`schemas.fast_codec.FastSerde`
then decodes the value with ``RecordSerde.loads``. Records written with another schema
(another schema id) never reach these functions. tests/test_fast_codec.py proves that they
return what ``RecordSerde.loads`` returns.
"""
from __future__ import annotations

from typing import Any, Callable

from schemas import avro_layout  # noqa: F401  (checks the layout at import)
from schemas.events import (AllBlocksCleared, BlockEvent, BlockRemoved, BlockStored, DeadLetter, EventBatch,
                            Incomplete, Reset)
from schemas.wire_read import (
    DOUBLE,
    READ_ERRORS,
    WireError,
    read_bytes,
    read_bytes_list,
    read_count,
    read_fixed8,
    read_fixed8s,
    read_long,
    read_longs,
    read_longss,
    read_opt,
    read_str,
    end_array,
)

_CLEARED = AllBlocksCleared()


def _stored(data: bytes, pos: int) -> tuple[BlockStored, int]:
    hashes, pos = read_fixed8s(data, pos)
    parent, pos = read_opt(data, pos, read_fixed8)
    tokens, pos = read_longs(data, pos)
    block_size, pos = read_long(data, pos)
    lora_id, pos = read_opt(data, pos, read_long)
    medium, pos = read_opt(data, pos, read_str)
    if data[pos] == 0 and data[pos + 1] == 0:  # no lora_name, extra_keys: the common case
        lora_name = extra_keys = None
        pos += 2
    else:
        lora_name, pos = read_opt(data, pos, read_str)
        extra_keys, pos = read_opt(data, pos, read_bytes)
    group_idx, pos = read_opt(data, pos, read_long)
    kind, pos = read_opt(data, pos, read_str)
    if data[pos:pos + 9] == b"\x00" * 9:  # sliding_window..parent_block_digest all null
        pos += 9
        if lora_name is None and extra_keys is None:
            return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens,
                               block_size=block_size, lora_id=lora_id, medium=medium, group_idx=group_idx,
                               kv_cache_spec_kind=kind), pos
        return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens,
                           block_size=block_size, lora_id=lora_id, medium=medium, lora_name=lora_name,
                           extra_keys=extra_keys, group_idx=group_idx, kv_cache_spec_kind=kind), pos
    window, pos = read_opt(data, pos, read_long)
    locality, pos = read_opt(data, pos, read_str)
    ownership, pos = read_opt(data, pos, read_str)
    session_id, pos = read_opt(data, pos, read_str)
    lookahead, pos = read_opt(data, pos, read_longss)
    cache_salt, pos = read_opt(data, pos, read_str)
    pairs, pos = read_opt(data, pos, read_longss)
    digests, pos = read_opt(data, pos, read_bytes_list)
    parent_digest, pos = read_opt(data, pos, read_bytes)
    return BlockStored(
        block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=block_size, lora_id=lora_id,
        medium=medium, lora_name=lora_name, extra_keys=extra_keys, group_idx=group_idx, kv_cache_spec_kind=kind,
        kv_cache_spec_sliding_window=window, locality=locality, ownership=ownership, session_id=session_id,
        lookahead_token_ids=lookahead, cache_salt=cache_salt, token_id_pairs=pairs, block_digests=digests,
        parent_block_digest=parent_digest,
    ), pos


def _removed(data: bytes, pos: int) -> tuple[BlockRemoved, int]:
    hashes, pos = read_fixed8s(data, pos)
    medium, pos = read_opt(data, pos, read_str)
    group_idx, pos = read_opt(data, pos, read_long)
    locality, pos = read_opt(data, pos, read_str)
    ownership, pos = read_opt(data, pos, read_str)
    digests, pos = read_opt(data, pos, read_bytes_list)
    return BlockRemoved(block_hashes=hashes, medium=medium, group_idx=group_idx, locality=locality,
                        ownership=ownership, block_digests=digests), pos


def _reset(data: bytes, pos: int) -> tuple[Reset, int]:
    reason, pos = read_str(data, pos)
    missing_from, pos = read_opt(data, pos, read_long)
    missing_to, pos = read_opt(data, pos, read_long)
    return Reset(reason=reason, missing_from=missing_from, missing_to=missing_to), pos


def read_event(data: bytes, pos: int) -> tuple[Any, int]:
    """An event-union value (branch index + record) at ``pos``."""
    branch = data[pos]
    if branch == 0:
        return _stored(data, pos + 1)
    if branch == 2:
        return _removed(data, pos + 1)
    if branch == 4:
        return _CLEARED, pos + 1
    if branch == 6:
        return _reset(data, pos + 1)
    raise WireError(f"unknown event branch {branch}")


def _whole(read: Callable[[bytes, int], tuple[Any, int]]) -> Callable[[bytes, int], Any]:
    """A reader of a whole value: no trailing bytes, low-level errors as WireError."""

    def decode(data: bytes, pos: int = 0) -> Any:
        try:
            value, end = read(data, pos)
        except READ_ERRORS as exc:
            raise WireError(str(exc)) from exc
        if end != len(data):
            raise WireError("trailing bytes")
        return value

    decode.__doc__ = read.__doc__
    return decode


def batch_fields(data: bytes, pos: int) -> tuple[str, int, int, int, str, int, int, float, str, int]:
    """EventBatch fields before ``events`` at ``pos``: (replica, dp_rank, worker_rank, workers,
    engine, epoch, seq, ts, topic, position of the events array). ``first_index`` follows the array."""
    replica, pos = read_str(data, pos)
    dp_rank, pos = read_long(data, pos)
    worker_rank, pos = read_long(data, pos)
    workers, pos = read_long(data, pos)
    engine, pos = read_str(data, pos)
    epoch, pos = read_long(data, pos)
    seq, pos = read_long(data, pos)
    (ts,) = DOUBLE(data, pos)
    topic, pos = read_str(data, pos + 8)
    return replica, dp_rank, worker_rank, workers, engine, epoch, seq, ts, topic, pos


def _batch(data: bytes, pos: int) -> tuple[EventBatch, int]:
    """EventBatch body at ``pos``."""
    replica, dp_rank, worker_rank, workers, engine, epoch, seq, ts, topic, pos = batch_fields(data, pos)
    count, pos = read_count(data, pos)
    evs = []
    for _ in range(count):
        ev, pos = read_event(data, pos)
        evs.append(ev)
    if count:
        pos = end_array(data, pos)
    first_index, pos = read_long(data, pos)
    return EventBatch(replica=replica, seq=seq, ts=ts, events=evs, dp_rank=dp_rank, worker_rank=worker_rank,
                      workers=workers, engine=engine, epoch=epoch, topic=topic, first_index=first_index), pos


def _position(data: bytes, pos: int) -> tuple[str, int, int, int, int, int]:
    """Leading fields replica, dp_rank, epoch, seq, index of BlockEvent and Incomplete; next pos."""
    replica, pos = read_str(data, pos)
    dp_rank, pos = read_long(data, pos)
    epoch, pos = read_long(data, pos)
    seq, pos = read_long(data, pos)
    index, pos = read_long(data, pos)
    return replica, dp_rank, epoch, seq, index, pos


def _block_event(data: bytes, pos: int) -> tuple[BlockEvent, int]:
    """BlockEvent body at ``pos``."""
    replica, dp_rank, epoch, seq, index, pos = _position(data, pos)
    (ts,) = DOUBLE(data, pos)
    ev, pos = read_event(data, pos + 8)
    return BlockEvent(replica=replica, epoch=epoch, seq=seq, index=index, ts=ts, event=ev, dp_rank=dp_rank), pos


def _incomplete(data: bytes, pos: int) -> tuple[Incomplete, int]:
    """Incomplete body at ``pos``."""
    replica, dp_rank, epoch, seq, index, pos = _position(data, pos)
    workers, pos = read_long(data, pos)
    reported, pos = read_longs(data, pos)
    missing, pos = read_longs(data, pos)
    ev, pos = read_event(data, pos)
    return Incomplete(replica=replica, epoch=epoch, seq=seq, index=index, workers=workers, reported=reported,
                      missing=missing, event=ev, dp_rank=dp_rank), pos


def _dead_letter(data: bytes, pos: int) -> tuple[DeadLetter, int]:
    """DeadLetter body at ``pos``."""
    stage, pos = read_str(data, pos)
    source, pos = read_str(data, pos)
    reason, pos = read_str(data, pos)
    payload, pos = read_bytes_list(data, pos)
    (ts,) = DOUBLE(data, pos)
    return DeadLetter(stage=stage, source=source, reason=reason, payload=payload, ts=ts), pos + 8


event = _whole(read_event)
"""``event(data, pos=0)``: the event whose union encoding is ``data[pos:]``."""
batch = _whole(_batch)
"""``batch(data, pos=0)``: the EventBatch whose body is ``data[pos:]``."""
block_event = _whole(_block_event)
"""``block_event(data, pos=0)``: the BlockEvent whose body is ``data[pos:]``."""
incomplete = _whole(_incomplete)
"""``incomplete(data, pos=0)``: the Incomplete whose body is ``data[pos:]``."""
dead_letter = _whole(_dead_letter)
"""``dead_letter(data, pos=0)``: the DeadLetter whose body is ``data[pos:]``."""

BODY_READERS: dict[str, Callable[[bytes, int], Any]] = {
    "EventBatch": batch,
    "BlockEvent": block_event,
    "Incomplete": incomplete,
    "DeadLetter": dead_letter,
}
"""Record kind -> reader of a whole value's Avro body starting at ``pos``."""
