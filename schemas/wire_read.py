"""Avro binary decoding primitives for the canonical encoding :mod:`schemas.wire` writes.

Each reader takes ``(data, pos)`` and returns ``(value, next_pos)``; skippers return only
``next_pos``. They accept what fastavro writes (arrays in one block, varints of at most
10 bytes) and raise :class:`WireError` on anything else, including truncated input and
invalid UTF-8; callers then fall back to a full Avro reader (``RecordSerde.loads``), which
decodes other valid encodings and gives the real error for broken ones. Callers wrap a
whole record in ``try`` and turn ``IndexError``/``UnicodeDecodeError``/``struct.error``
into :class:`WireError` (:data:`READ_ERRORS`). Arrays of 8 or more longs (token ids) are
read by fastavro's compiled reader, which accepts any valid encoding of them.
"""
from __future__ import annotations

import io
import re
import struct
from functools import lru_cache
from typing import Any, Callable, Optional

from fastavro import parse_schema, schemaless_reader

DOUBLE = struct.Struct("<d").unpack_from
"""``DOUBLE(data, pos) -> (value,)``."""


class WireError(ValueError):
    """Not a canonical Avro encoding of the expected schema (or not valid at all)."""


READ_ERRORS = (IndexError, UnicodeDecodeError, struct.error)
"""What indexing past the end, bad UTF-8 and short doubles raise inside a reader."""


def read_long(data: bytes, pos: int) -> tuple[int, int]:
    """Avro ``long``/``int`` at ``pos``."""
    b = data[pos]
    if b < 0x80:
        return (b >> 1) ^ -(b & 1), pos + 1
    n = b & 0x7F
    shift = 7
    pos += 1
    while True:
        b = data[pos]
        pos += 1
        n |= (b & 0x7F) << shift
        if b < 0x80:
            return (n >> 1) ^ -(n & 1), pos
        shift += 7
        if shift > 63:
            raise WireError("varint too long")


def skip_long(data: bytes, pos: int) -> int:
    """Past an Avro ``long``."""
    return read_long(data, pos)[1]


def read_bytes(data: bytes, pos: int) -> tuple[bytes, int]:
    """Avro ``bytes``."""
    n, pos = read_long(data, pos)
    end = pos + n
    if n < 0 or end > len(data):
        raise WireError("bad length")
    return data[pos:end], end


def read_str(data: bytes, pos: int) -> tuple[str, int]:
    """Avro ``string`` (UTF-8)."""
    n, pos = read_long(data, pos)
    end = pos + n
    if n < 0 or end > len(data):
        raise WireError("bad length")
    return data[pos:end].decode(), end


def skip_bytes(data: bytes, pos: int) -> int:
    """Past an Avro ``bytes`` or ``string``."""
    n, pos = read_long(data, pos)
    end = pos + n
    if n < 0 or end > len(data):
        raise WireError("bad length")
    return end


def read_count(data: bytes, pos: int) -> tuple[int, int]:
    """Item count of an array's first block (0: empty array, no terminator follows)."""
    n, pos = read_long(data, pos)
    if n < 0:
        raise WireError("array block with byte size")
    return n, pos


def end_array(data: bytes, pos: int) -> int:
    """Past the 0 that ends a one-block array."""
    if data[pos] != 0:
        raise WireError("array in more than one block")
    return pos + 1


@lru_cache(maxsize=512)
def _varints(n: int) -> "re.Pattern[bytes]":
    """``n`` consecutive varints of at most 10 bytes."""
    return re.compile(rb"(?:[\x80-\xff]{0,9}[\x00-\x7f]){%d}" % n, re.S)


_VARINT = re.compile(rb"[\x80-\xff]*[\x00-\x7f]", re.S)


class _LongDecoder(dict):
    """Encoded varint -> long, filled on demand for short encodings (token ids)."""

    def __missing__(self, enc: bytes) -> int:
        value = read_long(enc, 0)[0]
        if len(enc) <= 3 and len(self) < 1 << 16:
            self[enc] = value
        return value


_LONGS = _LongDecoder()


