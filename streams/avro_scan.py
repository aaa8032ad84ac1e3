"""Fast path for raw EventBatch bodies: find each event's Avro bytes without decoding them.

The streams stage never needs a block's token ids: it needs the event's identity, its
ownership and the bytes to re-emit. :func:`scan` walks an Avro body written with kvbus's own
``EventBatch`` schema and returns the batch with each ``BlockStored``/``BlockRemoved`` as a
:class:`streams.aggregation.RawEvent` (its exact Avro encoding, ``lora_name`` blanked for the
identity, and its ownership); ``AllBlocksCleared`` and ``Reset`` are decoded normally.

It only accepts the canonical encoding fastavro writes (arrays in one block, no negative
block counts); anything else raises :class:`ScanError` and the caller decodes the record the
slow way, which yields the same identities (tests/test_streams_codec.py).
"""
from __future__ import annotations

import re
import struct
from functools import lru_cache

from schemas.events import AllBlocksCleared, EventBatch, Reset
from streams.raw_event import RawEvent

_DOUBLE = struct.Struct("<d").unpack_from


class ScanError(ValueError):
    """The body is not a canonical encoding of kvbus's EventBatch schema."""


def _long(data: bytes, pos: int) -> tuple[int, int]:
    b = data[pos]
    pos += 1
    if b < 0x80:
        return (b >> 1) ^ -(b & 1), pos
    n = b & 0x7F
    shift = 7
    while True:
        b = data[pos]
        pos += 1
        n |= (b & 0x7F) << shift
        if b < 0x80:
            return (n >> 1) ^ -(n & 1), pos
        shift += 7
        if shift > 63:
            raise ScanError("varint too long")


@lru_cache(maxsize=512)
def _varints(n: int) -> "re.Pattern[bytes]":
    return re.compile(rb"(?:[\x80-\xff]{0,9}[\x00-\x7f]){%d}" % n, re.S)


def _count(data: bytes, pos: int) -> tuple[int, int]:
    n, pos = _long(data, pos)
    if n < 0:
        raise ScanError("negative array block count")
    return n, pos


def _end(data: bytes, pos: int) -> int:
    if data[pos] != 0:
        raise ScanError("array in more than one block")
    return pos + 1


def _skip_bytes(data: bytes, pos: int) -> int:
    n, pos = _long(data, pos)
    if n < 0:
        raise ScanError("negative length")
    pos += n
    if pos > len(data):
        raise ScanError("truncated")
    return pos


def _skip_longs(data: bytes, pos: int) -> int:
    n, pos = _count(data, pos)
    if n == 0:
        return pos
    m = _varints(n).match(data, pos)
    if m is None:
        raise ScanError("truncated array")
    return _end(data, m.end())


def _skip_fixed8s(data: bytes, pos: int) -> int:
    n, pos = _count(data, pos)
    if n == 0:
        return pos
    return _end(data, pos + 8 * n)


def _skip_bytes_list(data: bytes, pos: int) -> int:
    n, pos = _count(data, pos)
    if n == 0:
        return pos
    for _ in range(n):
        pos = _skip_bytes(data, pos)
    return _end(data, pos)


def _skip_longss(data: bytes, pos: int) -> int:
    n, pos = _count(data, pos)
    if n == 0:
        return pos
    for _ in range(n):
        pos = _skip_longs(data, pos)
    return _end(data, pos)


def _opt(data: bytes, pos: int, skip) -> int:
    """A ["null", X] union: skip it."""
    b = data[pos]
    if b == 0:
        return pos + 1
    if b == 2:
        return skip(data, pos + 1)
    raise ScanError("bad union branch")


def _opt_str(data: bytes, pos: int) -> tuple[object, int]:
    b = data[pos]
    if b == 0:
        return None, pos + 1
    if b != 2:
        raise ScanError("bad union branch")
    n, pos = _long(data, pos + 1)
    end = pos + n
    if n < 0 or end > len(data):
        raise ScanError("bad string")
    return data[pos:end].decode(), end


def _skip_long(data: bytes, pos: int) -> int:
    return _long(data, pos)[1]


