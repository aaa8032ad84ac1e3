"""Engine adapters (issue 10, part 3): one release table per engine family, from which the format list,
the decoder's wire structs, the fleet's encoder and ``--engine auto`` labelling are derived."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest

from kvbus.producers import decode, engines, wire_structs
from kvbus.producers.engines import ADAPTERS, Adapter, detect_engine, new_adapter, release, resolve_format, row, vllm
from kvbus.schemas.events import AllBlocksCleared, BlockRemoved, BlockStored, without_tokens
from kvbus.simulator import engine_wire
from kvbus.simulator.vllm_shapes import VllmBlockRemoved as _VllmRemoved, VllmBlockStored as _VllmStored

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


def test_a_field_engines_send_as_kvbus_stores_it_takes_its_type_from_the_event_struct():
    """A new optional field needs no wire type of its own: with no WIRE_TYPES entry, ``session_id``
    decodes with BlockStored's type and default (and garbage in it is still refused)."""
    assert "session_id" not in wire_structs.WIRE_TYPES
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


# -- one conversion, one rule ------------------------------------------------------------------

def test_wire_types_list_only_the_fields_whose_wire_type_is_not_the_kvbus_structs():
    """Every other field a table names is decoded with the kvbus struct's own type and default."""
    struct_types = {f.name: f.type for cls in (BlockStored, BlockRemoved) for f in msgspec.structs.fields(cls)}
    for name, (wire, _) in wire_structs.WIRE_TYPES.items():
        assert wire != struct_types[name], name
    assert {"medium", "lora_name", "locality", "ownership", "session_id", "cache_salt"}.isdisjoint(
        wire_structs.WIRE_TYPES)




@pytest.mark.parametrize("ev", [
    _VllmStored(block_hashes=[1, 2**64 - 1], parent_block_hash=5, token_ids=list(range(32)), block_size=16,
                lora_id=None, medium="gpu", lora_name=None, group_idx=0, kv_cache_spec_kind="full_attention"),
    _VllmStored(block_hashes=[bytes(range(32))], parent_block_hash=bytes(range(32, 64)), token_ids=[7] * 16,
                block_size=16, lora_id=3, medium="Cpu", lora_name="sql", extra_keys=[["sql", ["mm", 0]]],
                ownership="kvcr", session_id="s-1", lookahead_token_ids=[[1, 2]], kv_cache_spec_sliding_window=64),
    _VllmStored(block_hashes=[9], parent_block_hash=None, token_ids=[], block_size=0, lora_id=None, medium=None,
                lora_name=None),
    _VllmRemoved(block_hashes=[2**63 + 5], medium="cpu", group_idx=1, locality="REMOTE"),
    _VllmRemoved(block_hashes=[bytes(range(16)), bytes(range(16, 32))], medium="GPU", ownership="kvcr"),
])
def test_the_bridge_and_the_publisher_convert_an_engine_event_alike(ev):
    """What the bridge decodes from an engine's event on the wire and what the in-process publisher makes
    of the engine's object are the same kvbus event, through either of the publisher's paths."""
    from kvbus.producers.publisher import encode_engine_event, to_kvbus_event
    from kvbus.schemas.codec import decode_event, encode_event

    (bridged,) = decode.decode_batch(msgspec.msgpack.encode([1.0, [ev], 0])).events
    assert bridged == to_kvbus_event(ev)
    assert decode_event(encode_engine_event(ev)) == bridged and encode_engine_event(ev) == encode_event(bridged)
    assert bridged.medium == (None if ev.medium is None else ev.medium.upper())
    # without the prompt's tokens (KVBUS_KEEP_TOKEN_IDS off), alike too
    (tokenless,) = decode.decode_batch(msgspec.msgpack.encode([1.0, [ev], 0]), keep_tokens=False).events
    assert tokenless == without_tokens(bridged)
    assert encode_engine_event(ev, keep_tokens=False) == encode_event(tokenless)


