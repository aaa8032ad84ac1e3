"""Synthetic tensor-parallel traces: what the bridges of a TP fleet put on ``kvbus.raw``.

Used by the integration tests and by ``benchmarks/streams.py``. Every worker of a replica
reports the same events per engine step, in the same order, each through its own sequence
stream (own epoch and seq); worker batches of one step are shuffled, as they would be when
bridges race.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Iterator, Optional

from kvbus.schemas.events import BlockRemoved, BlockStored, EventBatch, canonical_hash, holder_key


@dataclass(frozen=True)
class TraceSpec:
    """Shape of a trace."""

    replicas: int = 4
    """Engine replicas (each with ``dp_ranks`` holders)."""
    dp_ranks: int = 1
    """Data-parallel ranks per replica."""
    workers: int = 2
    """Tensor-parallel workers per replica (1 = pass-through)."""
    steps: int = 100
    """Engine steps per holder (one batch per worker per step)."""
    events_per_batch: int = 8
    """Events per engine step."""
    block_size: int = 16
    """Tokens per block."""
    tier: Optional[str] = "kvcr"
    """Ownership of every fourth event (None: framework events only)."""
    seed: int = 0
    """Random seed (token ids, shuffling)."""
    prefix: str = "replica"
    """Replica name prefix (make it unique per test)."""


def _events(rng: random.Random, holder: int, step: int, spec: TraceSpec) -> list:
    evs: list = []
    for i in range(spec.events_per_batch):
        n = (holder << 40) | (step << 12) | i
        if spec.tier is not None and i % 4 == 3:
            evs.append(BlockStored(block_hashes=[canonical_hash(n)], parent_block_hash=None, token_ids=[],
                                   block_size=0, medium="CPU", ownership=spec.tier))
        elif i % 3 == 2:
            evs.append(BlockRemoved(block_hashes=[canonical_hash(n - 1)], medium="GPU", group_idx=0))
        else:
            evs.append(BlockStored(
                block_hashes=[canonical_hash(n)], parent_block_hash=canonical_hash(n - 1),
                token_ids=[rng.randrange(150_000) for _ in range(spec.block_size)],
                block_size=spec.block_size, medium="GPU", group_idx=0, kv_cache_spec_kind="full_attention",
            ))
    return evs


def batches(spec: TraceSpec, epoch_base: int = 1_700_000_000_000) -> Iterator[EventBatch]:
    """The trace in production order: step by step, holders round-robin, workers shuffled."""
    rng = random.Random(spec.seed)
    holders = [(f"{spec.prefix}-{r}", d) for r in range(spec.replicas) for d in range(spec.dp_ranks)]
    for step in range(spec.steps):
        for h, (replica, dp) in enumerate(holders):
            evs = _events(rng, h, step, spec)
            ranks = list(range(spec.workers))
            rng.shuffle(ranks)
            for w in ranks:
                yield EventBatch(replica=replica, dp_rank=dp, seq=step, ts=1.7e9 + step * 0.01, events=evs,
                                 worker_rank=w, workers=spec.workers, epoch=epoch_base + w, engine="vllm")


def expected(spec: TraceSpec, epoch_base: int = 1_700_000_000_000) -> dict[tuple[str, tuple[int, int, int]], object]:
    """(holder key, position) -> event of every consolidated event the trace should produce."""
    out: dict[tuple[str, tuple[int, int, int]], object] = {}
    for b in batches(spec, epoch_base):
        if b.worker_rank == 0:
            for i, e in enumerate(b.events, b.first_index):
                out[(holder_key(b.replica, b.dp_rank), (b.epoch, b.seq, i))] = e
    return out
