"""Engine adapters (issue 10, part 3): one release table per engine family, from which the format list,
the decoder's wire structs, the fleet's encoder and ``--engine auto`` labelling are derived."""
from __future__ import annotations

import time

import msgspec
import pytest

from kvbus import engine_wire
from kvbus.producers import decode, engines, wire_structs
from kvbus.producers.engines import ADAPTERS, Adapter, detect_engine, new_adapter, release, resolve_format, row, vllm
from kvbus.schemas.events import AllBlocksCleared, BlockRemoved, BlockStored

TOP = (0x8000_0000_0000_0001).to_bytes(8, "big")
"""A hash with the top bit set: negative where a release writes signed ints."""


def test_the_format_list_is_kept_once():
    assert decode.ENGINE_FORMATS is engines.FORMATS and engine_wire.FORMATS is engines.FORMATS
    assert len(engines.FORMATS) == 17
    assert engines.FORMATS == tuple(f for a in ADAPTERS.values() for f in a.formats)
    assert engine_wire.wire_format("vllm-0.26") is release("vllm-0.26")


def test_registry_maps_engine_names_to_adapters():
    assert [new_adapter(n).engine for n in ("vllm", "sglang", "lmcache")] == ["vllm", "sglang", "lmcache"]
    assert new_adapter("lmcache").label == "vllm"  # LMCache events travel in a vLLM stream
    with pytest.raises(ValueError):
        new_adapter("trtllm")
    assert resolve_format("vllm-0.27.1") == "vllm-0.26" and resolve_format("sglang-0.5.21") == "sglang-0.5.20"


def test_decoder_layouts_come_from_the_tables():
    stored, removed = wire_structs.LAYOUT_FIELDS["vllm"]
    assert stored == release("vllm-0.22").stored and removed == release("vllm-0.22").removed  # last array release
    assert wire_structs.LAYOUT_FIELDS["sglang"][0] == release("sglang-0.5.23").stored
    assert set(wire_structs.LAYOUT_FIELDS["map"][0]) == {f for r in engines.RELEASES.values() for f in r.stored}
    assert decode.ENGINES == ("auto", "vllm", "sglang")


def test_a_new_vllm_release_is_one_table_row():
    """What a vLLM 0.35 that starts sending ``cache_salt`` (a field kvbus knows) takes: one row."""
    table = vllm.TABLE + (row("vllm-0.35", stored=("cache_salt",)),)
    adapter = Adapter("vllm", "vllm", table, vllm.FIRST, array_layout="vllm")
    new = adapter.releases[-1]
    assert new.name == "vllm-0.35" and new.stored == release("vllm-0.33").stored + ("cache_salt",)
    assert (new.maps, new.replay_topic, new.removed) == (True, True, release("vllm-0.33").removed)
    assert adapter.array_fields() == ADAPTERS["vllm"].array_fields()  # arrays unchanged
    ev = {"type": "BlockStored", **{f: None for f in new.stored[:7]}, "block_hashes": [1], "cache_salt": "s"}
    assert adapter.consistent(ev) and not ADAPTERS["vllm"].consistent(ev)
    assert all(wire_structs.wire_type(f) for f in new.stored)  # the decoder has a type for each field


def test_a_field_engines_send_as_kvbus_stores_it_takes_its_type_from_the_event_struct(monkeypatch):
    """A new optional field needs no wire type of its own: without its WIRE_TYPES entry,
    ``session_id`` decodes with BlockStored's type and default (and garbage in it is still refused)."""
    monkeypatch.delitem(wire_structs.WIRE_TYPES, "session_id")
    t, d = wire_structs.wire_type("session_id")
    assert d is None and msgspec.convert(None, t) is None and msgspec.convert("s", t) == "s"
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert(3, t)
    with pytest.raises(KeyError, match="no type"):
        wire_structs.wire_type("never_heard_of")


def _events() -> list:
    return [
        BlockStored(block_hashes=[TOP], parent_block_hash=None, token_ids=list(range(16)), block_size=16,
                    medium="GPU"),
        BlockRemoved(block_hashes=[TOP], medium="GPU"),
        AllBlocksCleared(),
    ]


@pytest.mark.parametrize("fmt", engines.FORMATS)
def test_detect_engine_labels_every_format(fmt):
    payload = engine_wire.encode_batch(fmt, 1.0, _events())
    assert detect_engine(payload) == ADAPTERS[release(fmt).engine].label
    assert detect_engine(engine_wire.encode_batch(fmt, 1.0, [AllBlocksCleared()])) is None  # says nothing


def test_detect_engine_survives_garbage():
    assert detect_engine(b"\xc1") is None and detect_engine(b"\x93\x01\x02\x03") is None


@pytest.mark.parametrize("fmt, label", [("sglang-0.5.20", "sglang"), ("sglang-0.5.10", "sglang"),
                                        ("vllm-0.33", "vllm"), ("lmcache-0.5.6", "vllm")])
def test_bridge_auto_labels_the_stream_by_its_engine(fmt, label):
    """``--engine auto`` used to label every stream vllm, SGLang map streams included."""
    from tests.test_bridge_zmq import Harness, wait_for

    hs = Harness(fmt=fmt).start()
    try:
        hs.connected()
        for _ in range(3):
            hs.pub.publish(_events(), ts=time.time())
        wait_for(lambda: len(hs.data()) == 3, what="3 batches")
        assert {b.engine for b in hs.data()} == {label}
    finally:
        hs.stop()
