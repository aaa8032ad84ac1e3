"""Hostile input generators of the fuzz tests (issue 9, part 4), seeded and deterministic.

Each generator yields inputs tagged with what the stage under test is designed to do with them:

* :data:`REJECT`: dead-lettered, nothing of it applied;
* :data:`ACCEPT`: odd but valid (documented per case), applied like a good input;
* :data:`PARTIAL`: applied in part and dead-lettered too (a batch with an event of unknown type);
* stage-specific kinds (a backward seq at the bridge, a backward position at the sink).

Shapes are derived from the real formats, not rewritten: engine payloads start from what
:func:`kvbus.simulator.engine_wire.encode_batch` writes (vLLM 0.33 maps), decoded to plain msgpack values and
mutated; Kafka values start from what :class:`kvbus.schemas.serde.RecordSerde` writes (Confluent wire
format) and are cut, re-headed or mutated.
"""
from __future__ import annotations

import random
import struct
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import msgspec

from kvbus.schemas.events import BlockStored, canonical_hash
from kvbus.simulator.engine_wire import encode_batch

REJECT = "reject"
ACCEPT = "accept"
PARTIAL = "partial"
FRAMES = "frames"
"""A frame set the bridge rejects before sequencing (no seq consumed)."""
BACKWARD = "backward"
"""A good batch whose seq goes back: an engine restart by design (Reset marker, new epoch)."""
GOOD = "good"

FMT = "vllm-0.33"
_enc = msgspec.msgpack.encode
_dec = msgspec.msgpack.decode
_ARRAY_HEADS = frozenset([0xDC, 0xDD, *range(0x90, 0xA0)])


def marker_hash(n: int) -> bytes:
    """The 8-byte block hash that identifies good input number ``n`` (so outputs can be matched)."""
    return canonical_hash(0x5EED_0000_0000 + n)


def good_stored(n: int, **kw: Any) -> BlockStored:
    """The good event number ``n``: one BlockStored whose only hash is :func:`marker_hash`."""
    kw.setdefault("medium", "GPU")
    return BlockStored(block_hashes=[marker_hash(n)], parent_block_hash=None, token_ids=[n % 1000, 1, 2, 3],
                       block_size=4, **kw)


def good_payload(n: int, ts: float = 1_750_000_000.0) -> bytes:
    """An engine batch as vLLM 0.33 sends it, carrying good event ``n``."""
    return encode_batch(FMT, ts, [good_stored(n)], 0)


def nested(depth: int, leaf: bytes = b"\xc0") -> bytes:
    """msgpack ``[[[...leaf...]]]`` ``depth`` levels deep."""
    return b"\x91" * depth + leaf


# -- engine payloads (bridge) -----------------------------------------------------------------

@dataclass
class EngineInput:
    """One hostile (or good) engine message.

    ``payload`` is published with the engine's next seq (``frames`` None); else ``frames`` are sent
    as they are (``seq_back``: frames ``[topic, seq, payload]`` with a seq that goes back by that much,
    filled in by the sender). ``good`` is the number of the good event it carries, if any.
    """

    kind: str
    case: str
    payload: bytes | None = None
    frames: list[bytes] | None = None
    good: int | None = None
    seq_back: int = 0


def _event_map(n: int) -> dict:
    """Good event ``n`` as the plain msgpack map vLLM 0.33 puts on the wire."""
    return _dec(good_payload(n))[1][0]


def _batch(events: list, ts: Any = 1_750_000_000.0, dp: Any = 0) -> bytes:
    return _enc([ts, events, dp])


