"""Avro binary encoding primitives and the Confluent wire-format header.

What fastavro writes, byte for byte, for the types kvbus's schemas use: ``long``/``int``
(zig-zag + base-128 varint), ``double`` (8 bytes little-endian), ``string``/``bytes``
(length + content), ``fixed`` (content only), ``["null", X]`` unions (branch index, then X),
arrays (one block: count, items, then the 0 terminator; an empty array is just 0).
Small longs and short strings are cached, so encoding token ids and replica names is a dict
lookup. The record encoders built on these are in :mod:`schemas.fast_encode`.
"""
from __future__ import annotations

import struct
from operator import itemgetter
from typing import Optional, Sequence

NULL = b"\x00"
"""Union branch 0 (null), an empty array, or an array's terminator."""
ONE = b"\x02"
"""Union branch 1, or the count of an array block of one item."""
DOUBLE = struct.Struct("<d").pack
"""Avro ``double``."""

MAGIC = 0
"""First byte of a Confluent wire-format value."""
HEADER_SIZE = 5
"""Magic byte + 4-byte big-endian schema id."""


def varint(n: int) -> bytes:
    """Avro ``long``/``int`` ``n``: zig-zag, then base-128 varint (any 64-bit value)."""
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
    """int -> encoded long, filled on demand for |n| < 2**20 (token ids, counts, lengths, ranks)."""

    limit = 1 << 20

    def __missing__(self, n: int) -> bytes:
        enc = varint(n)
        if -self.limit < n < self.limit:
            self[n] = enc
        return enc


LONG = _LongCache()
"""``LONG[n]``: Avro encoding of the long ``n`` (cached for small values)."""


class _RepeatedLongCache(dict):
    """int -> encoded long for large values that repeat (epochs), up to ``limit`` values."""

    limit = 4096

    def __missing__(self, n: int) -> bytes:
        enc = varint(n)
        if len(self) < self.limit:
            self[n] = enc
        return enc


EPOCH = _RepeatedLongCache()
"""``EPOCH[n]``: Avro encoding of the long ``n`` (cached for the first 4096 values: epochs)."""


class _StrCache(dict):
    """str -> length-prefixed UTF-8, cached while short (mediums, kinds, replica names)."""

    limit = 1 << 16

    def __missing__(self, s: str) -> bytes:
        raw = s.encode("utf-8")
        enc = LONG[len(raw)] + raw
        if len(raw) <= 64 and len(self) < self.limit:
            self[s] = enc
        return enc


STR = _StrCache()
"""``STR[s]``: Avro encoding of the string ``s`` (cached when short)."""


def str_once(s: str) -> bytes:
    """Avro string not worth caching (DLQ sources and reasons)."""
    raw = s.encode("utf-8")
    return LONG[len(raw)] + raw


def bytes_(b: bytes) -> bytes:
    """Avro ``bytes``."""
    return LONG[len(b)] + b


def opt_str(v: Optional[str]) -> bytes:
    """``["null", "string"]``."""
    return NULL if v is None else ONE + STR[v]


def opt_long(v: Optional[int]) -> bytes:
    """``["null", "long"]`` or ``["null", "int"]``."""
    return NULL if v is None else ONE + LONG[v]


def opt_bytes(v: Optional[bytes]) -> bytes:
    """``["null", "bytes"]``."""
    return NULL if v is None else ONE + LONG[len(v)] + v


def longs(values: Sequence[int], n: Optional[int] = None) -> bytes:
    """Array of longs (``n``: ``len(values)`` when the caller has it)."""
    if n is None:
        n = len(values)
    if n > 1:
        return LONG[n] + b"".join(itemgetter(*values)(LONG)) + NULL
    if n:
        return ONE + LONG[values[0]] + NULL
    return NULL


def fixed8s(hashes: Sequence[bytes]) -> bytes:
    """Array of ``kvbus.BlockHash`` (fixed, 8 bytes); ValueError if one is not 8 bytes."""
    n = len(hashes)
    if n == 1:
        h = hashes[0]
        if len(h) == 8:
            return ONE + h + NULL
    elif not n:
        return NULL
    else:
        body = b"".join(hashes)
        if len(body) == 8 * n:
            return LONG[n] + body + NULL
    raise ValueError("block hashes must be 8 bytes each")


def opt_fixed8(h: Optional[bytes]) -> bytes:
    """``["null", "kvbus.BlockHash"]``; ValueError if not 8 bytes."""
    if h is None:
        return NULL
    if len(h) != 8:
        raise ValueError("block hashes must be 8 bytes each")
    return ONE + h


def bytes_list(values: Sequence[bytes]) -> bytes:
    """Array of ``bytes``."""
    if not values:
        return NULL
    return LONG[len(values)] + b"".join([LONG[len(v)] + v for v in values]) + NULL


def opt_bytes_list(v: Optional[Sequence[bytes]]) -> bytes:
    """``["null", {"type": "array", "items": "bytes"}]``."""
    return NULL if v is None else ONE + bytes_list(v)


def opt_longss(v: Optional[Sequence[Sequence[int]]]) -> bytes:
    """``["null", array of array of long]`` (lookahead token ids, SGLang bigram pairs)."""
    if v is None:
        return NULL
    if not v:
        return ONE + NULL
    return ONE + LONG[len(v)] + b"".join([longs(x) for x in v]) + NULL


def confluent_header(schema_id: int) -> bytes:
    """Magic byte 0 followed by the 4-byte big-endian schema id."""
    return b"\x00" + schema_id.to_bytes(4, "big")


def header_schema_id(data: bytes) -> Optional[int]:
    """Writer schema id of a Confluent wire-format value; None if it has no valid header."""
    if len(data) > HEADER_SIZE and data[0] == MAGIC:
        return int.from_bytes(data[1:HEADER_SIZE], "big")
    return None
