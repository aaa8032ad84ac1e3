"""The streams stage's fast Avro paths produce and accept exactly what RecordSerde does."""
from __future__ import annotations

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schemas.events import (AllBlocksCleared, BlockEvent, BlockRemoved, BlockStored, DeadLetter, EventBatch,
                            Incomplete, Reset)
from schemas.serde import RecordSerde, registry_client
from streams.codec import Codec

REGISTRY = registry_client("mock://streams-codec")
SERDES = {k: RecordSerde(REGISTRY, k) for k in ("EventBatch", "BlockEvent", "Incomplete", "DeadLetter")}
CODEC = Codec(REGISTRY)

h8 = st.binary(min_size=8, max_size=8)
longs = st.integers(-(2**63), 2**63 - 1)
ints = st.integers(-(2**31), 2**31 - 1)
text = st.text(max_size=12)


def maybe(s):
    return st.one_of(st.none(), s)


stored = st.builds(
    BlockStored,
    block_hashes=st.lists(h8, max_size=4), parent_block_hash=maybe(h8), token_ids=st.lists(longs, max_size=20),
    block_size=ints, lora_id=maybe(longs), medium=maybe(text), lora_name=maybe(text),
    extra_keys=maybe(st.binary(max_size=10)), group_idx=maybe(ints), kv_cache_spec_kind=maybe(text),
    kv_cache_spec_sliding_window=maybe(ints), locality=maybe(text), ownership=maybe(text),
    session_id=maybe(text), lookahead_token_ids=maybe(st.lists(st.lists(longs, max_size=3), max_size=3)),
    cache_salt=maybe(text), token_id_pairs=maybe(st.lists(st.lists(longs, max_size=2), max_size=3)),
    block_digests=maybe(st.lists(st.binary(max_size=33), max_size=3)), parent_block_digest=maybe(st.binary(max_size=33)),
)
removed = st.builds(BlockRemoved, block_hashes=st.lists(h8, max_size=4), medium=maybe(text), group_idx=maybe(ints),
                    locality=maybe(text), ownership=maybe(text),
                    block_digests=maybe(st.lists(st.binary(max_size=33), max_size=3)))
reset = st.builds(Reset, reason=text, missing_from=maybe(longs), missing_to=maybe(longs))
events = st.one_of(stored, removed, st.just(AllBlocksCleared()), reset)
floats = st.floats(allow_nan=False)

block_events = st.builds(BlockEvent, replica=text, epoch=longs, seq=longs, index=ints, ts=floats, event=events,
                         dp_rank=ints)
incompletes = st.builds(Incomplete, replica=text, epoch=longs, seq=longs, index=ints, workers=ints,
                        reported=st.lists(ints, max_size=4), missing=st.lists(ints, max_size=4), event=events,
                        dp_rank=ints)
dead_letters = st.builds(DeadLetter, stage=text, source=text, reason=text,
                         payload=st.lists(st.binary(max_size=20), max_size=3), ts=floats)
batches = st.builds(EventBatch, replica=text, seq=longs, ts=floats, events=st.lists(events, max_size=5),
                    dp_rank=ints, worker_rank=ints, workers=ints, engine=text, epoch=longs, topic=text)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(block_events, incompletes, dead_letters))
def test_fast_encoding_is_byte_identical(value):
    kind = type(value).__name__
    topic = f"codec.{kind}"
    assert CODEC.encode(value, topic) == SERDES[kind].dumps(value, topic)
    assert SERDES[kind].loads(CODEC.encode(value, topic), topic) == value


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches)
def test_fast_decoding_matches_record_serde(batch):
    from streams.codec import materialize
    from streams.raw_event import RawEvent

    data = SERDES["EventBatch"].dumps(batch, "codec.raw")
    fast = CODEC.decode(data, "codec.raw")
    fast = msgspec.structs.replace(fast, events=[materialize(e) if isinstance(e, RawEvent) else e for e in fast.events])
    assert fast == SERDES["EventBatch"].loads(data, "codec.raw") == batch
    assert Codec(REGISTRY, fast=False).decode(data, "codec.raw") == batch


@pytest.mark.parametrize("data", [b"", b"\x00", b"garbage", b"\x00\x00\x00\x00\x01\xff\xff", b"\x00\x00\x0f\xff\xff\x02"])
def test_bad_values_raise_like_record_serde(data):
    with pytest.raises(Exception) as fast:
        CODEC.decode(data, "codec.raw")
    with pytest.raises(Exception) as slow:
        SERDES["EventBatch"].loads(data, "codec.raw")
    assert type(fast.value) is type(slow.value)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches)
def test_scanned_events_have_the_identity_and_bytes_of_decoded_ones(batch):
    """The fast path keeps block events as Avro bytes; identity, ownership and re-emitted bytes
    are those of the decoded struct."""
    from streams import avro_writer
    from streams.aggregation import identity
    from streams.codec import materialize
    from streams.raw_event import RawEvent

    data = SERDES["EventBatch"].dumps(batch, "codec.raw")
    scanned = CODEC.decode(data, "codec.raw")
    assert msgspec.structs.replace(scanned, events=[]) == msgspec.structs.replace(batch, events=[])
    assert len(scanned.events) == len(batch.events)
    for raw, ev in zip(scanned.events, batch.events):
        if isinstance(raw, RawEvent):
            assert materialize(raw) == ev
            assert raw.avro == avro_writer.event(ev)
            assert raw.ownership == ev.ownership
        else:
            assert raw == ev
        for w in (1, 2, 8):
            assert identity(raw, w) == identity(ev, w)
    # a BlockEvent made from scanned events encodes exactly like one made from structs
    for raw, ev in zip(scanned.events, batch.events):
        a = BlockEvent(replica="r", epoch=1, seq=2, index=3, ts=4.0, event=raw)
        b = BlockEvent(replica="r", epoch=1, seq=2, index=3, ts=4.0, event=ev)
        assert CODEC.encode(a, "codec.scan") == SERDES["BlockEvent"].dumps(b, "codec.scan")
