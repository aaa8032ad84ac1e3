"""The streams stage's codec (shared fast codec + RawEvent splicing) produces and accepts exactly
what RecordSerde does, and scanned events keep the identity of decoded ones. Byte equality of
the shared encoders and decoders themselves: tests/test_codec.py."""
from __future__ import annotations

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from kvbus.schemas.events import BlockEvent
from kvbus.schemas.serde import RecordSerde, registry_client
from kvbus.streams.record_values import Codec
from tests.strategies import batches, block_events, dead_letters, incompletes

REGISTRY = registry_client("mock://streams-codec")
SERDES = {k: RecordSerde(REGISTRY, k) for k in ("EventBatch", "BlockEvent", "Incomplete", "DeadLetter")}
CODEC = Codec(REGISTRY)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(block_events, incompletes, dead_letters))
def test_codec_encodes_like_record_serde(value):
    kind = type(value).__name__
    topic = f"codec.{kind}"
    assert CODEC.encode(value, topic) == SERDES[kind].dumps(value, topic)
    assert Codec(REGISTRY, fast=False).encode(value, topic) == SERDES[kind].dumps(value, topic)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches)
def test_fast_decoding_matches_record_serde(batch):
    from kvbus.streams.raw_event import RawEvent
    from kvbus.streams.record_values import materialize

    data = SERDES["EventBatch"].dumps(batch, "codec.raw")
    fast = CODEC.decode(data, "codec.raw")
    fast = msgspec.structs.replace(fast, events=[materialize(e) if isinstance(e, RawEvent) else e for e in fast.events])
    assert fast == SERDES["EventBatch"].loads(data, "codec.raw") == batch
    assert Codec(REGISTRY, fast=False).decode(data, "codec.raw") == batch


@pytest.mark.parametrize("data", [b"", b"\x00", b"garbage", b"\x00\x00\x00\x00\x01\xff\xff",
                                  b"\x00\x00\x0f\xff\xff\x02"])
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
    from kvbus.schemas.codec import encode_event
    from kvbus.streams.aggregation import identity
    from kvbus.streams.raw_event import RawEvent
    from kvbus.streams.record_values import materialize

    data = SERDES["EventBatch"].dumps(batch, "codec.raw")
    scanned = CODEC.decode(data, "codec.raw")
    assert msgspec.structs.replace(scanned, events=[]) == msgspec.structs.replace(batch, events=[])
    assert len(scanned.events) == len(batch.events)
    for raw, ev in zip(scanned.events, batch.events):
        if isinstance(raw, RawEvent):
            assert materialize(raw) == ev
            assert raw.avro == encode_event(ev)
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
        assert Codec(REGISTRY, fast=False).encode(a, "codec.scan") == SERDES["BlockEvent"].dumps(b, "codec.scan")


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches, st.integers(2, 4), st.integers(0, 2**40))
def test_other_workers_reports_decode_like_the_first(batch, workers, first_index):
    """SharedEvents: the records of all TP workers of one batch (same events, other header) decode
    exactly as each would alone."""
    serde = SERDES["EventBatch"]
    codec = Codec(REGISTRY)
    for rank in range(workers):
        b = msgspec.structs.replace(batch, workers=workers, worker_rank=rank, epoch=(batch.epoch + rank) % 2**62,
                                    first_index=first_index if rank else batch.first_index)
        data = serde.dumps(b, "codec.raw")
        # alone: a codec of its own, since CODEC keeps the lists of other tests' multi-worker batches
        assert codec.decode(data, "codec.raw") == Codec(REGISTRY).decode(data, "codec.raw")
        assert serde.loads(data, "codec.raw") == b
    # a record sharing the events bytes of a kept list but with a trailing byte decodes (or fails)
    # as it does without any list kept
    codec.decode(serde.dumps(msgspec.structs.replace(batch, workers=workers), "codec.raw"), "codec.raw")
    odd = serde.dumps(msgspec.structs.replace(batch, workers=workers, worker_rank=workers - 1), "codec.raw") + b"\x00"
    outcomes = []
    for c in (codec, Codec(REGISTRY)):
        try:
            outcomes.append(c.decode(odd, "codec.raw"))
        except Exception as exc:
            outcomes.append(type(exc))
    assert outcomes[0] == outcomes[1]
