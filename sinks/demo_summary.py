"""Read-only views of the residency view for humans (demo summary)."""
from __future__ import annotations

from typing import Any, Mapping

from kvbus.schemas.lookup import DEFAULT_PREFIX
from kvbus.sinks.view.store_url import open_store


def summary(redis_url: str, prefix: str = DEFAULT_PREFIX,
            client_kwargs: Mapping[str, Any] | None = None) -> dict[str, dict[str, int]]:
    """``{holder: {tier: blocks}}``: holder is ``<replica>`` (single dp rank 0) or ``<replica>#<rank>``,
    tier a label such as ``GPU``, ``CPU``, ``CPU@kvcr``, ``GPU/g1``; the view single or sharded
    (``redis+cluster://``); ``client_kwargs``: credentials (``Settings.redis_kwargs()``)."""
    return open_store(redis_url, prefix, load=False, client_kwargs=client_kwargs).summary()
