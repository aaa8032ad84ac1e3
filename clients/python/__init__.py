"""kvbus.client: the supported Python API for routers (stable; docs/client.md).

Install it alone with ``pip install 'kvbus[client]'`` (redis, hiredis, xxhash, cbor2, msgspec)::

    from kvbus.client import ViewClient

    view = ViewClient("redis://127.0.0.1:6379/0")             # or redis+cluster://h:p,h:p
    best = view.lookup(tokens=prompt_ids, block_size=16, algo="sha256", seed="0")
    if best and view.status().ready:
        route_to(best[0].replica)

:class:`ViewClient` asks the residency view which holders hold the longest prefix of a prompt
(``.lookup``), and whether its answers are complete (``.status``). Answers are
:class:`HolderMatch` values, best first; tied holders are ordered by a tie-break
(:mod:`kvbus.sinks.view.ties`). The protocol underneath is :mod:`kvbus.schemas.lookup`.
"""

if __name__ != "kvbus.client":  # clients/python/ is installed as kvbus.client (pyproject.toml, package-dir)
    raise ImportError(f"import kvbus.client, not {__name__}")

from kvbus.client.load import LoadReporter
from kvbus.schemas.hashing import HASH_ALGOS, UnmatchableSeed
from kvbus.schemas.lookup import DEFAULT_PREFIX, LAYOUT, HolderMatch, LayoutMismatch, Load, ViewStatus
from kvbus.schemas.tiers import DEFAULT_WEIGHTS, Weights
from kvbus.sinks.view.reader import FunctionsMissing, ViewClient
from kvbus.sinks.view.ties import BY_NAME, ByLoad, ByName, Shuffle, TieBreak, rank

__all__ = [
    "BY_NAME", "ByLoad", "ByName", "DEFAULT_PREFIX", "DEFAULT_WEIGHTS", "FunctionsMissing", "HASH_ALGOS",
    "HolderMatch", "LAYOUT", "LayoutMismatch", "Load", "LoadReporter", "Shuffle", "TieBreak", "UnmatchableSeed",
    "ViewClient", "ViewStatus", "Weights", "rank",
]
