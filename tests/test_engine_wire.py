"""kvbus.simulator.engine_wire: byte-exact engine encodings (protocol doc §11), layouts per release, frames."""
from __future__ import annotations

import msgspec
import pytest

from kvbus.producers.decode import ENGINE_FORMATS, decode_batch, parse_frames, parse_replay_reply
from kvbus.schemas.events import AllBlocksCleared, BlockRemoved, BlockStored, Reset, canonical_hash
from kvbus.simulator import engine_wire as ew
from kvbus.simulator.engine_wire import (
    FORMATS,
    encode_batch,
    encode_frames,
    encode_replay_reply,
    project,
    replay_end,
    resolve_format,
    wire_format,
)

# Protocol doc §11 (the seq-1 hex with the "x" of "group_idx" the doc's hex dump drops; it states 76 bytes).
H0 = 1403909460543360175
H1 = 1643945449041937783
TOKENS = list(range(1, 33))
SEQ1_HEX = ("93cb41da13b8605000009184a474797065ac426c6f636b52656d6f766564ac626c6f636b5f68617368657391cf16d077ad"
            "0843c577a66d656469756da3475055a967726f75705f6964780000")
SEQ2_HEX = "93cb41da13b8608000009181a474797065b0416c6c426c6f636b73436c656172656400"
ARRAY_SEQ1_HEX = "93cb41da13b8605000009194ac426c6f636b52656d6f76656491cf16d077ad0843c577a34750550000"
SGLANG_HEX = ("93cb41da13b8605000009183a474797065ac426c6f636b52656d6f766564ac626c6f636b5f686173686573"
              "91d3eeddef0b82167eeba66d656469756daa4350555f50494e4e454400")

B0, B1 = canonical_hash(H0), canonical_hash(H1)
MAP_VLLM = [f for f in FORMATS if f.startswith("vllm") and wire_format(f).maps]
SEQ0 = BlockStored(block_hashes=[B0, B1], token_ids=TOKENS, block_size=16, medium="GPU",
                   extra_keys=b"\x92\xc0\xc0", group_idx=0, kv_cache_spec_kind="full_attention")
REMOVED1 = BlockRemoved(block_hashes=[B1], medium="GPU", group_idx=0)


def wire(payload: bytes):
    return msgspec.msgpack.decode(payload)


def test_formats_equal_decoder_formats():
    assert FORMATS == ENGINE_FORMATS


# -- §11 vectors, byte for byte ----------------------------------------------------

@pytest.mark.parametrize("fmt", MAP_VLLM)
def test_seq1_map_vector(fmt):
    payload = encode_batch(fmt, 1750000001.25, [REMOVED1], 0)
    assert payload.hex() == SEQ1_HEX and len(payload) == 76


def test_seq1_lmcache_has_no_group_idx():
    assert wire(encode_batch("lmcache-0.5.6", 1750000001.25, [REMOVED1], 0)) == [
        1750000001.25, [{"type": "BlockRemoved", "block_hashes": [H1], "medium": "GPU"}], 0]


@pytest.mark.parametrize("fmt", MAP_VLLM)
def test_seq2_vector(fmt):
    assert encode_batch(fmt, 1750000002.0, [AllBlocksCleared()], 0).hex() == SEQ2_HEX


@pytest.mark.parametrize("fmt", ["vllm-0.20", "vllm-0.22"])
def test_array_seq1_vector(fmt):
    payload = encode_batch(fmt, 1750000001.25, [REMOVED1], 0)
    assert payload.hex() == ARRAY_SEQ1_HEX and len(payload) == 41


def test_array_seq1_older_releases():
    # "0.10.2-0.19 drop the trailing 0 element; 0.9.0-0.10.1 have [tag, hashes] only"
    for fmt in ("vllm-0.10.2", "vllm-0.14", "vllm-0.17"):
        assert wire(encode_batch(fmt, 1750000001.25, [REMOVED1], 0)) == [
            1750000001.25, [["BlockRemoved", [H1], "GPU"]], 0]
    assert wire(encode_batch("vllm-0.9.2", 1.0, [REMOVED1], 0)) == [1.0, [["BlockRemoved", [H1]]], 0]
    assert wire(encode_batch("vllm-0.9.0", 1.0, [REMOVED1], 0)) == [1.0, [["BlockRemoved", [H1]]]]


