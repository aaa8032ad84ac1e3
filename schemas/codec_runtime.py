"""Avro binary primitives that the code :mod:`kvbus.schemas.codegen` generates calls: encoders of
longs, strings, fixed arrays and long arrays, their readers and skippers, and the Confluent header.

Hand-written on purpose: fastavro and confluent's serializer resolve every ``["null", X]``
union and dict field per record in Python (20-60 µs per kvbus record), and neither can skip
a value without decoding it or hand back the exact bytes of one event. These few functions
write what fastavro writes, byte for byte (zig-zag varints, length-prefixed strings, arrays in
one block ending in 0), with caches of the encodings of small longs and short strings.

The readers accept what fastavro writes (arrays in one block, varints of at most 10 bytes)
and raise :class:`WireError` for anything else, including truncated input; callers then
decode the value with a full Avro reader (``RecordSerde.loads``), which reads any valid
encoding and gives the real error for broken input. Arrays of 8 or more longs (token ids)
are read by fastavro's compiled reader.
"""
from __future__ import annotations

import io
import re
import struct
from functools import lru_cache
from operator import itemgetter
from typing import Optional, Sequence

from fastavro import parse_schema, schemaless_reader

NULL = b"\x00"
"""Union branch 0 (null), an empty array, an array's terminator, boolean false."""
ONE = b"\x02"
"""Union branch 1, or the count of an array block of one item."""
DOUBLE = struct.Struct("<d").pack
FLOAT = struct.Struct("<f").pack
READ_DOUBLE = struct.Struct("<d").unpack_from
READ_FLOAT = struct.Struct("<f").unpack_from

MAGIC = 0
"""First byte of a Confluent wire-format value."""
HEADER_SIZE = 5
"""Magic byte + 4-byte big-endian schema id."""


class WireError(ValueError):
    """Not the canonical Avro encoding of the expected schema (or not valid at all)."""


READ_ERRORS = (IndexError, UnicodeDecodeError, struct.error)
"""What indexing past the end, bad UTF-8 and short doubles raise inside a reader."""


def confluent_header(schema_id: int) -> bytes:
    """Magic byte 0 followed by the 4-byte big-endian schema id."""
    return b"\x00" + schema_id.to_bytes(4, "big")


def header_schema_id(data: bytes) -> Optional[int]:
    """Writer schema id of a Confluent wire-format value; None if it has no valid header."""
    if len(data) > HEADER_SIZE and data[0] == MAGIC:
        return int.from_bytes(data[1:HEADER_SIZE], "big")
    return None


# -- encoding ------------------------------------------------------------------------------

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


class LongCache(dict):
    """int -> encoded long, for values with ``|n| < limit``, at most ``size`` entries; emptied when
    full, it fills again with the values in use. Larger values are encoded on every call.

    Why two instances (:data:`LONG`, :data:`COUNTER`): token ids, lengths, ranks and indexes come
    from small domains that repeat for ever; epochs, sequence numbers, offsets and snapshot ids
    only grow, and each value is met a few times in a row, then never again. Kept in one cache,
    the second kind crowded out the first and made the cache grow for as long as the process ran
    (about 700 entries a minute in a worker under a 500 events/s fleet, from tracemalloc snapshots
    of ``benchmarks/soak.py``)."""

    def __init__(self, limit: int, size: int):
        super().__init__()
        self.limit = limit
        """Values with ``|n| < limit`` are kept."""
        self.size = size
        """Most entries kept (about 100 bytes each: the int, the bytes and the slot)."""

    def __missing__(self, n: int) -> bytes:
        enc = varint(n)
        if -self.limit < n < self.limit:
            if len(self) >= self.size:
                self.clear()
            self[n] = enc
        return enc


LONG = LongCache(limit=1 << 20, size=1 << 17)
"""``LONG[n]``: Avro encoding of the long ``n``, cached for values from small domains: ints, token
ids (vocabularies up to 131,072 tokens stay cached whole), array lengths. At most ~13 MiB."""

COUNTER = LongCache(limit=1 << 63, size=1 << 12)
"""``COUNTER[n]``: Avro encoding of the long ``n``, cached for scalar ``long`` fields (epochs,
sequence numbers, offsets, snapshot and LoRA ids): the values in use now. At most ~400 KiB."""


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
"""``STR[s]``: Avro encoding of the string ``s``."""


def bytes_(b: bytes) -> bytes:
    """Avro ``bytes``."""
    return LONG[len(b)] + b


def longs(values: Sequence[int]) -> bytes:
    """Array of longs/ints."""
    n = len(values)
    if n > 1:
        return LONG[n] + b"".join(itemgetter(*values)(LONG)) + NULL
    if n:
        return ONE + LONG[values[0]] + NULL
    return NULL


def fixed(value: bytes, size: int) -> bytes:
    """A ``fixed`` of ``size`` bytes; ValueError for another length."""
    if len(value) != size:
        raise ValueError(f"fixed values must be {size} bytes each")
    return value


def fixeds(values: Sequence[bytes], size: int) -> bytes:
    """Array of ``fixed`` (``size`` bytes each); ValueError if one has another length."""
    n = len(values)
    if n == 1:
        v = values[0]
        if len(v) == size:
            return ONE + v + NULL
    elif not n:
        return NULL
    else:
        body = b"".join(values)
        if len(body) == size * n:
            return LONG[n] + body + NULL
    raise ValueError(f"fixed values must be {size} bytes each")


# -- decoding ------------------------------------------------------------------------------

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


def read_bool(data: bytes, pos: int) -> tuple[bool, int]:
    """Avro ``boolean``."""
    b = data[pos]
    if b > 1:
        raise WireError("bad boolean")
    return b == 1, pos + 1


def read_fixed(data: bytes, pos: int, size: int) -> tuple[bytes, int]:
    """A ``fixed`` of ``size`` bytes."""
    end = pos + size
    if end > len(data):
        raise WireError("truncated fixed")
    return data[pos:end], end


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
    """Array of longs/ints."""
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


def read_fixeds(data: bytes, pos: int, size: int) -> tuple[list[bytes], int]:
    """Array of ``fixed`` of ``size`` bytes."""
    n, pos = read_count(data, pos)
    if not n:
        return [], pos
    end = pos + size * n
    if end > len(data):
        raise WireError("truncated array")
    if n == 1:
        return [data[pos:end]], end_array(data, end)
    return [data[i:i + size] for i in range(pos, end, size)], end_array(data, end)


def skip_fixeds(data: bytes, pos: int, size: int) -> int:
    """Past an array of ``fixed`` of ``size`` bytes."""
    n, pos = read_count(data, pos)
    if not n:
        return pos
    return end_array(data, pos + size * n)


def tail_varints(data: bytes, start: int, k: int) -> int:
    """Where the last ``k`` varints of ``data`` begin (each ends in the one byte below 0x80),
    or -1 if they cannot all begin after ``start``."""
    i = len(data)
    for _ in range(k):
        i -= 1
        if i <= start or data[i] >= 0x80:
            return -1
        while i > start and data[i - 1] >= 0x80:
            i -= 1
        if i <= start:
            return -1
    return i
