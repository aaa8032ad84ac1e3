"""A fleet's residency view for the lookup benchmarks (benchmarks/lookup.py, benchmarks/serve.py): the
fleet workload (``kvbus.simulator.view_workload``) loaded into a Redis through the sink's write path, and the
query sets drawn from it.

    stores, chains, bodies = fleet_workload(10_000_000, replicas=256, min_chain=128)
    n, seconds = load_kvbus(RedisStore(r, "kvbus:"), stores)
    shared = queries(chains, 2000, 128)     # a conversation with its system prompt: ~all replicas hold a prefix
    private = queries(bodies, 2000, 128)    # a conversation body alone: 1-2 holders
"""
from __future__ import annotations

import time
from typing import Iterable, Sequence

import redis

from kvbus.schemas.events import BlockEvent, BlockStored
from kvbus.simulator.view_workload import FleetStore
from kvbus.sinks.view.redis_store import RedisStore

TOPIC = "kvbus.blocks"


def used_memory(r: redis.Redis) -> int:
    """The server's ``used_memory`` in bytes."""
    return int(r.info("memory")["used_memory"])


def pct(xs: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ``xs`` (nearest rank)."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def load_kvbus(store: RedisStore, stores: Iterable[FleetStore], batch: int = 2000,
               model: str | None = None, hybrid_window: int = 0) -> tuple[int, float]:
    """Apply ``stores`` as BlockStored events (replica ``r<i>``, one sequence per replica, naming
    ``model``) through ``store.apply`` in batches of ``batch`` records, the sink's write path; returns
    (entries, seconds). ``hybrid_window`` > 0: every replica a hybrid model, each store named as full
    attention (group 0) and its last ``ceil(hybrid_window / 16)`` blocks stored once more in a
    sliding-window group (group 1, window ``hybrid_window`` tokens)."""
    seq: dict[int, int] = {}
    records: list = []
    n = 0
    t0 = time.perf_counter()
    for s in stores:
        events = [BlockStored(block_hashes=s.hashes, medium=s.medium, block_size=16)]
        if hybrid_window:
            tail = s.hashes[-(-hybrid_window // 16):]
            events = [BlockStored(block_hashes=s.hashes, medium=s.medium, block_size=16, group_idx=0,
                                  kv_cache_spec_kind="full_attention"),
                      BlockStored(block_hashes=tail, medium=s.medium, block_size=16, group_idx=1,
                                  kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=hybrid_window)]
        for e in events:
            q = seq.get(s.replica, 0)
            seq[s.replica] = q + 1
            records.append((TOPIC, BlockEvent(replica=f"r{s.replica}", epoch=1, seq=q, index=0, ts=time.time(),
                                              model=model, event=e)))
            n += len(e.block_hashes)
        if len(records) >= batch:
            store.apply(records)
            records = []
    if records:
        store.apply(records)
    return n, time.perf_counter() - t0


def queries(sample: Sequence[list[bytes]], n: int, chain: int) -> list[list[bytes]]:
    """``n`` lookup chains of ``chain`` blocks: the first ``chain`` blocks of each of ``sample``, cycled."""
    out = [c[:chain] for c in sample][:n]
    while len(out) < n:
        out += out[: n - len(out)]
    return out
