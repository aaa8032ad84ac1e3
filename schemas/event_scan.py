"""Scan an EventBatch body without decoding its block events: each ``BlockStored`` and
``BlockRemoved`` is kept as its exact Avro bytes (event-union branch index + record), ready to
be spliced into an output record by :func:`schemas.fast_encode.event` (any object with an
``avro`` attribute), so a stage that routes events never decodes or re-encodes token ids.

For each block event the scanner calls ``raw(avro, ownership, without_lora_name)``:

* ``avro``: the event's encoding, as in the batch;
* ``ownership``: its ``ownership`` field (None: the inference framework's own cache);
* ``without_lora_name``: for a ``BlockStored`` whose ``lora_name`` is set, the same encoding
  with ``lora_name`` null (the avsc: lora_name is not part of the event identity); else None.

``AllBlocksCleared`` and ``Reset`` are decoded to their structs. Like :mod:`schemas.fast_decode`
it reads the canonical encoding only and raises :class:`~schemas.wire_read.WireError` for
anything else (the caller then decodes with ``RecordSerde.loads``).
"""
from __future__ import annotations

from typing import Any, Callable, Optional

from schemas import avro_layout  # noqa: F401  (checks the layout at import)
from schemas.events import EventBatch
from schemas.fast_decode import batch_fields, read_event
from schemas.wire_read import (
    READ_ERRORS,
    WireError,
    end_array,
    read_count,
    read_long,
    read_opt,
    read_str,
    skip_bytes,
    skip_bytes_list,
    skip_fixed8s,
    skip_long,
    skip_longs,
    skip_longss,
    skip_opt,
)

RawFactory = Callable[[bytes, Optional[str], Optional[bytes]], Any]
"""``raw(avro, ownership, without_lora_name)`` -> the object kept for a block event."""


def _stored(data: bytes, start: int, pos: int, raw: RawFactory) -> tuple[Any, int]:
    """BlockStored record at ``pos`` (its branch index at ``start``)."""
    pos = skip_fixed8s(data, pos)  # block_hashes
    b = data[pos]  # parent_block_hash
    if b == 0:
        pos += 1
    elif b == 2:
        pos += 9
    else:
        raise WireError("bad union branch")
    pos = skip_longs(data, pos)  # token_ids
    pos = skip_long(data, pos)  # block_size
    pos = skip_opt(data, pos, skip_long)  # lora_id
    pos = skip_opt(data, pos, skip_bytes)  # medium
    lora_start = pos
    pos = skip_opt(data, pos, skip_bytes)  # lora_name
    lora_end = pos
    pos = skip_opt(data, pos, skip_bytes)  # extra_keys
    pos = skip_opt(data, pos, skip_long)  # group_idx
    pos = skip_opt(data, pos, skip_bytes)  # kv_cache_spec_kind
    pos = skip_opt(data, pos, skip_long)  # kv_cache_spec_sliding_window
    pos = skip_opt(data, pos, skip_bytes)  # locality
    ownership, pos = read_opt(data, pos, read_str)
    pos = skip_opt(data, pos, skip_bytes)  # session_id
    pos = skip_opt(data, pos, skip_longss)  # lookahead_token_ids
    pos = skip_opt(data, pos, skip_bytes)  # cache_salt
    pos = skip_opt(data, pos, skip_longss)  # token_id_pairs
    pos = skip_opt(data, pos, skip_bytes_list)  # block_digests
    pos = skip_opt(data, pos, skip_bytes)  # parent_block_digest
    if pos > len(data):
        raise WireError("truncated")
    without = None
    if lora_end - lora_start > 1:
        without = data[start:lora_start] + b"\x00" + data[lora_end:pos]
    return raw(data[start:pos], ownership, without), pos


def _removed(data: bytes, start: int, pos: int, raw: RawFactory) -> tuple[Any, int]:
    """BlockRemoved record at ``pos`` (its branch index at ``start``)."""
    pos = skip_fixed8s(data, pos)  # block_hashes
    pos = skip_opt(data, pos, skip_bytes)  # medium
    pos = skip_opt(data, pos, skip_long)  # group_idx
    pos = skip_opt(data, pos, skip_bytes)  # locality
    ownership, pos = read_opt(data, pos, read_str)
    pos = skip_opt(data, pos, skip_bytes_list)  # block_digests
    if pos > len(data):
        raise WireError("truncated")
    return raw(data[start:pos], ownership, None), pos


def _scan(data: bytes, pos: int, raw: RawFactory) -> tuple[EventBatch, int]:
    """EventBatch body at ``pos`` with its block events made by ``raw``; next pos."""
    replica, dp_rank, worker_rank, workers, engine, epoch, seq, ts, topic, pos = batch_fields(data, pos)
    count, pos = read_count(data, pos)
    evs: list = []
    append = evs.append
    for _ in range(count):
        start = pos
        branch = data[pos]
        if branch == 0:
            ev, pos = _stored(data, start, pos + 1, raw)
        elif branch == 2:
            ev, pos = _removed(data, start, pos + 1, raw)
        else:  # AllBlocksCleared, Reset (or an unknown branch: WireError)
            ev, pos = read_event(data, pos)
        append(ev)
    if count:
        pos = end_array(data, pos)
    first_index, pos = read_long(data, pos)
    return EventBatch(replica=replica, seq=seq, ts=ts, events=evs, dp_rank=dp_rank, worker_rank=worker_rank,
                      workers=workers, engine=engine, epoch=epoch, topic=topic, first_index=first_index), pos


def batch_scanner(raw: RawFactory) -> Callable[[bytes, int], EventBatch]:
    """``scan(data, pos=0) -> EventBatch``: the EventBatch whose body is ``data[pos:]``, its
    block events made by ``raw`` (module doc); WireError if it is not canonical."""

    def scan(data: bytes, pos: int = 0) -> EventBatch:
        try:
            batch, end = _scan(data, pos, raw)
        except READ_ERRORS as exc:
            raise WireError(str(exc)) from exc
        if end != len(data):
            raise WireError("trailing bytes")
        return batch

    return scan
