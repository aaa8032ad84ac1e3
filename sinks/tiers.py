"""Tiers in the view: which are reference-counted, and how lookups weigh them.

A tier is where a holder keeps a block, i.e. (medium, ownership, group_idx); how it is named (its
descriptor in Redis, its label) is ``kvbus.schemas.tiers``, shared with the analytics report.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from kvbus.schemas.events import BlockRemoved, BlockStored
from kvbus.schemas.tiers import describe, label  # noqa: F401  (the naming rule; re-exported for the sinks)

DEFAULT_WEIGHTS: dict[str, float] = {
    "GPU": 1.0,
    "CPU": 0.8,
    "CPU_PINNED": 0.8,
    "STORAGE": 0.5,
    "DISK": 0.5,
    "FS": 0.5,
    "OBJ": 0.5,
    "EXTERNAL": 0.4,
    "*": 0.5,
}
"""Lookup score weights by medium (or ownership); ``*`` is the weight of any other tier."""

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


@dataclass(frozen=True)
class Weights:
    """Tier weights of the lookup score: by ownership first, then medium, then ``*``."""

    by_name: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_WEIGHTS))

    def of(self, descriptor: str) -> float:
        """Weight of the tier ``descriptor``."""
        medium, ownership, _ = descriptor.split("|")
        if ownership and ownership in self.by_name:
            return float(self.by_name[ownership])
        if medium in self.by_name:
            return float(self.by_name[medium])
        return float(self.by_name.get("*", 1.0))

    def spec(self) -> str:
        """``"NAME=W,..."``, the form ``kvbus_lookup`` takes (names must not contain ``,`` or ``=``)."""
        cached = self.__dict__.get("_spec")
        if cached is None:
            cached = ",".join(f"{k}={float(v)!r}" for k, v in self.by_name.items())
            object.__setattr__(self, "_spec", cached)
        return cached

    @classmethod
    def parse(cls, spec: str | None) -> "Weights":
        """``"GPU=1,CPU=0.8,STORAGE=0.5"`` over the defaults (names upper-cased except ownerships)."""
        merged = dict(DEFAULT_WEIGHTS)
        for part in (spec or "").split(","):
            part = part.strip()
            if not part:
                continue
            name, sep, value = part.partition("=")
            if not sep:
                raise ValueError(f"weight {part!r} is not NAME=VALUE")
            name = name.strip()
            merged[name.upper() if name.upper() in DEFAULT_WEIGHTS else name] = float(value)
        return cls(merged)