@pytest.mark.parametrize("fmt", ["sglang-0.5.20", "sglang-0.5.22", "sglang-0.5.23"])
def test_sglang_vector(fmt):
    ev = BlockRemoved(block_hashes=[canonical_hash(-1234567890123456789)], medium="CPU_PINNED")
    payload = encode_batch(fmt, 1750000001.25, [ev], 0)
    assert payload.hex() == SGLANG_HEX and len(payload) == 72


@pytest.mark.parametrize("fmt", MAP_VLLM)
def test_seq0_payload(fmt):
    payload = encode_batch(fmt, 1750000000.5, [SEQ0], 0)
    doc_event = {"type": "BlockStored", "block_hashes": [H0, H1], "parent_block_hash": None, "token_ids": TOKENS,
                 "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None,
                 "extra_keys": [None, None], "group_idx": 0, "kv_cache_spec_kind": "full_attention"}
    assert payload == msgspec.msgpack.encode([1750000000.5, [doc_event], 0])
    assert len(payload) == 228  # the doc says 230: see test_decode.test_seq0_map_vector


def test_stored_array_lengths():
    # "The corresponding 0.22-0.23 BlockStored is a 12-element array (0.20-0.21: 10 elements)"
    ev = BlockStored(block_hashes=[B1], parent_block_hash=B0, token_ids=TOKENS[16:], block_size=16,
                     medium="GPU", extra_keys=b"\x91\xc0", group_idx=0, kv_cache_spec_kind="full_attention")
    (arr,) = wire(encode_batch("vllm-0.22", 1.0, [ev], 0))[1]
    assert arr == ["BlockStored", [H1], H0, TOKENS[16:], 16, None, "GPU", None, [None], 0, "full_attention", None]
    expected_len = {"vllm-0.9.0": 6, "vllm-0.9.2": 6, "vllm-0.10.2": 7, "vllm-0.14": 8, "vllm-0.17": 9,
                    "vllm-0.20": 10, "vllm-0.22": 12, "sglang-0.5.10": 7}
    for fmt, n in expected_len.items():
        (arr,) = wire(encode_batch(fmt, 1.0, [ev], 0))[1]
        assert len(arr) == n, fmt


def test_map_required_fields_always_written_defaults_omitted():
    ev = BlockStored(block_hashes=[B0], session_id="s", cache_salt="salt", ownership="kvcr")
    (m,) = wire(encode_batch("vllm-0.33", 1.0, [ev], 0))[1]
    assert m == {"type": "BlockStored", "block_hashes": [H0], "parent_block_hash": None, "token_ids": [],
                 "block_size": 0, "lora_id": None, "medium": None, "lora_name": None, "ownership": "kvcr",
                 "session_id": "s"}
    assert list(m)[0] == "type"
    (m,) = wire(encode_batch("vllm-0.29", 1.0, [ev], 0))[1]
    assert "session_id" not in m and m["ownership"] == "kvcr"
    (m,) = wire(encode_batch("sglang-0.5.23", 1.0, [ev], 0))[1]
    assert m == {"type": "BlockStored", "block_hashes": [H0], "parent_block_hash": None, "token_ids": [],
                 "block_size": 0, "lora_id": None, "cache_salt": "salt", "session_id": "s"}
    (m,) = wire(encode_batch("sglang-0.5.20", 1.0, [BlockRemoved(block_hashes=[B0])], 0))[1]
    assert m == {"type": "BlockRemoved", "block_hashes": [H0]}


def test_hash_encodings():
    big = canonical_hash(2**64 - 2)  # top bit set
    ev = BlockRemoved(block_hashes=[big], medium="GPU")
    assert bytes.fromhex("91cf" + "ff" * 7 + "fe") in encode_batch("vllm-0.33", 1.0, [ev], 0)  # uint64
    assert bytes.fromhex("91fe") in encode_batch("sglang-0.5.23", 1.0, [ev], 0)  # int64 -2 as fixint
    (m,) = wire(encode_batch("sglang-0.5.23", 1.0, [ev], 0))[1]
    assert m["block_hashes"] == [-2]  # signed int64
    (a,) = wire(encode_batch("vllm-0.9.2", 1.0, [ev], 0))[1]
    assert a == ["BlockRemoved", [-2]]  # builtin hash(): signed


