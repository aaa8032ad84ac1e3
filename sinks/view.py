"""Read-only views of the residency view for humans (demo summary)."""
from __future__ import annotations

from sinks.redis_store import DEFAULT_PREFIX, RedisStore


def summary(redis_url: str, prefix: str = DEFAULT_PREFIX) -> dict[str, dict[str, int]]:
    """``{holder: {tier: blocks}}``: holder is ``<replica>`` (single dp rank 0) or ``<replica>#<rank>``,
    tier a label such as ``GPU``, ``CPU``, ``CPU@kvcr``, ``GPU/g1``."""
    return RedisStore(redis_url, prefix, load=False).summary()
