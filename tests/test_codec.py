"""The codec generated from the schemas (kvbus.schemas.codec) writes and reads exactly what fastavro
and kvbus.schemas.serde.RecordSerde (confluent's serializer) do, hands every value it was not built
for (other schema ids, non-canonical encodings, garbage) to RecordSerde, and follows a schema
change with no other edit than the .avsc and the struct."""
from __future__ import annotations

import io
import json
import shutil

import msgspec
import pytest
from confluent_kafka.schema_registry import Schema
from fastavro import parse_schema, schemaless_writer
from hypothesis import HealthCheck, given, settings, strategies as st

from kvbus.schemas import codec as fast
from kvbus.schemas.avro import SCHEMA_DIR, TO_AVRO, parsed_schema, schema_str
from kvbus.schemas.codec import FastSerde, batch_scanner, build, confluent_header, default_structs
from kvbus.schemas.codec_runtime import WireError
from kvbus.schemas.events import (
    AllBlocksCleared,
    BlockEvent,
    BlockRemoved,
    BlockStored,
    EventBatch,
    Incomplete,
    Reset,
    ViewGroup,
    ViewOffset,
    ViewPosition,
    ViewSnapshot,
    ViewTier,
)
from kvbus.schemas.serde import RecordSerde, registry_client, value_schema_id
from tests.strategies import batches, events, ints, longs, maybe, records, text

KINDS = ("EventBatch", "BlockEvent", "Incomplete", "DeadLetter")
REGISTRY = registry_client("mock://fast-codec")
SLOW = {k: RecordSerde(REGISTRY, k) for k in KINDS}
FAST = {k: FastSerde(REGISTRY, k) for k in KINDS}


class SlowSpy:
    """Stands in for a FastSerde's RecordSerde fallback and counts the values it decodes."""

    def __init__(self, serde: RecordSerde):
        self.serde = serde
        self.loads_calls = 0

    def loads(self, data: bytes, topic: str):
        self.loads_calls += 1
        return self.serde.loads(data, topic)


def spied(serde: FastSerde) -> SlowSpy:
    spy = serde.slow = SlowSpy(serde.slow)
    return spy


# -- byte equality and decoding --------------------------------------------------------

@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(records)
def test_bytes_equal_record_serde_and_fast_decode_equals_record_serde(value):
    kind = type(value).__name__
    topic = f"codec.{kind}"
    data = FAST[kind].dumps(value, topic)
    assert data == SLOW[kind].dumps(value, topic)
    assert data[5:] == fastavro_body(parsed_schema(kind), TO_AVRO[kind](value))
    reader = FastSerde(REGISTRY, kind)  # a reader that never wrote: learns the id from the registry
    spy = spied(reader)
    assert reader.loads(data, topic) == SLOW[kind].loads(data, topic) == value
    assert spy.loads_calls == 0  # decoded by the fast path


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches)
def test_batch_head_path_equals_whole_batch(batch):
    """The producers' cached-head encoding of a batch is the whole-batch encoding."""
    serde = FAST["EventBatch"]
    head = serde.header("codec.raw") + fast.batch_head(batch.replica, batch.dp_rank, batch.worker_rank,
                                                       batch.workers, batch.engine, batch.model)
    value = fast.batch_from_head(head, batch.epoch, batch.seq, batch.ts, batch.topic,
                                 fast.encode_events(batch.events), batch.first_index)
    assert value == serde.dumps(batch, "codec.raw") == SLOW["EventBatch"].dumps(batch, "codec.raw")
    encoded = [fast.encode_event(e) for e in batch.events]
    assert fast.event_array(encoded) == fast.encode_events(batch.events)


PUBLISHER_SHAPES = {  # the common event shapes kvbus.producers.publisher writes positionally
    BlockStored: ("block_hashes", "parent_block_hash", "token_ids", "block_size", "medium", "group_idx",
                  "kv_cache_spec_kind"),
    BlockRemoved: ("block_hashes", "medium", "group_idx"),
}