def test_raw_hashes():
    d0, d1 = bytes(range(32)), bytes(range(32, 64))
    ev = BlockStored(block_hashes=[canonical_hash(d1)], parent_block_hash=canonical_hash(d0), token_ids=[1],
                     block_size=1, block_digests=[d1], parent_block_digest=d0)
    (m,) = wire(encode_batch("vllm-0.33", 1.0, [ev], 0, raw_hashes=True))[1]
    assert m["block_hashes"] == [d1] and m["parent_block_hash"] == d0
    got = decode_batch(encode_batch("vllm-0.17", 1.0, [ev], 0, raw_hashes=True)).events
    assert got == [project("vllm-0.17", ev, raw_hashes=True)] and got[0].block_digests == [d1]
    for fmt in ("vllm-0.9.2", "sglang-0.5.23"):
        with pytest.raises(ValueError, match="cannot send bytes"):
            encode_batch(fmt, 1.0, [ev], 0, raw_hashes=True)
    with pytest.raises(ValueError, match="block_digests"):
        encode_batch("vllm-0.33", 1.0, [BlockRemoved(block_hashes=[B0])], 0, raw_hashes=True)
    with pytest.raises(ValueError, match="parent_block_digest"):
        encode_batch("vllm-0.33", 1.0, [BlockStored(block_hashes=[B0], parent_block_hash=B1,
                                                    block_digests=[d0])], 0, raw_hashes=True)


def test_sglang_bigram_pairs_on_the_wire():
    ev = BlockStored(block_hashes=[B0], token_ids=[1, 2, 3], token_id_pairs=[[1, 2], [2, 3]], block_size=2)
    (m,) = wire(encode_batch("sglang-0.5.23", 1.0, [ev], 0))[1]
    assert m["token_ids"] == [[1, 2], [2, 3]]
    assert decode_batch(encode_batch("sglang-0.5.23", 1.0, [ev], 0)).events == [project("sglang-0.5.23", ev)]
    assert project("sglang-0.5.10", ev).token_ids == [] and project("vllm-0.33", ev).token_id_pairs is None


def test_lmcache_lower_case_medium_and_field_set():
    ev = BlockStored(block_hashes=[B0], token_ids=list(range(256)), block_size=256, medium="CPU",
                     lora_name="l", lora_id=1, group_idx=0, session_id="s")
    (m,) = wire(encode_batch("lmcache-0.5.6", 1.0, [ev], 0))[1]
    assert m["medium"] == "cpu" and "group_idx" not in m and "session_id" not in m
    (got,) = decode_batch(encode_batch("lmcache-0.5.6", 1.0, [ev], 0)).events
    assert got == project("lmcache-0.5.6", ev)
    assert (got.medium, got.lora_name, got.group_idx, got.session_id) == ("CPU", "l", None, None)


def test_extra_keys_written_verbatim():
    extra = msgspec.msgpack.encode([["sql-lora", ["abc123", 0], "tenant-a"]])
    ev = BlockStored(block_hashes=[B0], lora_id=1, lora_name="sql-lora", extra_keys=extra)
    assert extra in encode_batch("vllm-0.17", 1.0, [ev], 0)
    assert extra not in encode_batch("vllm-0.14", 1.0, [ev], 0)
    with pytest.raises(ValueError, match="extra_keys"):
        encode_batch("vllm-0.33", 1.0, [BlockStored(block_hashes=[B0], extra_keys=b"\x92\xc0")], 0)


def test_envelope_dp_rank_and_publisher_id():
    assert wire(encode_batch("vllm-0.33", 1.0, [], None)) == [1.0, [], None]
    assert wire(encode_batch("vllm-0.33", 1.0, [], 5, publisher_id=b"p" * 16)) == [1.0, [], 5, b"p" * 16]
    assert decode_batch(encode_batch("vllm-0.33", 1.0, [], 5, publisher_id=b"p" * 16)).dp_rank == 5
    assert wire(encode_batch("vllm-0.9.0", 1.0, [], 5)) == [1.0, []]


def test_rejects_non_engine_events_and_unknown_formats():
    with pytest.raises(ValueError, match="Reset"):
        encode_batch("vllm-0.33", 1.0, [Reset(reason="bridge-start")], 0)
    with pytest.raises(ValueError, match="unknown engine format"):
        encode_batch("vllm-9.9", 1.0, [], 0)