_WRONG_FIELDS: list[tuple[str, Any]] = [
    # (field of BlockStored, value no engine can send); each is rejected by a typed decoder
    ("block_hashes", "not-a-list"), ("block_hashes", None), ("block_hashes", [1.5]), ("block_hashes", ["abc"]),
    ("block_hashes", [None]), ("block_hashes", [[1]]), ("block_hashes", [b""]), ("block_hashes", [b"x" * 65]),
    ("block_hashes", [1, b"12345678"]), ("block_hashes", [b"12345678", 7]), ("block_hashes", [float("nan")]),
    ("block_hashes", {"a": 1}), ("parent_block_hash", "p"), ("parent_block_hash", b""), ("parent_block_hash", 2.5),
    ("token_ids", 5), ("token_ids", [1.5]), ("token_ids", ["a"]), ("token_ids", [2**64 - 1]),
    ("token_ids", [[1, 2], 3]), ("token_ids", [float("inf")]), ("block_size", -1), ("block_size", 2**31),
    ("block_size", 2**64 - 1), ("block_size", "16"), ("block_size", float("nan")), ("block_size", -(2**63)),
    ("lora_id", 2**63), ("lora_id", 2**64 - 1), ("lora_id", "lora"), ("lora_id", float("-inf")),
    ("medium", 5), ("medium", [1]), ("medium", b"GPU"), ("lora_name", 3), ("group_idx", 2**31),
    ("group_idx", -(2**31) - 1), ("group_idx", "0"), ("kv_cache_spec_kind", 1.0),
    ("kv_cache_spec_sliding_window", 2**40), ("locality", [None]), ("ownership", 12), ("session_id", {}),
    ("lookahead_token_ids", [[[1]]]), ("lookahead_token_ids", 7), ("cache_salt", 0.5), ("type", 5),
    ("type", None),
]
_WRONG_ENVELOPES: list[tuple[str, Callable[[dict], bytes]]] = [
    ("ts str", lambda e: _batch([e], ts="now")), ("ts nil", lambda e: _batch([e], ts=None)),
    ("ts list", lambda e: _batch([e], ts=[1.0])), ("dp -1", lambda e: _batch([e], dp=-1)),
    ("dp 2^31", lambda e: _batch([e], dp=2**31)), ("dp 2^64-1", lambda e: _batch([e], dp=2**64 - 1)),
    ("dp str", lambda e: _batch([e], dp="0")), ("dp nan", lambda e: _batch([e], dp=float("nan"))),
    ("events int", lambda e: _enc([1.0, 5, 0])), ("events str", lambda e: _enc([1.0, "x", 0])),
    ("events map", lambda e: _enc([1.0, {"a": e}, 0])), ("envelope map", lambda e: _enc({"ts": 1.0, "events": [e]})),
    ("envelope 1 elem", lambda e: _enc([1.0])), ("envelope empty", lambda e: _enc([])),
    ("event int", lambda e: _batch([5])), ("event nil", lambda e: _batch([None])),
    ("event bad array", lambda e: _batch([[5, [1]]])), ("event empty array", lambda e: _batch([[]])),
    ("event map no type", lambda e: _batch([{k: v for k, v in e.items() if k != "type"}])),
    ("trailing bytes", lambda e: _batch([e]) + b"\x00"),
    ("array stored too short", lambda e: _batch([["BlockStored", [1], None]])),
    ("removed no hashes", lambda e: _batch([{"type": "BlockRemoved"}])),
]