def _fields(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in msgspec.structs.fields(cls))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(events.filter(lambda e: type(e) in PUBLISHER_SHAPES), st.data())
def test_positional_writers_of_some_fields_write_the_event_with_the_others_at_their_defaults(ev, data):
    """event_writer(record, fields): the given fields positionally (in any order), the others at
    their defaults: the bytes of the struct with those fields, and of fastavro."""
    cls = type(ev)
    rest = [f for f in _fields(cls) if f != "block_hashes"]
    fields = data.draw(st.one_of(
        st.just(PUBLISHER_SHAPES[cls]), st.just(_fields(cls)),
        st.permutations(rest).flatmap(lambda p: st.integers(0, len(p)).map(lambda k: ("block_hashes", *p[:k])))
        .flatmap(st.permutations).map(tuple)))
    write = fast.event_writer(cls.__name__, fields)
    assert fast.event_writer(cls.__name__, fields) is write  # generated once
    values = {f: getattr(ev, f) for f in fields}
    expected = cls(**values)
    assert write(*values.values()) == fast.encode_event(expected) == fast.event_writer(cls.__name__)(**values)
    batch = EventBatch(replica="r", seq=1, ts=0.5, events=[expected])
    assert fast.encode("EventBatch", batch)[:-1].endswith(write(*values.values()) + b"\x00")
    assert fast.encode("EventBatch", batch) == fastavro_body(parsed_schema("EventBatch"), TO_AVRO["EventBatch"](batch))


def test_positional_writers_refuse_unknown_repeated_and_missing_required_fields():
    with pytest.raises(LookupError):
        fast.event_writer("BlockRemoved", ("block_hashes", "nope"))
    with pytest.raises(LookupError):
        fast.event_writer("BlockRemoved", ("block_hashes", "medium", "medium"))
    with pytest.raises(LookupError):
        fast.event_writer("BlockRemoved", ("medium",))  # block_hashes has no default


@pytest.mark.parametrize("first_index", [0, 1, 63, 64, 1000, 2**31 - 1])
def test_parts_of_a_split_batch_round_trip_with_first_index(first_index):
    """A part of a split batch: written byte for byte as RecordSerde writes it, read back (whole
    and scanned) by the fast path with its first_index (records without it: test_schema_evolution.py)."""
    evs = [BlockStored(block_hashes=[b"h" * 8], token_ids=list(range(300)), block_size=16, medium="GPU"),
           BlockRemoved(block_hashes=[b"r" * 8]), AllBlocksCleared()]
    part = EventBatch(replica="r", seq=9, ts=1.5, events=evs, epoch=7, first_index=first_index)
    data = FAST["EventBatch"].dumps(part, "codec.parts")
    assert data == SLOW["EventBatch"].dumps(part, "codec.parts")
    reader = FastSerde(REGISTRY, "EventBatch")
    spy = spied(reader)
    assert reader.loads(data, "codec.parts") == part
    assert batch_scanner(Raw)(data, 5).first_index == first_index
    assert spy.loads_calls == 0
    assert fast.decode("EventBatch", data, 5).first_index == first_index
    body = FAST["EventBatch"].dumps(msgspec.structs.replace(part, first_index=0), "codec.parts")
    with pytest.raises(WireError):  # a body without the trailing first_index is not ours
        fast.decode("EventBatch", body[:-1], 5)


class Raw:
    """A pre-encoded event as batch_scanner makes them (any object with ``avro``)."""

    def __init__(self, avro, ownership, without_lora_name):
        self.avro, self.ownership, self.without_lora_name = avro, ownership, without_lora_name


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches)
def test_scanned_events_are_the_encoded_events_and_splice_back(batch):
    data = SLOW["EventBatch"].dumps(batch, "codec.raw")
    scanned = batch_scanner(Raw)(data, 5)
    assert len(scanned.events) == len(batch.events)
    for raw, ev in zip(scanned.events, batch.events):
        if type(ev) in (BlockStored, BlockRemoved):
            assert raw.avro == fast.encode_event(ev)
            assert fast.decode_event(raw.avro) == ev
            assert raw.ownership == ev.ownership
            if type(ev) is BlockStored and ev.lora_name is not None:
                assert raw.without_lora_name == fast.encode_event(msgspec.structs.replace(ev, lora_name=None))
            else:
                assert raw.without_lora_name is None
        else:
            assert raw == ev
    # spliced back, the batch is written as it was read
    assert SLOW["EventBatch"].dumps(batch, "codec.raw")[5:] == fast.encode("EventBatch", scanned)
    for raw, ev in zip(scanned.events, batch.events):
        a = BlockEvent(replica="r", epoch=1, seq=2, index=3, ts=4.0, event=raw)
        b = BlockEvent(replica="r", epoch=1, seq=2, index=3, ts=4.0, event=ev)
        assert FAST["BlockEvent"].dumps(a, "codec.scan") == SLOW["BlockEvent"].dumps(b, "codec.scan")


