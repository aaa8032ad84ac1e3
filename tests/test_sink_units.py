"""Small pure functions of the sinks stage: tiers, weights, record checks, error classification."""
from __future__ import annotations

import pytest
import redis
from confluent_kafka.schema_registry.error import SchemaRegistryError

from kvbus.schemas.events import AllBlocksCleared, BlockEvent, BlockRemoved, BlockStored, Reset, canonical_hash
from kvbus.schemas.lookup import display_names
from kvbus.schemas.topics import Topics
from kvbus.sinks.consumer import is_transient
from kvbus.sinks.validate import problem
from kvbus.sinks.view.refcounts import DEFAULT_POLICY, Weights, describe, label

T = Topics()


def ev(event, replica="a", dp=0, seq=0, index=0, epoch=5) -> BlockEvent:
    return BlockEvent(replica=replica, dp_rank=dp, epoch=epoch, seq=seq, index=index, ts=1.0, event=event)


def test_tier_descriptors_labels_and_refcount_policy():
    assert describe("gpu", None, None) == "GPU||0"
    assert describe(None, None, 2) == "GPU||2"
    assert describe("cpu", "kvcr", 0) == "CPU|kvcr|0"
    assert [label(d) for d in ("GPU||0", "GPU||1", "CPU|kvcr|0", "CPU_PINNED||0")] == \
        ["GPU", "GPU/g1", "CPU@kvcr", "CPU_PINNED"]
    assert not DEFAULT_POLICY.refcounted("GPU||0")
    assert DEFAULT_POLICY.refcounted("CPU||0") and DEFAULT_POLICY.refcounted("STORAGE||0")
    assert DEFAULT_POLICY.refcounted("GPU|kvcr|0"), "ownership tiers count"
    assert not DEFAULT_POLICY.refcounted("CPU_PINNED||0")


def test_weights_parse_over_defaults():
    w = Weights.parse("gpu=2, kvcr=0.3,*=0")
    assert w.of("GPU||0") == 2.0 and w.of("CPU||0") == 0.8
    assert w.of("CPU|kvcr|0") == 0.3 and w.of("NVME||0") == 0.0
    with pytest.raises(ValueError):
        Weights.parse("GPU")


def test_display_names():
    assert display_names(["a#0", "b#0", "b#1", "c#2"]) == {"a#0": "a", "b#0": "b#0", "b#1": "b#1", "c#2": "c#2"}


def test_record_checks():
    good = ev(BlockStored(block_hashes=[canonical_hash(1)], medium="GPU"))
    assert problem(T.blocks, b"a#0", good, T) is None
    assert problem(T.blocks, None, good, T) is None
    assert "does not name" in problem(T.blocks, b"b#0", good, T)
    tier = ev(BlockRemoved(block_hashes=[canonical_hash(1)], medium="CPU", ownership="kvcr"))
    assert problem(T.for_ownership("kvcr"), b"a#0", tier, T) is None
    assert "belongs on" in problem(T.blocks, b"a#0", tier, T)
    assert "belongs on" in problem(T.for_ownership("kvcr"), b"a#0", good, T)
    assert "8" in problem(T.blocks, b"a#0", ev(BlockStored(block_hashes=[b"abc"])), T)
    # a Reset the streams stage forwards for another TP worker sits after rank 0's batch
    assert problem(T.blocks, b"a#0", ev(Reset(reason="gap-unrecoverable"), seq=3), T) is None
    assert problem(T.blocks, b"a#0", ev(Reset(reason="bridge-start"), seq=-1), T) is None
    assert "position" in problem(T.blocks, b"a#0", ev(AllBlocksCleared(), seq=-2), T)
    assert "empty replica" in problem(T.blocks, None, ev(AllBlocksCleared(), replica=""), T)
    assert "dp_rank" in problem(T.blocks, None, ev(AllBlocksCleared(), dp=-1), T)


def test_transient_errors_are_told_apart_from_bad_input():
    assert is_transient(redis.ConnectionError("down"))
    assert is_transient(SchemaRegistryError(503, 50301, "unavailable"))
    assert is_transient(SchemaRegistryError(-1, -1, "no response"))
    assert not is_transient(SchemaRegistryError(404, 40403, "Schema not found"))
    assert not is_transient(ValueError("bad magic byte"))
