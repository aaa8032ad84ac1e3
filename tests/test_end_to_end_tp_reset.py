"""A reset of one tensor-parallel worker reaches the residency view on the real stack.

Raw batches of a TP=2 replica (as its two bridges write them) go through a real Faust worker and
sink: when only worker 1 resets (its engine process restarted, or its bridge lost batches), the
streams stage forwards the Reset right after worker 0's last batch, the sink drops that replica's
residency (not another replica's), and the replica's next consolidated events apply again.
"""
from __future__ import annotations

import time
import uuid

import pytest

from kvbus.client import ViewClient
from kvbus.schemas.events import BlockStored, EventBatch, Reset, canonical_hash
from tests.pipeline import Pipeline, RawProducer, eventually

pytestmark = pytest.mark.integration

TP, SOLO = "tp", "solo"


def stored(*ns: int) -> BlockStored:
    return BlockStored(block_hashes=[canonical_hash(n) for n in ns], token_ids=[1, 2], block_size=2, medium="GPU")


def batch(replica: str, rank: int, workers: int, epoch: int, seq: int, events: list) -> EventBatch:
    return EventBatch(replica=replica, worker_rank=rank, workers=workers, epoch=epoch, seq=seq,
                      ts=time.time(), events=events)  # engine clock: the sink expires holders silent for long


@pytest.fixture
def pipeline(test_settings, tmp_path):
    p = Pipeline(test_settings, tmp_path)
    yield p
    p.stop()


def test_reset_of_one_tp_worker_clears_its_replica_in_the_view(pipeline, test_settings, tmp_path) -> None:
    run = uuid.uuid4().hex[:8]
    prefix = f"tpr{run}:"
    pipeline.start("sink", "sink", "--group", f"sink-{run}", "--prefix", prefix)
    pipeline.start("worker", "worker", "--app-id", f"streams-{run}", "--workdir", str(tmp_path))
    raw = RawProducer(test_settings)
    for rank, epoch in ((0, 5000), (1, 5001)):  # each bridge has its own epoch
        raw.send(batch(TP, rank, 2, epoch, 0, [stored(1, 2)]))
        raw.send(batch(TP, rank, 2, epoch, 1, [stored(3)]))
    raw.send(batch(SOLO, 0, 1, 7000, 0, [stored(1)]))
    raw.flush()

    seen: list[dict] = []

    def view_is(want: dict):
        def check() -> bool:
            seen.append(ViewClient(test_settings.redis_url, prefix).summary())
            return seen[-1] == want
        return check

    eventually(view_is({TP: {"GPU": 3}, SOLO: {"GPU": 1}}), 120, pipeline)

    # worker 1 alone resets (new epoch of its bridge): the replica's residency is dropped
    raw.send(batch(TP, 1, 2, 9001, -1, [Reset(reason="engine-restart")]))
    raw.flush()
    try:
        eventually(view_is({SOLO: {"GPU": 1}}), 60, pipeline)
    except AssertionError:
        raise AssertionError(f"view after the reset: {seen[-1]}")

    # both workers report the next step: worker 0 in its old epoch, worker 1 in its new one
    raw.send(batch(TP, 0, 2, 5000, 2, [stored(4)]))
    raw.send(batch(TP, 1, 2, 9001, 0, [stored(4)]))
    raw.flush()
    eventually(view_is({TP: {"GPU": 1}, SOLO: {"GPU": 1}}), 60, pipeline)
    assert pipeline.lookup_json("--hashes", str(int.from_bytes(canonical_hash(4), "big")), "--prefix", prefix) == {
        TP: {"dp_rank": 0, "matched": 1, "replica": TP, "score": 1.0, "tiers": {"GPU": 1}}}
