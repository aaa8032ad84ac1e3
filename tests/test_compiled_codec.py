"""The compiled build of the generated codec (kvbus.schemas.codec_build, made by ``./dev setup``) is the
reference codec (``exec`` of the generated source) run faster: byte for byte the same encodings, equal
decodings, and the same exception types on bad input, for any record the schemas allow (tests/strategies.py)
and for the hostile inputs of the fuzz tests (tests/test_fuzz_*.py). A build of another source, a build
that does not load, and ``KVBUS_COMPILED_CODEC=0`` leave a codec on the reference path."""
from __future__ import annotations

import importlib.machinery
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from kvbus.producers.decode import DecodeError, decode_batch
from kvbus.schemas import codec_build
from kvbus.schemas.codec import CODEC, Codec, build, compiled_codec_setting
from kvbus.schemas.events import BlockEvent, BlockEvents, BlockRemoved, BlockStored, EventBatch, PositionedEvent
from kvbus.schemas.serde import RecordSerde, registry_client
from kvbus.schemas.topics import Topics
from tests.hostile import engine_inputs
from tests.strategies import batches, block_events, dead_letters, events, incompletes, ints, longs, text

REFERENCE = build(compiled=False)
COMPILED = build(compiled=True)
needs_build = pytest.mark.skipif(not COMPILED.compiled, reason=f"the compiled codec is not built: {COMPILED.path}")

KINDS = {"EventBatch": batches, "BlockEvent": block_events, "Incomplete": incompletes, "DeadLetter": dead_letters,
         "BlockEvents": st.builds(BlockEvents, replica=text, epoch=longs, seq=longs, ts=st.floats(allow_nan=False),
                                  events=st.lists(st.builds(PositionedEvent, index=ints, event=events), max_size=5),
                                  dp_rank=ints)}
SHAPES = {BlockStored: ("block_hashes", "parent_block_hash", "token_ids", "block_size", "medium", "group_idx",
                        "kv_cache_spec_kind"),
          BlockRemoved: ("block_hashes", "medium", "group_idx")}
"""The positional writers kvbus.producers.publisher asks for (the bridge's hot path)."""
WRONG = [b"x", b"\x00" * 9, "x", "é", 1.5, -1, 2**70, None, [None], ["x"], [b"abc"], [2**70], [1.5], object()]
"""Values of the wrong type or range for some field: the encoders must fail (or not) alike."""
HYPO = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def outcome(call: Callable[..., Any], *args: Any) -> tuple[str, Any]:
    """("ok", the value's repr: a NaN read from mangled bytes equals itself, -0.0 differs from 0.0, ints
    past 64 bits from a 10-byte varint are kept) or ("raised", the exception's type)."""
    try:
        value = call(*args)
    except Exception as exc:
        return "raised", type(exc)
    return "ok", repr(value)


def raw(avro: bytes, kept: Any, without: Any) -> tuple:
    """A scanned block event as a comparable tuple (the scanner's ``raw`` factory)."""
    return avro, kept, without


def same_decoding(kind: str, data: bytes, pos: int = 0) -> None:
    """Both codecs decode ``data[pos:]`` as ``kind`` to equal values, or raise the same type."""
    assert outcome(COMPILED.decode, kind, data, pos) == outcome(REFERENCE.decode, kind, data, pos)
    if kind == "EventBatch":
        scans = [outcome(c.batch_scanner(raw), data, pos) for c in (COMPILED, REFERENCE)]
        assert scans[0] == scans[1]


def mutations(data: bytes, rng: random.Random) -> list[bytes]:
    """Hostile variants of a good encoding: cut, padded, a byte changed, a byte dropped, garbage."""
    out = [data + b"\x00", data + b"\x80" * 11, rng.randbytes(rng.randint(0, 40))]
    if data:
        i = rng.randrange(len(data))
        out += [data[:i], data[:i] + bytes([rng.randrange(256)]) + data[i + 1:], data[:i] + data[i + 1:],
                data[:i] + b"\xff" * 10 + data[i:]]
    return out


@needs_build
def test_the_compiled_module_is_a_build_of_the_generated_source_named_by_its_digest():
    path = codec_build.built_path(COMPILED.generated)
    assert path is not None and codec_build.digest(COMPILED.generated) in path.name
    assert COMPILED.path == f"compiled {path}"
    assert COMPILED.generated == REFERENCE.generated
    assert type(COMPILED.readers["BlockEvents"]).__name__ == "cython_function_or_method"
    assert type(REFERENCE.readers["BlockEvents"]).__name__ == "function"
    assert path.with_name(f"{codec_build.module_name(COMPILED.generated)}.py").read_text() == COMPILED.generated