def test_sglang_bigram_pairs_become_token_id_pairs_in_the_bridge_and_the_publisher():
    class SglangStored(msgspec.Struct, tag="BlockStored"):
        block_hashes: list
        parent_block_hash: object
        token_ids: list
        block_size: int
        lora_id: object = None
        medium: object = None

    SglangStored.__name__ = "BlockStored"
    from kvbus.producers.publisher import encode_engine_event
    from kvbus.schemas.codec import decode_event

    ev = SglangStored(block_hashes=[-5], parent_block_hash=None, token_ids=[[1, 2], [2, 3]], block_size=2)
    want = BlockStored(block_hashes=[(-5 % 2**64).to_bytes(8, "big")], token_ids=[], block_size=2,
                       token_id_pairs=[[1, 2], [2, 3]])
    assert decode.decode_batch(msgspec.msgpack.encode([1.0, [ev], 0])).events == [want]
    assert decode_event(encode_engine_event(ev)) == want
    tokenless = msgspec.structs.replace(want, token_id_pairs=None)
    assert decode.decode_batch(msgspec.msgpack.encode([1.0, [ev], 0]), keep_tokens=False).events == [tokenless]
    assert decode_event(encode_engine_event(ev, keep_tokens=False)) == tokenless


def _array(*tail, lora_id=None, hashes=(1,), medium="GPU"):
    return ["BlockStored", list(hashes), None, [1, 2], 2, lora_id, medium, *tail]


@pytest.mark.parametrize("arr, label", [
    (_array("salt"), "sglang"),  # a LoRA name without lora_id: SGLang's cache_salt
    (_array("sql", lora_id=3, hashes=(2**63,)), "vllm"),  # unsigned: vLLM's lora_name
    (_array("salt", lora_id=3, hashes=(-1,)), "sglang"),
    (_array(None, "sess"), "sglang"),
    (_array(None, None, "lora"), "sglang"),
    (_array(None, [None], hashes=(2**63,)), "vllm"),
    (_array(None, None, 2, hashes=(2**63,)), "vllm"),
    (_array("x", lora_id=3, medium="cpu_pinned"), "sglang"),  # SGLang's own medium
    (_array(hashes=(-1,)), "sglang"),
    (_array(hashes=(2**63,)), "vllm"),
    (_array(), None),  # fits both: the readings are the same event
    (_array(None, None, None), None),
])
def test_the_decoder_and_the_stream_label_follow_one_rule(arr, label):
    """``decode_batch(engine="auto")`` reads an array with the layout of the family ``--engine auto``
    labels the stream with (one rule: engines.senders); where both fit, it reads the vLLM layout."""
    payload = msgspec.msgpack.encode([1.0, [arr], 0])
    assert detect_engine(payload) == label
    assert engines.array_layout(arr) == (label or "vllm")
    expected = decode.decode_batch(payload, label or "vllm")
    assert decode.decode_batch(payload) == expected == decode._decode_per_event(payload, "auto", False)


# -- a new optional field, added to copies of the schemas and of a release table ---------------

ROOT = Path(__file__).resolve().parents[1]

