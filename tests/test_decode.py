"""kvbus.producers.decode: every engine wire format, the protocol doc §11 vectors, bad input, frames.

Payloads here are built by hand (msgspec on plain lists/dicts or doc hex), independent of
kvbus.simulator.engine_wire, so decoder and encoder are checked against the doc, not each other.
"""
from __future__ import annotations

import msgspec
import pytest

from kvbus.producers import decode as dec
from kvbus.producers.decode import (
    END_SEQ,
    ENGINE_FORMATS,
    DecodedBatch,
    DecodeError,
    decode_batch,
    parse_frames,
    parse_replay_reply,
)
from kvbus.schemas.events import AllBlocksCleared, BlockRemoved, BlockStored, canonical_hash, hash_to_int
from kvbus.schemas.hashing import block_hashes

H0 = 1403909460543360175
H1 = 1643945449041937783
B0, B1 = canonical_hash(H0), canonical_hash(H1)
TOKENS = list(range(1, 33))

SEQ1_HEX = (  # protocol doc §11 "Multipart for seq 1", frame 2 (the doc's hex drops the 'x' (78) of
    # "group_idx"; its stated length, 76 bytes, includes it)
    "93cb41da13b860500000918 4a474797065ac426c6f636b52656d6f766564"
    "ac626c6f636b5f68617368657391cf16d077ad0843c577"
    "a66d656469756da3475055a967726f75705f69647800 00"
).replace(" ", "")
SEQ2_HEX = "93cb41da13b8608000009181a474797065b0416c6c426c6f636b73436c656172656400"
ARRAY_SEQ1_HEX = "93cb41da13b8605000009194ac426c6f636b52656d6f76656491cf16d077ad0843c577a34750550000"
SGLANG_HEX = (
    "93cb41da13b8605000009183a474797065ac426c6f636b52656d6f766564ac626c6f636b5f686173686573"
    "91d3eeddef0b82167eeba66d656469756daa4350555f50494e4e454400"
)


def enc(obj: object) -> bytes:
    return msgspec.msgpack.encode(obj)


def stored_array(n: int, *, hashes=(H0, H1), parent=None, lora_id=None, medium="GPU", lora_name=None,
                 extra=(None, None), group_idx=0, kind="full_attention", window=None) -> list:
    """A vLLM array-era BlockStored with the first n elements (tag included)."""
    full = ["BlockStored", list(hashes), parent, TOKENS, 16, lora_id, medium, lora_name,
            None if extra is None else list(extra), group_idx, kind, window]
    return full[:n]


# -- §11 vectors and hashes -------------------------------------------------------

def test_hashes_h0_h1_sha256_and_sha256_cbor():
    assert [hash_to_int(h) for h in block_hashes(TOKENS, 16)] == [H0, H1]
    assert [hash_to_int(h) for h in block_hashes(TOKENS, 16, "sha256_cbor")] == [
        8866452693264111234, 807986237951177663]


def test_seq1_map_vector():
    payload = bytes.fromhex(SEQ1_HEX)
    assert len(payload) == 76
    assert decode_batch(payload) == DecodedBatch(
        1750000001.25, [BlockRemoved(block_hashes=[B1], medium="GPU", group_idx=0)], 0, 0)


def test_seq2_vector():
    assert decode_batch(bytes.fromhex(SEQ2_HEX)) == DecodedBatch(1750000002.0, [AllBlocksCleared()], 0, 0)


def test_array_format_seq1_vector():
    payload = bytes.fromhex(ARRAY_SEQ1_HEX)
    assert len(payload) == 41
    for engine in ("auto", "vllm"):
        b = decode_batch(payload, engine)
        assert b.events == [BlockRemoved(block_hashes=[B1], medium="GPU", group_idx=0)]
        assert (b.ts, b.dp_rank) == (1750000001.25, 0)


def test_sglang_vector_signed_hash():
    payload = bytes.fromhex(SGLANG_HEX)
    assert len(payload) == 72
    for engine in ("auto", "sglang", "vllm"):
        b = decode_batch(payload, engine)
        assert b.events == [BlockRemoved(block_hashes=[(17212176183586094827).to_bytes(8, "big")], medium="CPU_PINNED")]
        assert hash_to_int(b.events[0].block_hashes[0]) == 17212176183586094827
        assert canonical_hash(-1234567890123456789) == b.events[0].block_hashes[0]


