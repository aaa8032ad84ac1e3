"""Tiers in the view: which are reference-counted.

A tier is where a holder keeps a block, i.e. (medium, ownership, group_idx); how it is named (its
descriptor in Redis, its label) and how lookups weigh it are ``kvbus.schemas.tiers``, shared with
the lookup client and the analytics report.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from kvbus.schemas.events import BlockRemoved, BlockStored
from kvbus.schemas.tiers import DEFAULT_WEIGHTS, Weights, describe, label  # noqa: F401  (re-exported for the sinks)

REFCOUNT_MEDIUMS: frozenset[str] = frozenset({"CPU", "STORAGE", "FS", "OBJ"})
"""Mediums of vLLM's OffloadingConnector, which may report the same hash once per chunk
(protocol doc §6: consumers must reference-count)."""


@dataclass(frozen=True)
class TierPolicy:
    """Which tiers are reference-counted.

    A ref-counted tier counts stores of the same hash and keeps the entry until as many removes
    arrived; any other tier is a set (a repeated store changes nothing, one remove drops it).
    """

    refcount_mediums: frozenset[str] = REFCOUNT_MEDIUMS
    """Mediums whose stores are counted (OffloadingConnector)."""
    refcount_ownership: bool = True
    """Count every secondary-tier (ownership not null) store as well."""

    def refcounted(self, descriptor: str) -> bool:
        """Whether the tier of ``descriptor`` counts repeated stores."""
        medium, ownership, _ = descriptor.split("|")
        return medium in self.refcount_mediums or (self.refcount_ownership and ownership != "")

    def tier_of(self, event: BlockStored | BlockRemoved) -> str:
        """Descriptor of the tier a store/remove event is about."""
        return describe(event.medium, event.ownership, event.group_idx)


DEFAULT_POLICY = TierPolicy()


_KIND = re.compile(r"[A-Za-z0-9_]{1,64}")


def group_spec(event: BlockStored) -> str | None:
    """What a store says of its KV cache group, as the view records it (kvbus.lua, "KV cache groups of a
    holder"): ``"<kind>,<window>,<block_size>"`` from ``kv_cache_spec_kind`` (a value that is not a short
    word becomes ``unknown``), ``kv_cache_spec_sliding_window`` (empty when None) and ``block_size``; None
    when the event names no kind (engines before vLLM 0.22, SGLang, LMCache, offload connectors) or no
    block size (placeholders): such stores leave the holder's groups as they are."""
    kind = event.kv_cache_spec_kind
    if kind is None or event.block_size <= 0:
        return None
    window = event.kv_cache_spec_sliding_window
    return (f"{kind if _KIND.fullmatch(kind) else 'unknown'},"
            f"{window if window is not None and window >= 0 else ''},{event.block_size}")
