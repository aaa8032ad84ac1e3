"""Block layout 2 in the worker (kvbus.streams.packing, pure): the aggregator's outputs packed into one
BlockEvents record per engine batch, holder and topic, and back: the same events, in the same order per
holder and topic, each at its position; Incomplete outputs untouched; the fast encoding of packed records
(RawEvents spliced in) byte for byte what the reference serde writes."""
from __future__ import annotations

from collections import defaultdict

from hypothesis import given, settings, strategies as st

from kvbus.schemas.codec import FastSerde
from kvbus.schemas.events import (
    AllBlocksCleared,
    BlockEvent,
    BlockEvents,
    BlockRemoved,
    BlockStored,
    EventBatch,
    Incomplete,
    Reset,
    canonical_hash,
)
from kvbus.schemas.serde import registry_client
from kvbus.schemas.topics import Topics
from kvbus.streams.aggregation import Aggregator, Output
from kvbus.streams.packing import Packer
from kvbus.streams.record_values import Codec

TOPICS = Topics(raw="raw", blocks="blocks", packed="packed", incomplete="incomplete", dlq="dlq")


def stored(n: int, ownership: str | None = None) -> BlockStored:
    return BlockStored(block_hashes=[canonical_hash(n)], block_size=16, medium="GPU", ownership=ownership)


def removed(n: int, ownership: str | None = None) -> BlockRemoved:
    return BlockRemoved(block_hashes=[canonical_hash(n)], medium="CPU", ownership=ownership)


def by_stream(outputs: list[Output]) -> dict[tuple[str, bytes], list]:
    """(layout 1 topic, key) -> its values in order, BlockEvents unpacked."""
    out: dict[tuple[str, bytes], list] = defaultdict(list)
    for o in outputs:
        values = o.value.unpacked() if isinstance(o.value, BlockEvents) else [o.value]
        out[(TOPICS.track(o.topic), o.key)] += values
    return dict(out)


EVENT = st.sampled_from(["S", "R", "S-kvcr", "R-kvcr", "C", "X"])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["a", "b"]), st.lists(EVENT, max_size=8)), max_size=8))
def test_packed_outputs_carry_the_same_events_in_the_same_order(batches):
    agg = Aggregator(TOPICS, 5.0)
    out: list[Output] = []
    seqs: dict[str, int] = defaultdict(int)
    for replica, kinds in batches:
        events = []
        for i, k in enumerate(kinds):
            tier = "kvcr" if k.endswith("kvcr") else None
            events.append(stored(i, tier) if k[0] == "S" else removed(i, tier) if k[0] == "R"
                          else AllBlocksCleared() if k == "C" else Reset(reason="engine-restart"))
        agg.apply(EventBatch(replica=replica, seq=seqs[replica], ts=1.0 + seqs[replica], events=events, epoch=7),
                  0, 100.0, out)
        seqs[replica] += 1
    out.append(Output("incomplete", b"a#0", 0, Incomplete(replica="a", epoch=7, seq=0, index=0, workers=2,
                                                          reported=[0], missing=[1], event=stored(1)), "incomplete"))
    packed = Packer(TOPICS).pack(out)
    assert by_stream(packed) == by_stream(out)
    assert {TOPICS.is_packed(o.topic) for o in packed if isinstance(o.value, BlockEvents)} <= {True}
    assert [o for o in packed if isinstance(o.value, Incomplete)] == [o for o in out if isinstance(o.value, Incomplete)]
    for o in packed:  # one engine batch per record: its events share epoch, seq and ts, in index order
        if isinstance(o.value, BlockEvents):
            idx = [p.index for p in o.value.events]
            assert idx == sorted(idx) and len(set(idx)) == len(idx)
    events = sum(len(k) for _, k in batches)
    assert len([o for o in packed if isinstance(o.value, BlockEvents)]) <= max(events, 0) + 2 * len(batches)


def test_one_record_per_engine_batch_holder_and_topic():
    agg = Aggregator(TOPICS, 5.0)
    out: list[Output] = []
    events = [stored(1), removed(2), stored(3, "kvcr"), removed(4), removed(5, "kvcr")]
    agg.apply(EventBatch(replica="a", seq=0, ts=1.0, epoch=7, events=events), 0, 1.0, out)
    agg.apply(EventBatch(replica="a", seq=1, ts=2.0, epoch=7, events=[removed(1)]), 0, 1.0, out)
    packed = Packer(TOPICS).pack(out)
    assert [(o.topic, o.value.seq, [p.index for p in o.value.events]) for o in packed] == [
        ("packed", 0, [0, 1, 3]), ("packed.kvcr", 0, [2, 4]), ("packed", 1, [0])]
    assert len(out) == 6 and all(isinstance(o.value, BlockEvent) for o in out)


def test_fast_encoding_of_a_packed_record_with_raw_events_is_the_reference():
    registry = registry_client("mock://kvbus-packing")
    fast, slow = Codec(registry), Codec(registry, fast=False)
    batch = EventBatch(replica="a", seq=3, ts=1.5, epoch=7, model="m",
                       events=[stored(1), removed(2), AllBlocksCleared(), stored(3, "kvcr")])
    data = FastSerde(registry, "EventBatch").dumps(batch, "raw")
    scanned = fast.decode(data, "raw")  # block events kept as RawEvents
    agg = Aggregator(TOPICS, 5.0)
    out: list[Output] = []
    agg.apply(scanned, 0, 1.0, out)
    for o in Packer(TOPICS).pack(out):
        assert fast.encode(o.value, o.topic) == slow.encode(o.value, o.topic)