def test_the_declarations_type_the_readers_and_skippers_from_the_source():
    pxd = codec_build.declarations(CODEC.generated)
    for name in ("r_kvbus_BlockEvents", "k_kvbus_BlockStored", "ru_0", "ku_0"):
        assert f"cpdef {name}(bytes data, Py_ssize_t pos)" in pxd
    assert "cpdef s_kvbus_BlockStored(bytes data, Py_ssize_t start, Py_ssize_t pos, raw)" in pxd
    assert "cpdef scan_kvbus_EventBatch(bytes data, Py_ssize_t pos, raw, shared=*)" in pxd
    assert "d_kvbus_BlockEvents" not in pxd and "w_kvbus_EventBatch" not in pxd  # entry points and writers: as written
    assert codec_build.digest(CODEC.generated) != codec_build.digest(CODEC.generated + "\n")


@needs_build
@pytest.mark.parametrize("kind", sorted(KINDS))
@HYPO
@given(data=st.data())
def test_same_bytes_and_same_values_for_any_record(kind, data):
    value = data.draw(KINDS[kind])
    body = COMPILED.encode(kind, value)
    assert body == REFERENCE.encode(kind, value)
    assert COMPILED.decode(kind, body) == REFERENCE.decode(kind, body) == value
    same_decoding(kind, b"\x00\x00\x00\x00\x07" + body, 5)


@needs_build
@HYPO
@given(batches)
def test_same_events_heads_tails_and_scans_for_any_batch(batch):
    for e in batch.events:
        enc = COMPILED.encode_event(e)
        assert enc == REFERENCE.encode_event(e)
        assert COMPILED.decode_event(enc) == REFERENCE.decode_event(enc)
    head = (batch.replica, batch.dp_rank, batch.worker_rank, batch.workers, batch.engine, batch.model)
    assert COMPILED.batch_head(*head) == REFERENCE.batch_head(*head)
    tail = (batch.epoch, batch.seq, batch.ts, batch.topic, COMPILED.encode_events(batch.events), batch.first_index)
    assert COMPILED.batch_from_head(b"h", *tail) == REFERENCE.batch_from_head(b"h", *tail)
    body = REFERENCE.encode("EventBatch", batch)
    assert COMPILED.batch_scanner(raw)(body) == REFERENCE.batch_scanner(raw)(body)


@needs_build
@HYPO
@given(events.filter(lambda e: type(e) in SHAPES))
def test_same_bytes_from_the_positional_writers_of_the_publisher(ev):
    fields = SHAPES[type(ev)]
    values = [getattr(ev, f) for f in fields]
    name = type(ev).__name__
    assert COMPILED.event_writer(name, fields)(*values) == REFERENCE.event_writer(name, fields)(*values)


@needs_build
@pytest.mark.parametrize("kind", sorted(KINDS))
@HYPO
@given(data=st.data(), seed=st.integers(0, 2**32))
def test_same_values_or_same_errors_for_mangled_encodings(kind, data, seed):
    body = REFERENCE.encode(kind, data.draw(KINDS[kind]))
    for bad in mutations(body, random.Random(seed)):
        same_decoding(kind, bad)


@needs_build
@HYPO
@given(events, st.data())
def test_same_errors_for_fields_of_the_wrong_type(ev, data):
    fields = [f.name for f in msgspec.structs.fields(type(ev))]
    if not fields:
        return
    name = data.draw(st.sampled_from(fields))
    bad = msgspec.structs.replace(ev, **{name: data.draw(st.sampled_from(WRONG))})
    assert outcome(COMPILED.encode_event, bad) == outcome(REFERENCE.encode_event, bad)
    if type(ev) in SHAPES and name in SHAPES[type(ev)]:
        values = [getattr(bad, f) for f in SHAPES[type(ev)]]
        writers = [c.event_writer(type(ev).__name__, SHAPES[type(ev)]) for c in (COMPILED, REFERENCE)]
        assert outcome(writers[0], *values) == outcome(writers[1], *values)


def _registry_serde(kind: str) -> tuple[RecordSerde, int]:
    """A RecordSerde of ``kind`` on a mock registry, and the schema id of another kind there."""
    registry = registry_client(f"mock://compiled-codec-{kind}")
    other = (EventBatch(replica="x", seq=0, ts=0.0, events=[]) if kind == "BlockEvent"
             else BlockEvent(replica="x", epoch=0, seq=0, index=0, ts=0.0, event=BlockRemoved(block_hashes=[])))
    other_id = int.from_bytes(RecordSerde(registry, type(other).__name__).dumps(other, "other")[1:5], "big")
    return RecordSerde(registry, kind), other_id