NEW_FIELD_RUN = r'''
import msgspec
from dataclasses import replace

from kvbus.simulator import engine_wire
from kvbus.producers.decode import decode_batch
from kvbus.producers.publisher import KafkaEventPublisher
from kvbus.schemas.codec import FastSerde
from kvbus.schemas.events import BlockRemoved, EventBatch
from kvbus.schemas.serde import registry_client
from kvbus.runtime.settings import Settings
from kvbus.schemas.topics import Topics
from tests.recording_producer import RecordingProducer

want = BlockRemoved(block_hashes=[(7).to_bytes(8, "big")], medium="GPU", evicted_by="kvcr-3")
serde = FastSerde(registry_client("mock://new-field"), "EventBatch")

# the bridge: the decoder, then the record it writes
sent = msgspec.msgpack.encode([1.0, [{"type": "BlockRemoved", "block_hashes": [7], "medium": "gpu",
                                      "evicted_by": "kvcr-3"}], 0])
for payload in (sent, engine_wire.encode_batch("vllm-0.35", 1.0, [want])):
    batch = decode_batch(payload)
    assert batch.events == [want], batch.events
    record = serde.dumps(EventBatch(replica="r", seq=0, ts=batch.ts, events=batch.events), "t.raw")
    assert serde.loads(record, "t.raw").events == [want]


# the publisher: vLLM 0.35's BlockRemoved (a msgspec struct) and any object of that name
class BlockRemoved035(msgspec.Struct, tag="BlockRemoved"):
    block_hashes: list
    medium: object
    group_idx: object = None
    locality: object = None
    ownership: object = None
    evicted_by: object = None


BlockRemoved035.__name__ = "BlockRemoved"
Plain = type("BlockRemoved", (), {})
plain = Plain()
plain.block_hashes, plain.medium, plain.evicted_by = [7], "gpu", "kvcr-3"


class Batch(msgspec.Struct):
    ts: float
    events: list


producer = RecordingProducer()
settings = replace(Settings(), bootstrap="127.0.0.1:1", topics=Topics(raw="t.raw"))
pub = KafkaEventPublisher(replica="r", settings=settings, schema_id=serde.schema_id("t.raw"), producer=producer)
pub.publish(Batch(ts=1.0, events=[BlockRemoved035(block_hashes=[7], medium="gpu", evicted_by="kvcr-3"), plain,
                                  BlockRemoved035(block_hashes=[7], medium="gpu")]))
pub.shutdown(timeout=0.1)
_, value = producer.on("t.raw")[-1]
got = serde.loads(value, "t.raw").events
assert got == [want, want, BlockRemoved(block_hashes=want.block_hashes, medium="GPU")], got
print("evicted_by arrived")
'''


def product_copy_with_new_removed_field(source: Path, dest: Path) -> Path:
    """The package of checkout ``source`` laid out under ``dest`` as installed (``kvbus``, ``kvbus.producers``,
    ``kvbus.schemas``, ``kvbus.runtime``), with what a developer writes for a vLLM release that adds an optional
    BlockRemoved field ``evicted_by``: the field in the ``.avsc`` and in the struct, and a release-table row."""
    skip = shutil.ignore_patterns("__pycache__")
    shutil.copytree(source / "commands", dest / "kvbus", ignore=skip)
    for pkg in ("producers", "schemas", "runtime"):
        shutil.copytree(source / pkg, dest / "kvbus" / pkg, ignore=skip)
    avsc = dest / "kvbus/schemas/avro/kvbus.BlockRemoved.avsc"
    schema = json.loads(avsc.read_text())
    schema["fields"].append({"name": "evicted_by", "type": ["null", "string"], "default": None})
    avsc.write_text(json.dumps(schema))
    events = dest / "kvbus/schemas/events.py"
    text, end = events.read_text(), "\n\n\nclass AllBlocksCleared("
    assert text.index("class BlockRemoved(") < text.index(end), "BlockRemoved is not followed by AllBlocksCleared"
    events.write_text(text.replace(end, '\n    evicted_by: str | None = None\n    """Who evicted them."""' + end))
    table = dest / "kvbus/producers/engines/vllm.py"
    text, n = re.subn(r"(\nTABLE = \((?:.|\n)*?)\n\)\n", r'\1\n    row("vllm-0.35", removed=("evicted_by",)),\n)\n',
                      table.read_text(), count=1)
    assert n == 1, "vllm.py has no TABLE = (...) to add a row to"
    table.write_text(text)
    return dest


def run_in_copy(root: Path, script: str) -> subprocess.CompletedProcess:
    """Run ``script`` with ``kvbus`` imported from the copy ``root`` (and ``tests`` from this checkout)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(ROOT)])}
    return subprocess.run([sys.executable, "-c", script], cwd=root, env=env, capture_output=True, text=True,
                          timeout=120)


def test_an_optional_blockremoved_field_added_to_the_schemas_and_a_table_arrives_through_bridge_and_publisher(
        tmp_path):
    """A copy of the product with a new optional BlockRemoved field in its schemas and a vLLM release row
    sending it: the bridge's decoder and record, and the publisher (fast path stepping aside, generic
    path), carry it, with no other edit."""
    copy = product_copy_with_new_removed_field(ROOT, tmp_path)
    done = run_in_copy(copy, NEW_FIELD_RUN)
    assert done.returncode == 0 and "evicted_by arrived" in done.stdout, done.stdout + done.stderr
