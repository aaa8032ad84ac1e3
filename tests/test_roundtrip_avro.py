"""Property tests: engine wire round trip for every format, and the Avro round trip of what decodes.

For any format and any events valid for it:
  decode_batch(encode_batch(fmt, events)) == project(fmt, events)   (fast and reference path alike)
  Avro(EventBatch(decoded events)) read back == the decoded events.

"Valid for a format" (what a real release can emit): vLLM sends lora_id with every lora_name,
none of SGLang's own mediums, and extra_keys as a list (of tuple-or-null) — the auto-detect rule
for ambiguous arrays relies on these; raw digests only where the release can send bytes hashes.
"""
from __future__ import annotations

from functools import lru_cache

import msgspec
from hypothesis import given, settings, strategies as st

from kvbus.producers import decode as dec
from kvbus.schemas.events import (
    KNOWN_MEDIUMS,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    canonical_hash,
    without_tokens,
)
from kvbus.schemas.serde import RecordSerde, registry_client
from kvbus.simulator.engine_wire import FORMATS, encode_batch, project, wire_format

SGLANG_ONLY = {"CPU_PINNED", "DISK", "EXTERNAL"}
I32 = st.integers(-(2**31), 2**31 - 1)
I64 = st.integers(-(2**63), 2**63 - 1)
TOKEN = st.integers(0, 2**63 - 1) | st.integers(0, 200_000)
TEXT = st.text(max_size=10)
MEDIUM = st.sampled_from([*KNOWN_MEDIUMS, "cpu", "Gpu", "kvcr-tier"]) | TEXT
DIGEST = st.sampled_from([16, 32]).flatmap(lambda n: st.binary(min_size=n, max_size=n))
MSGPACK_VALUE = st.recursive(
    st.none() | st.booleans() | I64 | TEXT | st.binary(max_size=33),
    lambda inner: st.lists(inner, max_size=4),
    max_leaves=8,
)


def opt(s):
    return st.none() | s


@st.composite
def hashes(draw, raw: bool, with_parent: bool):
    """(block_hashes, block_digests, parent_block_hash, parent_block_digest)."""
    n = draw(st.integers(0, 4))
    if raw:
        digests = [draw(DIGEST) for _ in range(n)]
        pd = draw(opt(DIGEST)) if with_parent else None
        return [canonical_hash(d) for d in digests], digests, (pd and canonical_hash(pd)), pd
    hs = [draw(st.binary(min_size=8, max_size=8)) for _ in range(n)]
    # digests on an int-hash event are dropped by the wire (project says so)
    extra = draw(opt(st.lists(DIGEST, min_size=n, max_size=n)))
    return hs, extra, (draw(opt(st.binary(min_size=8, max_size=8))) if with_parent else None), None


@st.composite
def stored(draw, fmt: str, raw: bool) -> BlockStored:
    hs, digests, parent, pd = draw(hashes(raw, True))
    vllm = wire_format(fmt).engine != "sglang"
    lora_name = draw(opt(TEXT))
    lora_id = draw(I64 if (vllm and lora_name is not None) else opt(I64))
    medium = draw(opt(MEDIUM))
    if vllm and medium is not None and medium.upper() in SGLANG_ONLY:
        medium = "GPU"
    extra = draw(opt(st.lists(opt(st.lists(MSGPACK_VALUE, max_size=4)), max_size=4)))  # list[tuple | None]
    return BlockStored(
        block_hashes=hs, block_digests=digests, parent_block_hash=parent, parent_block_digest=pd,
        token_ids=draw(st.lists(TOKEN, max_size=40)),
        block_size=draw(st.sampled_from([0, 1, 16, 256]) | st.integers(0, 2**31 - 1)),
        lora_id=lora_id, medium=medium, lora_name=lora_name,
        extra_keys=None if extra is None else msgspec.msgpack.encode(extra),
        group_idx=draw(opt(I32)), kv_cache_spec_kind=draw(opt(st.sampled_from(["full_attention", "mamba"]) | TEXT)),
        kv_cache_spec_sliding_window=draw(opt(I32)), locality=draw(opt(st.sampled_from(["LOCAL", "REMOTE"]))),
        ownership=draw(opt(TEXT)), session_id=draw(opt(TEXT)),
        lookahead_token_ids=draw(opt(st.lists(st.lists(TOKEN, max_size=3), max_size=3))),
        cache_salt=draw(opt(TEXT)),
        token_id_pairs=draw(opt(st.lists(st.lists(TOKEN, min_size=2, max_size=2), max_size=4))),
    )