# -- the fallback ------------------------------------------------------------------------

BAD_VALUES = [b"", b"\x00", b"garbage", b"\x00\x00\x00\x00\x01\xff\xff", b"\x00\x00\x0f\xff\xff\x02"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("data", BAD_VALUES)
def test_bad_values_raise_what_record_serde_raises(kind, data):
    topic = f"codec.{kind}"
    FAST[kind].header(topic)  # schema id 1.. is ours: garbage after it reaches the fast decoder
    with pytest.raises(Exception) as fast:
        FAST[kind].loads(data, topic)
    with pytest.raises(Exception) as slow:
        SLOW[kind].loads(data, topic)
    assert type(fast.value) is type(slow.value)


def test_truncated_and_padded_values_never_decode_differently():
    ev = BlockEvent(replica="r", epoch=1, seq=2, index=0, ts=1.0,
                    event=BlockStored(block_hashes=[b"h" * 8], token_ids=list(range(40)), medium="GPU"))
    data = SLOW["BlockEvent"].dumps(ev, "codec.t")
    for cut in range(6, len(data)):
        with pytest.raises(WireError):
            fast.decode("BlockEvent", data[:cut], 5)
    with pytest.raises(WireError):
        fast.decode("BlockEvent", data + b"\x00", 5)


def test_non_canonical_encoding_decodes_via_record_serde():
    """Avro allows arrays in several blocks (fastavro never writes them): the fast decoder
    declines, RecordSerde decodes."""
    h1, h2 = b"1" * 8, b"2" * 8
    ev = BlockEvent(replica="r", epoch=1, seq=2, index=0, ts=1.0, event=BlockRemoved(block_hashes=[h1, h2]))
    canonical = FAST["BlockEvent"].dumps(ev, "codec.blocks")
    assert b"\x04" + h1 + h2 + b"\x00" in canonical
    two_blocks = canonical.replace(b"\x04" + h1 + h2 + b"\x00", b"\x02" + h1 + b"\x02" + h2 + b"\x00")
    serde = FastSerde(REGISTRY, "BlockEvent")
    spy = spied(serde)
    assert serde.loads(two_blocks, "codec.blocks") == ev
    assert spy.loads_calls == 1


def _evolved(record: str, change) -> dict:
    schema = json.loads(schema_str(record))
    for node in _records(schema):
        change(node)
    return schema


def _records(node):
    if isinstance(node, dict):
        if node.get("type") == "record":
            yield node
        for v in node.values():
            yield from _records(v)
    elif isinstance(node, list):
        for v in node:
            yield from _records(v)


def _drop_offload_fields(rec: dict) -> None:
    """The schema before vLLM 0.26/0.29 added locality and ownership (an older version)."""
    rec["fields"] = [f for f in rec["fields"] if f["name"] not in ("locality", "ownership")]


def _add_fields(rec: dict) -> None:
    """A newer version: one more field, with a default, in every record."""
    rec["fields"] = rec["fields"] + [{"name": "shard", "type": ["null", "string"], "default": None}]


def _write(schema: dict, topic: str, record: dict) -> bytes:
    schema_id = REGISTRY.register_schema(f"{topic}-value", Schema(json.dumps(schema), "AVRO"))
    buf = io.BytesIO()
    schemaless_writer(buf, parse_schema(schema), record)
    return confluent_header(schema_id) + buf.getvalue()


@pytest.mark.parametrize("version", ["older", "newer"])
def test_records_of_another_registered_schema_decode_via_record_serde(version):
    topic = f"codec.evolution.{version}"
    ev = BlockEvent(replica="r", epoch=5, seq=6, index=1, ts=2.5, dp_rank=1,
                    event=BlockStored(block_hashes=[b"a" * 8], token_ids=list(range(32)), block_size=16,
                                      medium="CPU", lora_name="sql"))
    record = TO_AVRO["BlockEvent"](ev)
    if version == "older":
        schema = _evolved("BlockEvent", _drop_offload_fields)
        for k in ("locality", "ownership"):
            del record["event"][k]
    else:
        schema = _evolved("BlockEvent", _add_fields)
        record["shard"] = "s1"
        record["event"]["shard"] = "s2"
    data = _write(schema, topic, record)

    serde = FastSerde(REGISTRY, "BlockEvent", auto_register=False)
    spy = spied(serde)
    assert serde.loads(data, topic) == ev
    assert serde.loads(data, topic) == ev
    assert spy.loads_calls == 2  # never the fast decoder: the writer schema is not ours
    assert serde.is_current(int.from_bytes(data[1:5], "big")) is False
    # a record written with the current schema on the same subject takes the fast path
    current = SLOW["BlockEvent"].dumps(ev, topic)
    assert current[1:5] != data[1:5]
    assert serde.loads(current, topic) == ev
    assert spy.loads_calls == 2


def test_schema_id_is_registered_once_per_topic_and_shared_with_record_serde(monkeypatch):
    serde = FastSerde(REGISTRY, "Incomplete")
    calls = []
    real = REGISTRY.register_schema

    def counting(subject, schema, normalize_schemas=False):
        calls.append(subject)
        return real(subject, schema, normalize_schemas)

    monkeypatch.setattr(REGISTRY, "register_schema", counting)
    ev = Incomplete(replica="r", epoch=1, seq=1, index=0, workers=2, reported=[0], missing=[1],
                    event=AllBlocksCleared())
    for _ in range(3):
        data = serde.dumps(ev, "codec.once")
    monkeypatch.undo()
    assert calls == ["codec.once-value"]
    assert serde.schema_id("codec.once") == value_schema_id(REGISTRY, "codec.once", "Incomplete")
    assert data == SLOW["Incomplete"].dumps(ev, "codec.once")


def test_lookup_only_serde_does_not_register():
    serde = FastSerde(REGISTRY, "BlockEvent", auto_register=False)
    with pytest.raises(Exception, match="Not Found"):
        serde.dumps(BlockEvent(replica="r", epoch=1, seq=1, index=0, ts=0.0, event=AllBlocksCleared()), "codec.nobody")


# -- guards ---------------------------------------------------------------------------------

def test_block_hashes_must_be_8_bytes():
    for hashes in ([b"short"], [b"short", b"12345678"]):
        with pytest.raises(ValueError):
            fast.encode("EventBatch",
                        EventBatch(replica="r", seq=0, ts=0.0, events=[BlockRemoved(block_hashes=hashes)]))
    with pytest.raises(ValueError):
        fast.encode_event(BlockStored(block_hashes=[b"12345678"], parent_block_hash=b"short"))
    stored = fast.event_writer("BlockStored", PUBLISHER_SHAPES[BlockStored])
    removed = fast.event_writer("BlockRemoved", PUBLISHER_SHAPES[BlockRemoved])
    for hashes, parent in (([b"short"], None), ([b"short", b"12345678"], None), ([b"12345678"] * 2, b"short"),
                           ([b"12345678"], b"123456789")):
        with pytest.raises(ValueError):
            stored(hashes, parent, [1], 16, None, None, None)
    for hashes in ([b"short"], [b"short", b"123456789"], [b"1234567"] * 8):
        with pytest.raises(ValueError):
            removed(hashes, None, None)
        with pytest.raises(ValueError):
            fast.encode_event(BlockRemoved(block_hashes=hashes))
    with pytest.raises(TypeError):
        fast.encode_event("not an event")


def test_double_and_long_extremes_round_trip():
    ev = BlockEvent(replica="é" * 70, epoch=-(2**63), seq=2**63 - 1, index=-(2**31), ts=float("inf"),
                    event=Reset(reason="", missing_from=-1, missing_to=2**63 - 1), dp_rank=2**31 - 1)
    data = FAST["BlockEvent"].dumps(ev, "codec.x")
    assert data == SLOW["BlockEvent"].dumps(ev, "codec.x")
    assert fast.decode("BlockEvent", data, 5) == ev


def fastavro_body(schema: dict, record: dict) -> bytes:
    buf = io.BytesIO()
    schemaless_writer(buf, schema, record)
    return buf.getvalue()


positions = st.builds(ViewPosition, topic=text, epoch=longs, seq=longs, index=ints)
tiers = st.builds(ViewTier, descriptor=text, refcounted=st.booleans(), origin=text, blocks=st.binary(max_size=24),
                  extra=st.binary(max_size=16))
snapshots = st.builds(ViewSnapshot, snapshot=longs, taken=st.floats(allow_nan=False), holder=maybe(text),
                      replica=text, dp_rank=ints, seen=maybe(st.floats(allow_nan=False)),
                      floor=maybe(st.floats(allow_nan=False)), positions=st.lists(positions, max_size=3),
                      tiers=st.lists(tiers, max_size=3),
                      offsets=st.lists(st.builds(ViewOffset, topic=text, partition=ints, offset=longs), max_size=3),
                      holders=st.lists(text, max_size=3),
                      groups=st.lists(st.builds(ViewGroup, group=ints, spec=text), max_size=2))
SLOW_SNAPSHOT = RecordSerde(REGISTRY, "ViewSnapshot")


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(snapshots)
def test_nested_records_booleans_and_bytes_follow_the_schema_too(snap):
    """ViewSnapshot (nested records, boolean, bytes, optional doubles) through the same generator."""
    body = fast.encode("ViewSnapshot", snap)
    assert body == fastavro_body(parsed_schema("ViewSnapshot"), TO_AVRO["ViewSnapshot"](snap))
    assert fast.decode("ViewSnapshot", body) == snap
    assert SLOW_SNAPSHOT.dumps(snap, "codec.snap")[5:] == body


# -- a new optional field: the .avsc and the struct, nothing else ----------------------------

class BlockStoredWithShard(BlockStored, kw_only=True, tag="BlockStored"):
    """The event struct with the new field (what a developer adds to schemas/events.py)."""

    shard: str | None = None


def _codec_with_shard(tmp_path):
    """The codec of a copy of schemas/avro where BlockStored has a new optional field, inserted
    after ``medium`` (any place works: structs are built by field name)."""
    shutil.copytree(SCHEMA_DIR, tmp_path / "avro")
    path = tmp_path / "avro" / "kvbus.BlockStored.avsc"
    schema = json.loads(path.read_text())
    at = [f["name"] for f in schema["fields"]].index("medium") + 1
    schema["fields"].insert(at, {"name": "shard", "type": ["null", "string"], "default": None, "doc": "new"})
    path.write_text(json.dumps(schema))
    structs = {**default_structs(), "kvbus.BlockStored": BlockStoredWithShard}
    return build(tmp_path / "avro", structs)


def _to_avro(value):
    """A struct as the dict fastavro writes (union members named by ``-type``)."""
    if isinstance(value, msgspec.Struct):
        d = {k: _to_avro(v) for k, v in msgspec.structs.asdict(value).items()}
        if isinstance(value, (BlockStored, BlockRemoved, AllBlocksCleared, Reset)):
            d["-type"] = f"kvbus.{type(value).__name__.replace('WithShard', '')}"
        return d
    if isinstance(value, list):
        return [_to_avro(v) for v in value]
    return value


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(st.lists(events, max_size=4), maybe(text))
def test_an_optional_field_added_to_the_avsc_and_the_struct_round_trips_like_fastavro(tmp_path_factory, evs, shard):
    new = _CODEC_WITH_SHARD or _make_shard_codec(tmp_path_factory)
    evs = [BlockStoredWithShard(**msgspec.structs.asdict(e), shard=shard) if type(e) is BlockStored else e for e in evs]
    batch = EventBatch(replica="r", seq=3, ts=1.5, epoch=9, workers=2, events=evs)
    body = new.encode("EventBatch", batch)
    assert body == fastavro_body(new.records["EventBatch"], _to_avro(batch))
    assert new.decode("EventBatch", body) == batch


_CODEC_WITH_SHARD = None


def _make_shard_codec(tmp_path_factory):
    global _CODEC_WITH_SHARD
    _CODEC_WITH_SHARD = _codec_with_shard(tmp_path_factory.mktemp("shard"))
    return _CODEC_WITH_SHARD


def test_an_optional_field_added_to_the_avsc_and_the_struct_is_encoded_decoded_and_scanned(tmp_path):
    new = _codec_with_shard(tmp_path)
    parsed = new.records
    stored = [BlockStoredWithShard(block_hashes=[b"h" * 8], token_ids=list(range(20)), block_size=16, medium="GPU",
                                   shard=shard, ownership=own, lora_name=lora)
              for shard, own, lora in ((None, None, None), ("s-1", "kvcr", None), ("s-2", None, "sql"))]
    batch = EventBatch(replica="r", seq=3, ts=1.5, epoch=9, workers=2,
                       events=[*stored, BlockRemoved(block_hashes=[b"r" * 8]), AllBlocksCleared()])
    body = new.encode("EventBatch", batch)
    assert body == fastavro_body(parsed["EventBatch"], _to_avro(batch))
    assert new.decode("EventBatch", body) == batch
    assert new.decode("EventBatch", body).events[1].shard == "s-1"
    for ev in stored:
        value = BlockEvent(replica="r", epoch=1, seq=2, index=0, ts=1.0, event=ev)
        assert new.encode("BlockEvent", value) == fastavro_body(parsed["BlockEvent"], _to_avro(value))
        assert new.decode("BlockEvent", new.encode("BlockEvent", value)) == value
    scanned = new.batch_scanner(Raw)(body)
    for raw, ev in zip(scanned.events[:3], stored):
        assert raw.avro == new.encode_event(ev) and raw.ownership == ev.ownership
        assert raw.without_lora_name == (None if ev.lora_name is None else
                                         new.encode_event(msgspec.structs.replace(ev, lora_name=None)))
    head = new.batch_head("r", 0, 0, 2, "vllm", None)
    assert new.batch_from_head(head, 9, 3, 1.5, "", new.encode_events(batch.events)) == body
    # the positional writer of the publisher's shape, generated from the new schema: shard at its default
    shape = PUBLISHER_SHAPES[BlockStored]
    for ev in stored:
        values = [getattr(ev, f) for f in shape]
        plain = BlockStoredWithShard(**dict(zip(shape, values)))
        assert new.event_writer("BlockStored", shape)(*values) == new.encode_event(plain)
        assert new.event_writer("BlockStored", (*shape, "shard"))(*values, ev.shard) == new.encode_event(
            BlockStoredWithShard(**dict(zip(shape, values)), shard=ev.shard))
    one = EventBatch(replica="r", seq=1, ts=0.5, events=[plain])
    assert new.encode("EventBatch", one) == fastavro_body(parsed["EventBatch"], _to_avro(one))
    # a record of the current schemas is not what the new codec reads: its fast path refuses it
    old = fast.encode("EventBatch", msgspec.structs.replace(batch, events=[
        BlockStored(block_hashes=[b"h" * 8], token_ids=list(range(20)), block_size=16, medium="GPU")]))
    with pytest.raises(WireError):
        new.decode("EventBatch", old)


def test_the_generated_source_is_python_of_the_schemas():
    source = fast.CODEC.source
    assert source.startswith("# generated by schemas/codegen.py")
    for name in ("BlockStored", "BlockRemoved", "AllBlocksCleared", "Reset", "EventBatch", "BlockEvent",
                 "Incomplete", "DeadLetter", "ViewSnapshot", "ViewTier"):
        assert f"def w_kvbus_{name}(e):" in source and f"def r_kvbus_{name}(data, pos):" in source


def test_a_struct_that_does_not_match_its_record_fails_at_build():
    class Short(msgspec.Struct, kw_only=True):
        block_hashes: list

    with pytest.raises(LookupError, match="kvbus.BlockStored"):
        build(SCHEMA_DIR, {**default_structs(), "kvbus.BlockStored": Short})


def test_the_long_caches_stay_within_their_size_and_encode_the_same_after_emptying():
    from kvbus.schemas.codec_runtime import LongCache, longs, varint

    cache = LongCache(limit=1 << 20, size=1000)
    seen = []
    for n in range(5000):  # growing sequence numbers, and a 64-bit value now and then
        value = n if n % 7 else (n << 40) + 1
        assert cache[value] == varint(value)
        seen.append(len(cache))
    assert max(seen) == 1000 and min(seen[1000:]) < 10  # emptied when full, refilled
    assert all(abs(k) < 1 << 20 for k in cache)  # a value past the limit is never kept
    assert longs([1, 2**41, 70_000]) == b"\x06" + varint(1) + varint(2**41) + varint(70_000) + b"\x00"


def test_scalar_longs_do_not_fill_the_token_cache():
    """Epochs and sequence numbers only grow: encoding them must leave the cache of token ids alone."""
    from kvbus.schemas.codec_runtime import COUNTER, LONG

    LONG.clear()
    for seq in range(10_000, 12_000):
        event = BlockEvent(replica="r", epoch=1_760_000_000_000, seq=seq, index=0, ts=1.0,
                           event=BlockRemoved(block_hashes=[b"\x01" * 8]))
        assert fast.decode("BlockEvent", fast.encode("BlockEvent", event)) == event
    assert not any(10_000 <= k < 12_000 for k in LONG), "sequence numbers were cached with the token ids"
    assert 11_999 in COUNTER and len(COUNTER) <= COUNTER.size
