"""A simulated engine as a Ray Serve deployment, for tests/test_ray_serve.py: each replica keeps a prefix
cache of its own and publishes what it stores through kvbus's in-process publisher, under its Ray replica
id (the name :func:`kvbus.client.ray_serve.replica_name` gives it), so the real pipeline carries its
events into the view the router reads."""
from __future__ import annotations

import os
import time
from typing import Any

from ray import serve

from kvbus.producers.publisher import KafkaEventPublisher
from kvbus.runtime.settings import Settings
from kvbus.schemas.events import BlockStored
from kvbus.schemas.hashing import block_hashes


class _Batch:
    """What an engine hands the publisher (ts, events)."""

    def __init__(self, events: list) -> None:
        self.ts, self.events = time.time(), events


class SimulatedEngine:
    """Serves ``{"prompt": [token ids]}``: answers which replica served it and how many leading blocks
    of the prompt it had cached, then caches (and publishes) the prompt's full blocks."""

    def __init__(self, env: dict[str, str], block_size: int, seed: str) -> None:
        os.environ.update(env)  # the test's topics, registry and Kafka
        self.name = serve.get_replica_context().replica_id.unique_id
        self.block_size, self.seed = block_size, seed
        self.publisher = KafkaEventPublisher(replica=self.name, settings=Settings.from_env())
        self.cached: set[bytes] = set()

    def __call__(self, body: dict[str, Any]) -> dict[str, Any]:
        tokens = body["prompt"]
        chain = block_hashes(tokens, self.block_size, "sha256", seed=self.seed)
        hit = 0
        while hit < len(chain) and chain[hit] in self.cached:
            hit += 1
        if hit < len(chain):
            self.publisher.publish(_Batch([BlockStored(
                block_hashes=chain[hit:], parent_block_hash=chain[hit - 1] if hit else None,
                block_size=self.block_size, medium="GPU")]))
            assert self.publisher.flush(30) == 0
            self.cached.update(chain)
        return {"replica": self.name, "cached_blocks": hit}
