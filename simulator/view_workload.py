"""A fleet's residency for the sink and lookup benchmarks: conversations over shared system prompts."""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Iterator


@dataclass
class FleetStore:
    """One BlockStored of the fleet workload: ``replica`` stored ``hashes`` on ``medium``."""

    replica: int
    medium: str
    hashes: list[bytes]


def fleet_workload(
    entries: int,
    *,
    replicas: int = 256,
    copies: int = 1,
    cpu_frac: float = 0.5,
    prompts: int = 64,
    seed: int = 0,
    sample_chains: int = 4000,
    min_chain: int = 128,
) -> tuple[Iterator[FleetStore], list[list[bytes]], list[list[bytes]]]:
    """A fleet's residency built from conversations, until about ``entries`` (replica, block, tier) entries.

    Each conversation is one of ``prompts`` shared system prompts (8-32 blocks) followed by its own
    8-224 blocks, cached on ``copies`` random replicas: on GPU, and with probability ``cpu_frac`` also
    on CPU (offloaded). A replica stores a system prompt once per tier (later conversations hit it),
    so prompt blocks end up shared by most replicas and conversation blocks by ``copies`` of them.

    Returns (the stores, lazily generated and deterministic for a seed; up to ``sample_chains``
    conversation chains of at least ``min_chain`` blocks starting with their system prompt, and as
    many conversation bodies of at least ``min_chain`` blocks (no shared prefix); both filled while
    the stores are consumed).
    """
    rng = random.Random(seed)
    chains: list[list[bytes]] = []
    bodies: list[list[bytes]] = []

    def h() -> bytes:
        return rng.getrandbits(64).to_bytes(8, "big")

    prompt_chains = [[h() for _ in range(rng.randint(8, 32))] for _ in range(prompts)]

    def gen() -> Iterator[FleetStore]:
        have: set[tuple[int, int, str]] = set()
        total = 0
        seen_long = 0
        while total < entries:
            p = rng.randrange(prompts)
            body = [h() for _ in range(rng.randint(8, 224))]
            chain = prompt_chains[p] + body
            if len(chain) >= min_chain:
                seen_long += 1
                if len(chains) < sample_chains:
                    chains.append(chain)
                elif rng.random() < sample_chains / seen_long:
                    chains[rng.randrange(sample_chains)] = chain
            if len(body) >= min_chain and len(bodies) < sample_chains:
                bodies.append(body)
            for r in rng.sample(range(replicas), copies):
                for medium in ("GPU", "CPU") if rng.random() < cpu_frac else ("GPU",):
                    hashes = body if (r, p, medium) in have else chain
                    have.add((r, p, medium))
                    total += len(hashes)
                    yield FleetStore(r, medium, hashes)

    return gen(), chains, bodies