@needs_build
def test_same_outcome_for_the_sink_fuzz_inputs():
    """tests/test_fuzz_sink.py's hostile BlockEvent values (garbage, truncated, wrong ids, invalid fields)."""
    from tests.test_fuzz_sink import SEED, _inputs

    serde, other_id = _registry_serde("BlockEvent")
    for _, _, _, _, value, _ in _inputs(SEED, 3000, Topics(), serde, other_id):
        same_decoding("BlockEvent", value, 5)
        same_decoding("BlockEvents", value, 5)


@needs_build
def test_same_outcome_for_the_worker_fuzz_inputs():
    """tests/test_fuzz_worker.py's hostile EventBatch values, decoded and scanned."""
    from tests.test_fuzz_worker import SEED, _inputs

    serde, other_id = _registry_serde("EventBatch")
    for _, _, _, value, _ in _inputs(SEED, 3000, "raw", serde, other_id):
        same_decoding("EventBatch", value, 5)


@needs_build
def test_same_bytes_for_the_bridge_fuzz_inputs():
    """tests/test_fuzz_bridge.py's engine messages: the events of those the bridge decodes encode alike."""
    from tests.test_fuzz_bridge import SEED

    n = 0
    for x in engine_inputs(SEED, 3000):
        if x.payload is None:
            continue
        try:
            evs = decode_batch(x.payload, "auto", skip_unknown=True).events
        except DecodeError:
            continue
        n += len(evs)
        assert COMPILED.encode_events(evs) == REFERENCE.encode_events(evs)
        for e in evs:
            assert outcome(COMPILED.decode_event, REFERENCE.encode_event(e)) == outcome(
                REFERENCE.decode_event, REFERENCE.encode_event(e))
    assert n > 500


# -- when the reference path runs ------------------------------------------------------------

def test_a_build_of_another_source_is_stale_and_left_alone():
    changed = CODEC.generated + "# one more line\n"
    got, why = codec_build.load(changed, dict(CODEC.ns))
    assert got is None
    assert why.startswith("stale: ") or why.startswith("not built"), why
    if codec_build.built_path(CODEC.generated) is not None:
        assert why.startswith("stale: ") and codec_build.module_name(changed) not in why


def test_a_build_that_does_not_load_falls_back(tmp_path: Path):
    """A file under the right name that is no module of that name (a broken or foreign build)."""
    source = REFERENCE.generated + "# another source, so that no module of its name is loaded yet\n"
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    (tmp_path / (codec_build.module_name(source) + suffix)).write_bytes(b"\x7fELF not really")
    got, why = codec_build.load(source, {}, tmp_path)
    assert got is None and "does not load" in why


def test_a_codec_of_changed_schemas_runs_its_generated_python(tmp_path: Path):
    from tests.test_codec import BlockStoredWithShard, _codec_with_shard

    changed = _codec_with_shard(tmp_path)
    assert isinstance(changed, Codec) and not changed.compiled
    assert changed.path.startswith(("stale: ", "not built"))
    ev = BlockStoredWithShard(block_hashes=[b"h" * 8], token_ids=[1, 2], medium="GPU", shard="s")
    assert changed.decode_event(changed.encode_event(ev)) == ev


def test_the_setting_turns_the_compiled_codec_off():
    assert compiled_codec_setting({}) is True
    assert compiled_codec_setting({"KVBUS_COMPILED_CODEC": "0"}) is False
    off = build(compiled=False)
    assert not off.compiled and off.path == "compiled codec off"
    code = "from kvbus.schemas.codec import CODEC; print(CODEC.compiled, CODEC.path)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "KVBUS_COMPILED_CODEC": "0"}).stdout
    assert out.strip() == "False compiled codec off"


def test_the_build_writes_its_module_under_the_digest_and_removes_other_builds(tmp_path: Path):
    """compile_source is idempotent and keeps one build (skipped: a second Cython compile costs half a minute,
    unless the compiled build is there to copy, which is what the check needs)."""
    built = codec_build.built_path(CODEC.generated)
    if built is None:
        pytest.skip(f"the compiled codec is not built: {COMPILED.path}")
    shutil.copy(built, tmp_path / built.name)
    (tmp_path / f"{codec_build.PREFIX}{'0' * codec_build.DIGEST_CHARS}.py").write_text("# an older build\n")
    assert codec_build.compile_source(CODEC.generated, tmp_path) == tmp_path / built.name  # there: not rebuilt
    codec_build._remove_others(tmp_path, codec_build.module_name(CODEC.generated))
    assert sorted(p.name for p in tmp_path.iterdir()) == [built.name]
