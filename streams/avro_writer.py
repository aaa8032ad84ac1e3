"""Hand-written Avro binary writers for the records the streams stage produces.

They write exactly what fastavro writes for ``kvbus.BlockEvent``, ``kvbus.Incomplete`` and
``kvbus.DeadLetter`` (field order of ``schemas/avro/*.avsc``; arrays as one block followed by
the 0 terminator), about ten times faster, which matters at tens of thousands of outputs a
second. tests/test_streams_codec.py checks byte equality with fastavro on generated records;
a field added to the schemas breaks that test until it is added here.
"""
from __future__ import annotations

import struct
from typing import Callable, Optional

from schemas.events import AllBlocksCleared, BlockEvent, BlockRemoved, BlockStored, DeadLetter, Incomplete, Reset
from streams.raw_event import RawEvent

_DOUBLE = struct.Struct("<d").pack


def _enc_long(n: int) -> bytes:
    z = (n << 1) ^ (n >> 63)
    if z < 0x80:
        return bytes((z,))
    out = bytearray()
    while z >= 0x80:
        out.append((z & 0x7F) | 0x80)
        z >>= 7
    out.append(z)
    return bytes(out)


class _LongCache(dict):
    """int -> Avro zigzag varint, filled on demand (bounded)."""

    def __missing__(self, n: int) -> bytes:
        b = _enc_long(n)
        if len(self) < 1 << 20:
            self[n] = b
        return b


_LONG = _LongCache()
long_ = _LONG.__getitem__
"""Avro int/long encoding."""


class _StrCache(dict):
    def __missing__(self, s: str) -> bytes:
        raw = s.encode()
        b = _LONG[len(raw)] + raw
        if len(self) < 1 << 16 and len(raw) <= 64:
            self[s] = b
        return b


_STR = _StrCache()
str_ = _STR.__getitem__
"""Avro string encoding (short strings cached)."""

_NULL = b"\x00"  # union branch 0 (null)
_B1 = b"\x02"  # union branch 1
_END = b"\x00"  # array terminator / empty array


def bytes_(b: bytes) -> bytes:
    """Avro bytes."""
    return _LONG[len(b)] + b


def _longs(values: list[int]) -> bytes:
    if not values:
        return _END
    return _LONG[len(values)] + b"".join(map(_LONG.__getitem__, values)) + _END


def _fixed8s(values: list[bytes]) -> bytes:
    if not values:
        return _END
    return _LONG[len(values)] + b"".join(values) + _END


def _bytes_list(values: list[bytes]) -> bytes:
    if not values:
        return _END
    return _LONG[len(values)] + b"".join(_LONG[len(v)] + v for v in values) + _END


def _opt_long(v: Optional[int]) -> bytes:
    return _NULL if v is None else _B1 + _LONG[v]


def _opt_str(v: Optional[str]) -> bytes:
    return _NULL if v is None else _B1 + _STR[v]


def _opt_bytes(v: Optional[bytes]) -> bytes:
    return _NULL if v is None else _B1 + _LONG[len(v)] + v


def _opt_longss(v: Optional[list[list[int]]]) -> bytes:
    if v is None:
        return _NULL
    if not v:
        return _B1 + _END
    return _B1 + _LONG[len(v)] + b"".join(map(_longs, v)) + _END


def _opt_bytes_list(v: Optional[list[bytes]]) -> bytes:
    return _NULL if v is None else _B1 + _bytes_list(v)


def stored(e: BlockStored) -> bytes:
    """Avro body of a kvbus.BlockStored."""
    parent = e.parent_block_hash
    return b"".join((
        _fixed8s(e.block_hashes),
        _NULL if parent is None else _B1 + parent,
        _longs(e.token_ids),
        _LONG[e.block_size],
        _opt_long(e.lora_id),
        _opt_str(e.medium),
        _opt_str(e.lora_name),
        _opt_bytes(e.extra_keys),
        _opt_long(e.group_idx),
        _opt_str(e.kv_cache_spec_kind),
        _opt_long(e.kv_cache_spec_sliding_window),
        _opt_str(e.locality),
        _opt_str(e.ownership),
        _opt_str(e.session_id),
        _opt_longss(e.lookahead_token_ids),
        _opt_str(e.cache_salt),
        _opt_longss(e.token_id_pairs),
        _opt_bytes_list(e.block_digests),
        _opt_bytes(e.parent_block_digest),
    ))


def removed(e: BlockRemoved) -> bytes:
    """Avro body of a kvbus.BlockRemoved."""
    return b"".join((
        _fixed8s(e.block_hashes),
        _opt_str(e.medium),
        _opt_long(e.group_idx),
        _opt_str(e.locality),
        _opt_str(e.ownership),
        _opt_bytes_list(e.block_digests),
    ))


def reset(e: Reset) -> bytes:
    """Avro body of a kvbus.Reset."""
    return _STR[e.reason] + _opt_long(e.missing_from) + _opt_long(e.missing_to)


_EVENT: dict[type, tuple[bytes, Callable]] = {
    BlockStored: (_LONG[0], stored),
    BlockRemoved: (_LONG[1], removed),
    AllBlocksCleared: (_LONG[2], lambda e: b""),
    Reset: (_LONG[3], reset),
    RawEvent: (b"", lambda e: e.avro),  # already branch index + record
}


def event(e) -> bytes:
    """Avro encoding of the event union (branch index + record)."""
    branch, write = _EVENT[type(e)]
    return branch + write(e)


def block_event(v: BlockEvent) -> bytes:
    """Avro body of a kvbus.BlockEvent."""
    return b"".join((
        _STR[v.replica], _LONG[v.dp_rank], _LONG[v.epoch], _LONG[v.seq], _LONG[v.index],
        _DOUBLE(v.ts), event(v.event),
    ))


def incomplete(v: Incomplete) -> bytes:
    """Avro body of a kvbus.Incomplete."""
    return b"".join((
        _STR[v.replica], _LONG[v.dp_rank], _LONG[v.epoch], _LONG[v.seq], _LONG[v.index],
        _LONG[v.workers], _longs(v.reported), _longs(v.missing), event(v.event),
    ))


def _str_once(s: str) -> bytes:
    raw = s.encode()
    return _LONG[len(raw)] + raw


def dead_letter(v: DeadLetter) -> bytes:
    """Avro body of a kvbus.DeadLetter."""
    return b"".join((
        _STR[v.stage], _str_once(v.source), _str_once(v.reason), _bytes_list(v.payload), _DOUBLE(v.ts),
    ))


WRITERS: dict[str, Callable] = {
    "BlockEvent": block_event,
    "Incomplete": incomplete,
    "DeadLetter": dead_letter,
}
"""Record name -> writer of its Avro body."""