@st.composite
def removed(draw, fmt: str, raw: bool) -> BlockRemoved:
    hs, digests, _, _ = draw(hashes(raw, False))
    medium = draw(opt(MEDIUM))
    if wire_format(fmt).engine != "sglang" and medium is not None and medium.upper() in SGLANG_ONLY:
        medium = "CPU"
    return BlockRemoved(block_hashes=hs, block_digests=digests, medium=medium, group_idx=draw(opt(I32)),
                        locality=draw(opt(TEXT)), ownership=draw(opt(TEXT)))


@st.composite
def batches(draw):
    fmt = draw(st.sampled_from(FORMATS))
    raw = wire_format(fmt).bytes_hashes and draw(st.booleans())
    event = st.one_of(stored(fmt, raw), removed(fmt, raw), st.just(AllBlocksCleared()))
    events = draw(st.lists(event, max_size=5))
    ts = draw(st.floats(allow_nan=False, allow_infinity=False))
    dp_rank = draw(opt(st.integers(0, 2**31 - 1)))
    return fmt, raw, ts, events, dp_rank


@lru_cache(maxsize=None)
def serde() -> RecordSerde:
    return RecordSerde(registry_client("mock://kvbus-roundtrip"), "EventBatch")


@settings(max_examples=150, deadline=None)
@given(batches())
def test_encode_decode_equals_projection_and_avro_roundtrip(case):
    fmt, raw, ts, events, dp_rank = case
    payload = encode_batch(fmt, ts, events, dp_rank, raw_hashes=raw)
    decoded = dec.decode_batch(payload)
    expected = [project(fmt, e, raw_hashes=raw) for e in events]
    assert decoded.events == expected
    assert decoded.ts == ts
    assert decoded.dp_rank == (None if fmt == "vllm-0.9.0" else dp_rank)
    # the fast path and the per-event reference path agree, and forcing the right engine changes nothing
    assert dec._decode_per_event(payload, "auto", False) == decoded
    engine = "sglang" if fmt.startswith("sglang") else "vllm"
    assert dec.decode_batch(payload, engine) == decoded
    # without the prompt's tokens: the same events with the token fields at their defaults, on both paths
    tokenless = dec.decode_batch(payload, keep_tokens=False)
    assert tokenless.events == [without_tokens(e) for e in expected]
    assert dec._decode_per_event(payload, "auto", False, keep_tokens=False) == tokenless

    batch = EventBatch(replica="r-1", seq=7, ts=decoded.ts, events=decoded.events, dp_rank=decoded.dp_rank or 0,
                       engine=engine, topic="kv-events")
    assert serde().loads(serde().dumps(batch, "kvbus.raw"), "kvbus.raw") == batch


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=64) | st.builds(lambda v: msgspec.msgpack.encode(v), MSGPACK_VALUE))
def test_arbitrary_bytes_decode_or_raise_decode_error(payload):
    """No input crashes the decoder with anything but DecodeError; fast and reference paths agree."""
    try:
        got = dec.decode_batch(payload)
    except dec.DecodeError:
        got = None
    try:
        ref = dec._decode_per_event(payload, "auto", False)
    except dec.DecodeError:
        ref = None
    assert got == ref