def engine_inputs(seed: int, n: int, good_every: int = 5, big: bool = True) -> Iterator[EngineInput]:
    """``n`` engine messages: every ``good_every``-th a good batch (numbered from 0), the rest drawn
    from the hostile cases. A BACKWARD input is always followed by a good one (so each backward seq
    gives exactly one restart marker and one gap marker). ``big`` adds the few large cases (over 1 MB
    each) once."""
    rng = random.Random(seed)
    goods = 0

    def good() -> EngineInput:
        nonlocal goods
        goods += 1
        return EngineInput(GOOD, "good", payload=good_payload(goods - 1), good=goods - 1)

    specials: list[EngineInput] = []
    if big:
        specials += [
            # 1,000,001 hashes: one above MAX_HASHES_PER_EVENT
            EngineInput(REJECT, "hashes over the limit",
                        payload=b"\x93\xcb" + _enc(1.0)[1:] + b"\x91\x84" + _enc("type") + _enc("BlockStored")
                        + _enc("block_hashes") + b"\xdd" + struct.pack(">I", 1_000_001) + b"\x01" * 1_000_001
                        + _enc("token_ids") + b"\x90" + _enc("block_size") + b"\x10" + b"\x00"),
            # 1,000,001 events: one above MAX_EVENTS_PER_BATCH
            EngineInput(REJECT, "events over the limit",
                        payload=b"\x93\xcb" + _enc(1.0)[1:] + b"\xdd" + struct.pack(">I", 1_000_001)
                        + b"\x00" * 1_000_001 + b"\x00"),
        ]
    i = 0
    while i < n:
        if i % good_every == 0:
            yield good()
            i += 1
            continue
        if specials:
            yield specials.pop()
            i += 1
            continue
        e = _event_map(1_000_000 + i)
        r = rng.random()
        if r < 0.12:  # random bytes that do not start with an array header (an envelope is an array)
            b = rng.randbytes(rng.randint(0, 120))
            while b and b[0] in _ARRAY_HEADS:
                b = rng.randbytes(len(b))
            yield EngineInput(REJECT, "random bytes", payload=b)
        elif r < 0.27:  # a strict prefix of a good payload is always truncated msgpack
            p = good_payload(1_000_000 + i)
            yield EngineInput(REJECT, "truncated", payload=p[:rng.randrange(len(p))])
        elif r < 0.47:
            name, value = rng.choice(_WRONG_FIELDS)
            e[name] = value
            yield EngineInput(REJECT, f"wrong {name}", payload=_batch([_event_map(2_000_000 + i), e]
                                                                     if rng.random() < 0.5 else [e]))
        elif r < 0.57:
            name, make = rng.choice(_WRONG_ENVELOPES)
            yield EngineInput(REJECT, name, payload=make(e))
        elif r < 0.62:  # length headers far beyond the payload: truncated, nothing allocated
            head = rng.choice([b"\xdd\xff\xff\xff\xff", b"\xdf\xff\xff\xff\xff", b"\xc6\xff\xff\xff\xff",
                               b"\xdb\xff\xff\xff\xff", b"\xdc\xff\xff"])
            where = rng.choice(["top", "events", "hashes"])
            if where == "top":
                p = head
            elif where == "events":
                p = b"\x93\xcb" + _enc(1.0)[1:] + head
            else:
                p = b"\x93\xcb" + _enc(1.0)[1:] + b"\x91\x82" + _enc("type") + _enc("BlockStored") \
                    + _enc("block_hashes") + head
            yield EngineInput(REJECT, f"huge {where} header", payload=p)
        elif r < 0.67:  # nesting deeper than the recursion limit, as an event or inside extra_keys
            depth = rng.choice([1_500, 5_000, 50_000])
            if rng.random() < 0.5:
                p = b"\x93\xcb" + _enc(1.0)[1:] + b"\x91" + nested(depth) + b"\x00"
            else:
                body = _enc(e)
                p = b"\x93\xcb" + _enc(1.0)[1:] + b"\x91" + bytes([body[0] + 1]) + body[1:] \
                    + _enc("extra_keys") + nested(depth) + b"\x00"
            yield EngineInput(REJECT, "deep nesting", payload=p)
        elif r < 0.74:  # frame sets the bridge rejects before sequencing
            choice = rng.randrange(5)
            if choice == 0:
                frames = [b""]
            elif choice == 1:
                frames = [b"", b"\x00" * 8]
            elif choice == 2:
                frames = [b"", b"\x00" * 8, good_payload(0), b"extra"]
            elif choice == 3:
                frames = [b"", rng.randbytes(rng.choice([0, 1, 7, 9, 16])), good_payload(0)]
            else:
                frames = [b"\xff\xfe", b"\x00" * 8, good_payload(0)]  # topic not UTF-8
            yield EngineInput(FRAMES, "frames", frames=frames)
        elif r < 0.76:  # a seq beyond int64 (fixed: used to be written as an invalid Avro long)
            yield EngineInput(FRAMES, "seq beyond int64",
                              frames=[b"", rng.randint(2**63, 2**64 - 1).to_bytes(8, "big"), good_payload(0)])
        elif r < 0.80:  # unknown event type next to a good one: the good one is produced, the frames dead-lettered
            goods += 1
            unknown = rng.choice([{"type": "BlockFrobbed", "x": 1}, ["Frob", 1, 2], {"type": ""}])
            yield EngineInput(PARTIAL, "unknown type", payload=_batch([_event_map(goods - 1), unknown]),
                              good=goods - 1)
        elif r < 0.90:  # odd but valid: accepted as is (see the bridge test's docstring)
            goods += 1
            ev = _event_map(goods - 1)
            case = rng.randrange(5)
            ts: Any = 1_750_000_000.0
            if case == 0:
                ts, name = float("nan"), "ts NaN"
            elif case == 1:
                ts, name = rng.choice([float("inf"), float("-inf")]), "ts inf"
            elif case == 2:
                ts, name = -rng.random() * 1e300, "ts negative"
            elif case == 3:
                ev["parent_block_hash"], name = -rng.randint(1, 2**63), "negative int parent hash"
            else:
                ev["lora_id"], name = -(2**63), "lora_id int64 min"
            yield EngineInput(ACCEPT, name, payload=_batch([ev], ts=ts), good=goods - 1)
        else:
            yield good()
            i += 1
            yield EngineInput(BACKWARD, "seq backwards", payload=good_payload(goods), good=goods,
                              seq_back=rng.randint(1, 40))
            goods += 1
            i += 1
            if i < n:
                yield good()
        i += 1


