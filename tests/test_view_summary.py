"""``kvbus.sinks.demo_summary.summary``: the demo's per-replica, per-tier block counts."""
from __future__ import annotations

import time
import uuid

from kvbus.infra.scratch_redis import RedisServer
from kvbus.schemas.events import AllBlocksCleared, BlockEvent, BlockStored, canonical_hash
from kvbus.sinks.demo_summary import summary
from kvbus.sinks.view.redis_store import RedisStore

H = [canonical_hash(i * 31337 + 5) for i in range(10)]


def ev(replica, dp, seq, event, topic="kvbus.blocks"):
    return (topic, BlockEvent(replica=replica, dp_rank=dp, epoch=1, seq=seq, index=0, ts=time.time(), event=event))


def test_summary_counts_blocks_per_holder_and_tier():
    with RedisServer() as srv:
        prefix = f"v{uuid.uuid4().hex[:8]}:"
        store = RedisStore(srv.client(), prefix)
        assert summary(srv.url, prefix) == {}
        store.apply([
            ev("a", 0, 0, BlockStored(block_hashes=H[:4], medium="GPU")),
            ev("a", 0, 1, BlockStored(block_hashes=H[:6], medium="cpu")),
            ev("a", 0, 2, BlockStored(block_hashes=H[:2], medium="CPU", ownership="kvcr"), "kvbus.blocks.kvcr"),
            ev("b", 0, 0, BlockStored(block_hashes=H[:3], medium="GPU", group_idx=1)),
            ev("b", 1, 0, BlockStored(block_hashes=H[:1], medium=None)),
            ev("c", 0, 0, BlockStored(block_hashes=H[:1], medium="GPU")),
        ])
        assert summary(srv.url, prefix) == {
            "a": {"CPU": 6, "CPU@kvcr": 2, "GPU": 4},
            "b#0": {"GPU/g1": 3},
            "b#1": {"GPU": 1},
            "c": {"GPU": 1},
        }
        store.apply([ev("c", 0, 1, AllBlocksCleared())])
        assert "c" not in summary(srv.url, prefix)