def test_project_drops_fields_the_release_lacks():
    ev = BlockStored(block_hashes=[B0], token_ids=[1], block_size=1, lora_id=2, medium="gpu", lora_name="l",
                     extra_keys=b"\xc0", group_idx=1, locality="LOCAL", ownership="o", session_id="s",
                     lookahead_token_ids=[[1]], cache_salt="c", block_digests=[bytes(32)])
    assert project("vllm-0.9.0", ev) == BlockStored(block_hashes=[B0], token_ids=[1], block_size=1, lora_id=2)
    assert project("vllm-0.14", ev) == BlockStored(block_hashes=[B0], token_ids=[1], block_size=1, lora_id=2,
                                                   medium="GPU", lora_name="l")
    assert project("sglang-0.5.20", ev) == BlockStored(block_hashes=[B0], token_ids=[1], block_size=1, lora_id=2,
                                                       medium="GPU", cache_salt="c", session_id="s")
    p33 = project("vllm-0.33", ev)
    assert (p33.lookahead_token_ids, p33.cache_salt, p33.block_digests) == ([[1]], None, None)
    assert project("vllm-0.10.2", BlockRemoved(block_hashes=[B0], medium="x", group_idx=1)) == BlockRemoved(
        block_hashes=[B0], medium="X")


# -- frames -----------------------------------------------------------------------

def test_encode_frames_doc_multipart():
    payload = bytes.fromhex(SEQ1_HEX)
    frames = encode_frames("kv-events", 1, payload)
    assert frames == [bytes.fromhex("6b762d6576656e7473"), bytes.fromhex("0000000000000001"), payload]
    assert parse_frames(frames) == ("kv-events", 1, payload)
    assert encode_frames("", 0, b"p")[0] == b""


def test_replay_layouts_per_release():
    p = b"payload"
    with_topic = [f for f in FORMATS if wire_format(f).replay_topic]
    assert with_topic == ["vllm-0.26", "vllm-0.29", "vllm-0.30", "vllm-0.33", "sglang-0.5.23", "lmcache-0.5.6"]
    for fmt in FORMATS:
        reply, end = encode_replay_reply(fmt, "kv-events", 2, p), replay_end(fmt)
        if fmt in with_topic:  # doc §11: ["", "kv-events", seq, payload] then ["", "", ff*8, ""]
            assert reply == [b"", b"kv-events", (2).to_bytes(8, "big"), p]
            assert end == [b"", b"", b"\xff" * 8, b""]
            assert parse_replay_reply(reply) == ("kv-events", 2, p)
        else:
            assert reply == [b"", (2).to_bytes(8, "big"), p] and end == [b"", b"\xff" * 8, b""]
            assert parse_replay_reply(reply) == ("", 2, p)
        assert parse_replay_reply(end) is None


@pytest.mark.parametrize(
    "name, fmt",
    [("vllm-0.33", "vllm-0.33"), ("vllm-0.27.1", "vllm-0.26"), ("vllm-0.10.1", "vllm-0.9.2"),
     ("vllm-0.23.0", "vllm-0.22"), ("vllm-0.25", "vllm-0.24"), ("vllm-0.40", "vllm-0.33"),
     ("sglang-0.5.19", "sglang-0.5.10"), ("sglang-0.5.21", "sglang-0.5.20"), ("lmcache-0.6.0", "lmcache-0.5.6")],
)
def test_resolve_format(name, fmt):
    assert resolve_format(name) == fmt


@pytest.mark.parametrize("name", ["vllm-0.8.5", "trtllm-1.0", "sglang-0.4.0", "vllm"])
def test_resolve_format_rejects(name):
    with pytest.raises(ValueError):
        resolve_format(name)


def test_every_format_roundtrips_the_seq0_event():
    for fmt in FORMATS:
        b = decode_batch(encode_batch(fmt, 1750000000.5, [SEQ0, REMOVED1, AllBlocksCleared()], 3))
        assert b.events == [project(fmt, e) for e in (SEQ0, REMOVED1, AllBlocksCleared())], fmt
        assert b.dp_rank == (None if fmt == "vllm-0.9.0" else 3)
    assert ew.END_SEQ == b"\xff" * 8