# -- reading back and measuring (the fuzz tests' own helpers) ---------------------------------

def rss_mib(pid: int) -> float:
    """Resident set size of process ``pid`` in MiB (``VmRSS`` of /proc/<pid>/status)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


class TopicReader:
    """Reads whole topics from the beginning (a fresh group), decoding values with ``loads(value,
    topic)``; :meth:`to_end` reads until every partition's high watermark as of the call."""

    def __init__(self, bootstrap: str, topics: list[str], loads: Callable[[bytes, str], Any]) -> None:
        import uuid

        from confluent_kafka import Consumer

        self.topics = topics
        self.loads = loads
        self.consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"fuzz-{uuid.uuid4().hex}",
                                  "auto.offset.reset": "earliest", "enable.auto.commit": False,
                                  "enable.partition.eof": False})
        self.consumer.subscribe(topics)
        self.records: list[tuple[str, int, int, bytes | None, Any]] = []
        self._next: dict[tuple[str, int], int] = {}

    def poll(self, seconds: float = 0.2) -> int:
        msgs = self.consumer.consume(5000, timeout=seconds)
        for m in msgs:
            assert m.error() is None, m.error()
            self.records.append((m.topic(), m.partition(), m.offset(), m.key(), self.loads(m.value(), m.topic())))
            self._next[(m.topic(), m.partition())] = m.offset() + 1
        return len(msgs)

    def until(self, cond: Callable[[], bool], timeout: float, what: str,
              alive: Callable[[], str | None] | None = None) -> None:
        """Poll until ``cond()``; fail after ``timeout`` s, or at once if ``alive()`` names a problem."""
        import time

        deadline = time.monotonic() + timeout
        while not cond():
            if alive is not None and (why := alive()):
                raise AssertionError(why)
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout}s waiting for {what}; have {len(self.records)}")
            self.poll()

    def to_end(self, timeout: float = 30.0) -> None:
        """Read everything written so far (up to each partition's current high watermark)."""
        from confluent_kafka import TopicPartition

        md = self.consumer.list_topics(timeout=10)
        ends = {}
        for t in self.topics:
            for p in md.topics[t].partitions:
                _, high = self.consumer.get_watermark_offsets(TopicPartition(t, p), timeout=10)
                if high > 0:
                    ends[(t, p)] = high
        self.until(lambda: all(self._next.get(k, 0) >= v for k, v in ends.items()), timeout, "the end of the topics")

    def values(self, topic: str | None = None) -> list[Any]:
        return [r[4] for r in sorted(self.records, key=lambda r: (r[0], r[1], r[2])) if topic in (None, r[0])]

    def close(self) -> None:
        self.consumer.close()