def _stored(data: bytes, start: int, pos: int) -> tuple[RawEvent, int]:
    """BlockStored body at ``pos`` (branch index at ``start``)."""
    pos = _skip_fixed8s(data, pos)  # block_hashes
    b = data[pos]  # parent_block_hash
    pos = pos + 1 if b == 0 else pos + 9 if b == 2 else -1
    if pos < 0:
        raise ScanError("bad union branch")
    pos = _skip_longs(data, pos)  # token_ids
    pos = _skip_long(data, pos)  # block_size
    pos = _opt(data, pos, _skip_long)  # lora_id
    pos = _opt(data, pos, _skip_bytes)  # medium
    lora_start = pos
    pos = _opt(data, pos, _skip_bytes)  # lora_name
    lora_end = pos
    pos = _opt(data, pos, _skip_bytes)  # extra_keys
    pos = _opt(data, pos, _skip_long)  # group_idx
    pos = _opt(data, pos, _skip_bytes)  # kv_cache_spec_kind
    pos = _opt(data, pos, _skip_long)  # kv_cache_spec_sliding_window
    pos = _opt(data, pos, _skip_bytes)  # locality
    ownership, pos = _opt_str(data, pos)  # ownership
    pos = _opt(data, pos, _skip_bytes)  # session_id
    pos = _opt(data, pos, _skip_longss)  # lookahead_token_ids
    pos = _opt(data, pos, _skip_bytes)  # cache_salt
    pos = _opt(data, pos, _skip_longss)  # token_id_pairs
    pos = _opt(data, pos, _skip_bytes_list)  # block_digests
    pos = _opt(data, pos, _skip_bytes)  # parent_block_digest
    avro = data[start:pos]
    canon = None
    if lora_end - lora_start > 1:
        canon = data[start:lora_start] + b"\x00" + data[lora_end:pos]
    return RawEvent(avro=avro, ownership=ownership, canon=canon), pos


def _removed(data: bytes, start: int, pos: int) -> tuple[RawEvent, int]:
    pos = _skip_fixed8s(data, pos)  # block_hashes
    pos = _opt(data, pos, _skip_bytes)  # medium
    pos = _opt(data, pos, _skip_long)  # group_idx
    pos = _opt(data, pos, _skip_bytes)  # locality
    ownership, pos = _opt_str(data, pos)  # ownership
    pos = _opt(data, pos, _skip_bytes_list)  # block_digests
    return RawEvent(avro=data[start:pos], ownership=ownership), pos


def _reset(data: bytes, pos: int) -> tuple[Reset, int]:
    n, pos = _long(data, pos)
    if n < 0 or pos + n > len(data):
        raise ScanError("bad string")
    reason = data[pos:pos + n].decode()
    pos += n
    values = []
    for _ in range(2):
        b = data[pos]
        if b == 0:
            values.append(None)
            pos += 1
        elif b == 2:
            v, pos = _long(data, pos + 1)
            values.append(v)
        else:
            raise ScanError("bad union branch")
    return Reset(reason=reason, missing_from=values[0], missing_to=values[1]), pos


_CLEARED = AllBlocksCleared()


def scan(data: bytes, pos: int = 0) -> EventBatch:
    """The EventBatch in ``data[pos:]`` (an Avro body, no wire header) with raw events."""
    try:
        n, pos = _long(data, pos)  # replica
        replica = data[pos:pos + n].decode()
        pos += n
        dp_rank, pos = _long(data, pos)
        worker_rank, pos = _long(data, pos)
        workers, pos = _long(data, pos)
        n, pos = _long(data, pos)  # engine
        engine = data[pos:pos + n].decode()
        pos += n
        epoch, pos = _long(data, pos)
        seq, pos = _long(data, pos)
        (ts,) = _DOUBLE(data, pos)
        pos += 8
        n, pos = _long(data, pos)  # topic
        topic = data[pos:pos + n].decode()
        pos += n
        count, pos = _count(data, pos)
        events: list = []
        append = events.append
        for _ in range(count):
            start = pos
            branch = data[pos]
            pos += 1
            if branch == 0:
                ev, pos = _stored(data, start, pos)
            elif branch == 2:
                ev, pos = _removed(data, start, pos)
            elif branch == 4:
                ev = _CLEARED
            elif branch == 6:
                ev, pos = _reset(data, pos)
            else:
                raise ScanError(f"unknown event branch {branch}")
            append(ev)
        if count:
            pos = _end(data, pos)
        if pos != len(data):
            raise ScanError("trailing bytes")
    except (IndexError, UnicodeDecodeError, struct.error) as exc:
        raise ScanError(str(exc)) from exc
    return EventBatch(replica=replica, seq=seq, ts=ts, events=events, dp_rank=dp_rank, worker_rank=worker_rank,
                      workers=workers, engine=engine, epoch=epoch, topic=topic)