def test_seq0_map_vector():
    ev = {"type": "BlockStored", "block_hashes": [H0, H1], "parent_block_hash": None, "token_ids": TOKENS,
          "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None, "extra_keys": [None, None],
          "group_idx": 0, "kv_cache_spec_kind": "full_attention"}
    payload = enc([1750000000.5, [ev], 0])
    # The doc says "230-byte payload"; the event exactly as the doc prints it encodes to 228 bytes
    # (230 = 228 + the 2-byte ZMTP short-frame header). See the report to the lead.
    assert len(payload) == 228
    assert decode_batch(payload).events == [BlockStored(
        block_hashes=[B0, B1], token_ids=TOKENS, block_size=16, medium="GPU", extra_keys=b"\x92\xc0\xc0",
        group_idx=0, kv_cache_spec_kind="full_attention")]


def test_single_block_store_with_parent():
    ev = {"type": "BlockStored", "block_hashes": [H1], "parent_block_hash": H0, "token_ids": TOKENS[16:],
          "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None, "extra_keys": [None]}
    (got,) = decode_batch(enc([1.0, [ev], 0])).events
    assert (got.parent_block_hash, got.block_hashes, got.token_ids) == (B0, [B1], TOKENS[16:])
    assert got.extra_keys == b"\x91\xc0"


# -- vLLM tagged arrays by length -------------------------------------------------

@pytest.mark.parametrize(
    "n, version, expected",
    [
        (6, "0.9.0", {}),
        (7, "0.10.2", {"medium": "GPU"}),
        (8, "0.14", {"medium": "GPU"}),
        (9, "0.17", {"medium": "GPU", "extra_keys": b"\x92\xc0\xc0"}),
        (10, "0.20", {"medium": "GPU", "extra_keys": b"\x92\xc0\xc0", "group_idx": 0}),
        (12, "0.22", {"medium": "GPU", "extra_keys": b"\x92\xc0\xc0", "group_idx": 0,
                      "kv_cache_spec_kind": "full_attention"}),
    ],
)
def test_vllm_stored_arrays_by_length(n, version, expected):
    payload = enc([5.5, [stored_array(n)]] + ([] if version == "0.9.0" else [3]))
    b = decode_batch(payload)
    assert b.dp_rank == (None if version == "0.9.0" else 3)
    assert b.events == [BlockStored(block_hashes=[B0, B1], token_ids=TOKENS, block_size=16, **expected)]
    assert decode_batch(payload, "vllm") == b


def test_vllm_022_stored_with_lora_and_window():
    arr = stored_array(12, parent=H0, lora_id=7, lora_name="sql-lora", medium="gpu", kind="sliding_window",
                       window=4096, extra=[["sql-lora"], None])
    (got,) = decode_batch(enc([1.0, [arr], 0])).events
    assert got == BlockStored(block_hashes=[B0, B1], parent_block_hash=B0, token_ids=TOKENS, block_size=16,
                              lora_id=7, medium="GPU", lora_name="sql-lora", extra_keys=enc([["sql-lora"], None]),
                              group_idx=0, kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=4096)


@pytest.mark.parametrize(
    "arr, expected",
    [
        (["BlockRemoved", [H1]], BlockRemoved(block_hashes=[B1])),
        (["BlockRemoved", [H1], "GPU"], BlockRemoved(block_hashes=[B1], medium="GPU")),
        (["BlockRemoved", [H1], "cpu", 2], BlockRemoved(block_hashes=[B1], medium="CPU", group_idx=2)),
        (["AllBlocksCleared"], AllBlocksCleared()),
    ],
)
def test_removed_and_cleared_arrays(arr, expected):
    assert decode_batch(enc([1.0, [arr]])).events == [expected]


def test_vllm_09_signed_builtin_hashes():
    (got,) = decode_batch(enc([1.0, [["BlockStored", [-1, 5], -2, [1, 2], 1, None]]])).events
    assert got.block_hashes == [b"\xff" * 8, (5).to_bytes(8, "big")]
    assert got.parent_block_hash == (2**64 - 2).to_bytes(8, "big")


def test_array_newer_than_known_ignores_trailing_elements():
    arr = stored_array(12) + ["future", 1]
    assert decode_batch(enc([1.0, [arr], 0])).events[0].kv_cache_spec_kind == "full_attention"


# -- maps ------------------------------------------------------------------------

def test_vllm_033_map_all_fields_and_unknown_keys_ignored():
    ev = {"type": "BlockStored", "block_hashes": [H0], "parent_block_hash": None, "token_ids": TOKENS[:16],
          "block_size": 16, "lora_id": 1, "medium": "STORAGE", "lora_name": "sql-lora",
          "extra_keys": [["sql-lora", ["abc123", 0], "tenant-a"]], "group_idx": 1,
          "kv_cache_spec_kind": "mamba", "kv_cache_spec_sliding_window": None, "locality": "REMOTE",
          "ownership": "kvcr", "session_id": "s-1", "lookahead_token_ids": [[17, 18]],
          "brand_new_field": {"x": 1}}
    (got,) = decode_batch(enc([1.0, [ev], 0])).events
    assert got == BlockStored(
        block_hashes=[B0], token_ids=TOKENS[:16], block_size=16, lora_id=1, medium="STORAGE",
        lora_name="sql-lora", extra_keys=enc([["sql-lora", ["abc123", 0], "tenant-a"]]), group_idx=1,
        kv_cache_spec_kind="mamba", locality="REMOTE", ownership="kvcr", session_id="s-1",
        lookahead_token_ids=[[17, 18]])
    assert msgspec.msgpack.decode(got.extra_keys) == [["sql-lora", ["abc123", 0], "tenant-a"]]


def test_removed_map_new_fields():
    ev = {"type": "BlockRemoved", "block_hashes": [H0], "medium": "CPU", "group_idx": 3,
          "locality": "LOCAL", "ownership": "kvcr"}
    assert decode_batch(enc([1.0, [ev], 0])).events == [
        BlockRemoved(block_hashes=[B0], medium="CPU", group_idx=3, locality="LOCAL", ownership="kvcr")]


def test_extra_keys_with_bin_digest_kept_byte_exact():
    extra = [None, ["lora", ["mm-1", 4], "salt", b"\x01" * 32]]
    ev = {"type": "BlockStored", "block_hashes": [H0, H1], "parent_block_hash": None, "token_ids": TOKENS,
          "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None, "extra_keys": extra}
    (got,) = decode_batch(enc([1.0, [ev], 0])).events
    assert got.extra_keys == enc(extra)
    assert msgspec.msgpack.decode(got.extra_keys) == extra


def test_map_missing_defaulted_fields():
    (got,) = decode_batch(enc([1.0, [{"type": "BlockStored", "block_hashes": [H0]}], 0])).events
    assert got == BlockStored(block_hashes=[B0])


def test_sglang_map_with_salt_session_lora():
    ev = {"type": "BlockStored", "block_hashes": [-5], "parent_block_hash": -6, "token_ids": [1, 2],
          "block_size": 2, "lora_id": None, "medium": "DISK", "cache_salt": "t", "session_id": "s",
          "lora_name": "l"}
    (got,) = decode_batch(enc([1.0, [ev], 1])).events
    assert got == BlockStored(block_hashes=[canonical_hash(-5)], parent_block_hash=canonical_hash(-6),
                              token_ids=[1, 2], block_size=2, medium="DISK", cache_salt="t", session_id="s",
                              lora_name="l")


@pytest.mark.parametrize("as_map", [True, False])
def test_sglang_bigram_pairs(as_map):
    pairs = [[1, 2], [2, 3], [3, 4], [4, 5]]
    if as_map:
        ev = {"type": "BlockStored", "block_hashes": [-1], "parent_block_hash": None, "token_ids": pairs,
              "block_size": 4, "lora_id": None}
    else:
        ev = ["BlockStored", [-1], None, pairs, 4, None, "GPU"]
    for engine in ("auto", "sglang"):
        (got,) = decode_batch(enc([1.0, [ev], 0]), engine).events
        assert got.token_ids == [] and got.token_id_pairs == pairs and got.block_size == 4


def test_bytes_digests_last_8_bytes_and_kept():
    d0, d1 = bytes(range(32)), bytes(range(100, 132))
    ev = {"type": "BlockStored", "block_hashes": [d0, d1], "parent_block_hash": d1, "token_ids": [],
          "block_size": 0, "lora_id": None, "medium": "CPU", "lora_name": None}
    (got,) = decode_batch(enc([1.0, [ev], 0])).events
    assert got.block_hashes == [d0[-8:], d1[-8:]] and got.block_digests == [d0, d1]
    assert (got.parent_block_hash, got.parent_block_digest) == (d1[-8:], d1)
    (rm,) = decode_batch(enc([1.0, [["BlockRemoved", [d0], "GPU", 0]], 0])).events
    assert rm.block_hashes == [d0[-8:]] and rm.block_digests == [d0]


@pytest.mark.parametrize("medium, expected", [("cpu", "CPU"), ("GPU", "GPU"), ("cpu_pinned", "CPU_PINNED"),
                                              ("weird-Tier", "WEIRD-TIER"), (None, None)])
def test_medium_upper_cased_unknown_kept(medium, expected):
    ev = {"type": "BlockRemoved", "block_hashes": [1], "medium": medium}
    assert decode_batch(enc([1.0, [ev], 0])).events[0].medium == expected


def test_mixed_maps_and_arrays_in_one_batch():
    payload = enc([1.0, [["BlockRemoved", [H0], "GPU"], {"type": "BlockRemoved", "block_hashes": [H1]}], 0])
    assert decode_batch(payload).events == [BlockRemoved(block_hashes=[B0], medium="GPU"),
                                            BlockRemoved(block_hashes=[B1])]


# -- envelope ----------------------------------------------------------------------

def test_envelope_variants():
    ev = ["AllBlocksCleared"]
    assert decode_batch(enc([1.0, [ev]])).dp_rank is None  # vLLM 0.9.0
    assert decode_batch(enc([1.0, [ev], None])).dp_rank is None
    assert decode_batch(enc([2, [ev], 7])).ts == 2.0  # int ts accepted
    with_pid = decode_batch(enc([1.0, [ev], 4, b"\x00" * 16]))  # reserved publisher_id (open vLLM PR)
    assert (with_pid.dp_rank, with_pid.events) == (4, [AllBlocksCleared()])
    assert decode_batch(enc([1.0, [], 0])).events == []


# -- vLLM vs SGLang arrays (engine="auto") ------------------------------------------

def sg_array(*tail, lora_id=None, hashes=(H0,)):
    return ["BlockStored", list(hashes), None, [1, 2], 2, lora_id, "GPU", *tail]


@pytest.mark.parametrize(
    "arr, expect",
    [
        # index 7 str + lora_id None: vLLM always sends lora_id with lora_name -> SGLang cache_salt
        (sg_array("salt"), {"cache_salt": "salt"}),
        # index 7 str + lora_id set: vLLM lora_name
        (sg_array("sql-lora", lora_id=3), {"lora_name": "sql-lora", "lora_id": 3}),
        # ... unless a hash is negative (vLLM >= 0.10.2 hashes are unsigned)
        (sg_array("salt", lora_id=3, hashes=(-1,)), {"cache_salt": "salt", "lora_id": 3}),
        # index 8 str: extra_keys is never a str -> SGLang session_id
        (sg_array(None, "sess"), {"session_id": "sess"}),
        (sg_array("salt", "sess"), {"cache_salt": "salt", "session_id": "sess"}),
        # index 9 str: group_idx is never a str -> SGLang lora_name
        (sg_array(None, None, "lora"), {"lora_name": "lora"}),
        # index 8 list: vLLM extra_keys, index 7 then lora_name
        (sg_array("lora", [None]), {"lora_name": "lora", "extra_keys": b"\x91\xc0"}),
        # index 9 int: vLLM group_idx
        (sg_array(None, None, 2), {"group_idx": 2}),
        # all None after medium: both readings agree
        (sg_array(None, None, None), {}),
    ],
)
def test_auto_detect_ambiguous_arrays(arr, expect):
    hashes = [canonical_hash(h) for h in arr[1]]
    expected = BlockStored(block_hashes=hashes, token_ids=[1, 2], block_size=2, medium="GPU", **expect)
    payload = enc([1.0, [arr], 0])
    assert decode_batch(payload).events == [expected]
    # the fast path and the reference per-event path agree
    assert dec._decode_per_event(payload, "auto", False) == decode_batch(payload)


def test_forced_engine_layouts():
    payload = enc([1.0, [sg_array("x", lora_id=3)], 0])
    assert decode_batch(payload, "sglang").events[0].cache_salt == "x"
    assert decode_batch(payload, "vllm").events[0].lora_name == "x"
    assert decode_batch(enc([1.0, [sg_array("x")], 0]), "vllm").events[0].lora_name == "x"
    # SGLang layout stops at lora_name (index 9); a vLLM-only shape errors in it
    with pytest.raises(DecodeError, match=r"event 0 \(BlockStored\).*session_id"):
        decode_batch(enc([1.0, [sg_array(None, [None])], 0]), "sglang")


def test_sglang_only_medium_is_evidence():
    arr = sg_array("x", lora_id=3)
    arr[6] = "cpu_pinned"
    assert decode_batch(enc([1.0, [arr], 0])).events[0].cache_salt == "x"


# -- bad input -------------------------------------------------------------------------

@pytest.mark.parametrize(
    "payload, message",
    [
        (b"\xc1", "not valid msgpack"),
        (bytes.fromhex(SEQ1_HEX)[:-5], "not valid msgpack"),
        (bytes.fromhex(SEQ1_HEX) + b"\x00", "not valid msgpack"),
        (b"", "not valid msgpack"),
        (enc({"ts": 1.0, "events": []}), "envelope must be an array"),
        (enc([1.0]), "envelope has 1 element"),
        (enc(["now", []]), "envelope ts"),
        (enc([1.0, {"a": 1}]), "envelope events"),
        (enc([1.0, [], -1]), "envelope dp_rank"),
        (enc([1.0, [], "0"]), "envelope dp_rank"),
        (enc([1.0, [5], 0]), "event 0: expected a map or a tagged array, got int"),
        (enc([1.0, [[]], 0]), "event 0: array does not start with an event type"),
        (enc([1.0, [{"block_hashes": [1]}], 0]), "event 0: map without a string 'type'"),
        (enc([1.0, [["AllBlocksCleared"], {"type": "BlockPinned", "block_hashes": [1]}], 0]),
         "event 1: unknown event type 'BlockPinned'"),
        (enc([1.0, [["BlockStored", [1], None, [1]]], 0]), r"event 0 \(BlockStored\).*at least length 6"),
        (enc([1.0, [["BlockStored", [1], None, [1], -16, None]], 0]), "block_size"),
        (enc([1.0, [{"type": "BlockStored", "block_hashes": [1], "block_size": 2**31}]]), "block_size"),
        (enc([1.0, [{"type": "BlockStored", "block_hashes": [1], "token_ids": [2**63]}]]), "token_ids"),
        (enc([1.0, [{"type": "BlockStored", "block_hashes": [1], "lora_id": 2**64 - 1}]]), "lora_id"),
        (enc([1.0, [{"type": "BlockStored", "block_hashes": [1, b"x" * 32]}]]), "mixes int and bytes"),
        (enc([1.0, [{"type": "BlockRemoved", "block_hashes": [b"x" * 65]}]]), "block_hashes"),
        (enc([1.0, [{"type": "BlockRemoved", "block_hashes": [b""]}]]), "block_hashes"),
        (enc([1.0, [{"type": "BlockRemoved", "block_hashes": ["abc"]}]]), "block_hashes"),
        (enc([1.0, [{"type": "BlockRemoved", "block_hashes": [1], "medium": 3}]]), "medium"),
        (enc([1.0, [{"type": "BlockStored", "block_hashes": [1], "token_ids": [[1, 2], 3]}]]), "token_ids"),
        (enc([1.0, [{"type": "BlockStored", "block_hashes": [1], "group_idx": 2**31}]]), "group_idx"),
    ],
)
def test_bad_payloads(payload, message):
    for engine in ("auto", "vllm", "sglang"):
        with pytest.raises(DecodeError, match=message):
            decode_batch(payload, engine)


def test_unknown_event_type_can_be_skipped_and_counted():
    payload = enc([1.0, [{"type": "BlockPinned"}, ["AllBlocksCleared"], ["Heartbeat", 1]], 0])
    b = decode_batch(payload, skip_unknown=True)
    assert (b.events, b.unknown_events) == ([AllBlocksCleared()], 2)


def test_absurd_sizes_rejected_at_the_limits():
    ok = enc([1.0, [{"type": "BlockRemoved", "block_hashes": [1] * dec.MAX_HASHES_PER_EVENT}]])
    assert len(decode_batch(ok).events[0].block_hashes) == dec.MAX_HASHES_PER_EVENT
    too_many = enc([1.0, [{"type": "BlockRemoved", "block_hashes": [1] * (dec.MAX_HASHES_PER_EVENT + 1)}]])
    with pytest.raises(DecodeError, match=r"block_hashes.*length <= 1000000|length <= 1000000.*block_hashes"):
        decode_batch(too_many)
    too_many_events = enc([1.0, [["AllBlocksCleared"]] * (dec.MAX_EVENTS_PER_BATCH + 1)])
    with pytest.raises(DecodeError, match="envelope events"):
        decode_batch(too_many_events)


def test_inconsistent_token_count_is_not_rejected():
    # LMCache's last chunk / vLLM partial blocks: fewer tokens than block_size * blocks is legal
    ev = {"type": "BlockStored", "block_hashes": [1, 2], "token_ids": [1, 2, 3], "block_size": 256, "medium": "cpu"}
    (got,) = decode_batch(enc([1.0, [ev], 0])).events
    assert (got.token_ids, got.block_size, got.medium) == ([1, 2, 3], 256, "CPU")


def test_unknown_engine_argument():
    with pytest.raises(ValueError, match="engine must be one of"):
        decode_batch(bytes.fromhex(SEQ2_HEX), "trtllm")


# -- frames ---------------------------------------------------------------------------

def test_parse_frames_doc_multipart():
    payload = bytes.fromhex(SEQ1_HEX)
    frames = [bytes.fromhex("6b762d6576656e7473"), bytes.fromhex("0000000000000001"), payload]
    assert parse_frames(frames) == ("kv-events", 1, payload)
    assert parse_frames([b"", (2**63 - 1).to_bytes(8, "big"), b"x"]) == ("", 2**63 - 1, b"x")
    with pytest.raises(DecodeError, match="int64"):  # EventBatch.seq is an Avro long (issue 9, part 4)
        parse_frames([b"", (2**64 - 2).to_bytes(8, "big"), b"x"])
    assert parse_frames([bytearray(b"t"), memoryview(bytes(8)), b"p"]) == ("t", 0, b"p")


@pytest.mark.parametrize(
    "frames, message",
    [
        ([b"", bytes(8)], "3 frames"),
        ([b"", bytes(8), b"p", b"q"], "3 frames"),
        ([b"", bytes(4), b"p"], "8 bytes"),
        ([b"\xff", bytes(8), b"p"], "UTF-8"),
    ],
)
def test_parse_frames_bad(frames, message):
    with pytest.raises(DecodeError, match=message):
        parse_frames(frames)


def test_parse_replay_reply_both_layouts_and_end_markers():
    seq1 = (1).to_bytes(8, "big")
    assert parse_replay_reply([b"", b"kv-events", seq1, b"p1"]) == ("kv-events", 1, b"p1")  # >= 0.26
    assert parse_replay_reply([b"", seq1, b"p1"]) == ("", 1, b"p1")  # <= 0.25
    assert parse_replay_reply([b"", b"", END_SEQ, b""]) is None  # >= 0.26 end marker
    assert parse_replay_reply([b"", END_SEQ, b""]) is None  # <= 0.25 end marker
    assert parse_replay_reply([b"", b"kv", seq1, b""]) is None  # empty payload ends too
    assert parse_replay_reply([b"", END_SEQ, b"junk"]) is None  # END_SEQ ends too
    assert END_SEQ == (-1).to_bytes(8, "big", signed=True)


@pytest.mark.parametrize(
    "frames, message",
    [
        ([b"", b"p"], "3 or 4 frames"),
        ([b"", b"t", bytes(8), b"p", b"x"], "3 or 4 frames"),
        ([b"kv", bytes(8), b"p"], "empty delimiter"),
        ([b"", b"kv", bytes(7), b"p"], "8 bytes"),
    ],
)
def test_parse_replay_reply_bad(frames, message):
    with pytest.raises(DecodeError, match=message):
        parse_replay_reply(frames)


def test_formats_listed():
    assert ENGINE_FORMATS[0] == "vllm-0.9.0" and "sglang-0.5.23" in ENGINE_FORMATS
    assert len(set(ENGINE_FORMATS)) == len(ENGINE_FORMATS)