_LONG_ARRAY = parse_schema({"type": "array", "items": "long"})
_C_READER_FROM = 8
"""Arrays of at least this many longs are read by fastavro's compiled reader (token ids)."""


def read_longs(data: bytes, pos: int) -> tuple[list[int], int]:
    """Array of longs/ints (token ids, worker ranks)."""
    n, start = read_count(data, pos)
    if not n:
        return [], start
    if n >= _C_READER_FROM:
        buf = io.BytesIO(data)
        buf.seek(pos)
        try:
            values = schemaless_reader(buf, _LONG_ARRAY, None)
        except Exception as exc:  # truncated, bad varint
            raise WireError(f"bad array of longs: {exc}") from exc
        return values, buf.tell()
    m = _varints(n).match(data, start)
    if m is None:
        raise WireError("truncated array")
    end = m.end()
    return list(map(_LONGS.__getitem__, _VARINT.findall(data, start, end))), end_array(data, end)


def skip_longs(data: bytes, pos: int) -> int:
    """Past an array of longs."""
    n, pos = read_count(data, pos)
    if not n:
        return pos
    m = _varints(n).match(data, pos)
    if m is None:
        raise WireError("truncated array")
    return end_array(data, m.end())


def read_fixed8s(data: bytes, pos: int) -> tuple[list[bytes], int]:
    """Array of ``kvbus.BlockHash`` (fixed 8)."""
    n, pos = read_count(data, pos)
    if not n:
        return [], pos
    end = pos + 8 * n
    if n == 1:
        return [data[pos:end]], end_array(data, end)
    return [data[i:i + 8] for i in range(pos, end, 8)], end_array(data, end)


def skip_fixed8s(data: bytes, pos: int) -> int:
    """Past an array of ``kvbus.BlockHash``."""
    n, pos = read_count(data, pos)
    if not n:
        return pos
    return end_array(data, pos + 8 * n)


def read_fixed8(data: bytes, pos: int) -> tuple[bytes, int]:
    """One ``kvbus.BlockHash``."""
    end = pos + 8
    if end > len(data):
        raise WireError("truncated fixed")
    return data[pos:end], end


def read_array(data: bytes, pos: int, read: Callable[[bytes, int], tuple[Any, int]]) -> tuple[list, int]:
    """Array of items read by ``read``."""
    n, pos = read_count(data, pos)
    if not n:
        return [], pos
    out = []
    for _ in range(n):
        v, pos = read(data, pos)
        out.append(v)
    return out, end_array(data, pos)


def skip_array(data: bytes, pos: int, skip: Callable[[bytes, int], int]) -> int:
    """Past an array of items skipped by ``skip``."""
    n, pos = read_count(data, pos)
    if not n:
        return pos
    for _ in range(n):
        pos = skip(data, pos)
    return end_array(data, pos)


def read_bytes_list(data: bytes, pos: int) -> tuple[list[bytes], int]:
    """Array of ``bytes``."""
    return read_array(data, pos, read_bytes)


def skip_bytes_list(data: bytes, pos: int) -> int:
    """Past an array of ``bytes``."""
    return skip_array(data, pos, skip_bytes)


def read_longss(data: bytes, pos: int) -> tuple[list[list[int]], int]:
    """Array of arrays of longs."""
    return read_array(data, pos, read_longs)


def skip_longss(data: bytes, pos: int) -> int:
    """Past an array of arrays of longs."""
    return skip_array(data, pos, skip_longs)


def read_opt(data: bytes, pos: int, read: Callable[[bytes, int], tuple[Any, int]]) -> tuple[Optional[Any], int]:
    """``["null", X]`` union with X read by ``read``."""
    b = data[pos]
    if b == 0:
        return None, pos + 1
    if b == 2:
        return read(data, pos + 1)
    raise WireError("bad union branch")


def skip_opt(data: bytes, pos: int, skip: Callable[[bytes, int], int]) -> int:
    """Past a ``["null", X]`` union with X skipped by ``skip``."""
    b = data[pos]
    if b == 0:
        return pos + 1
    if b == 2:
        return skip(data, pos + 1)
    raise WireError("bad union branch")
