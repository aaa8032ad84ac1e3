"""How a tier is named and weighed: one rule for the sink's view, the router's answers and the analytics report.

A tier is where a holder keeps a block: (medium, ownership, group_idx). Its descriptor
``"<MEDIUM>|<ownership>|<group>"`` is the key of the view's tier table in Redis; its label
(``GPU``, ``CPU@kvcr`` for a secondary tier named by ownership, ``GPU/g1`` for KV group 1) is what
``kvbus lookup``, ``kvbus top`` and ``kvbus report`` show. :class:`Weights` is how a lookup scores
the tiers a holder holds a block in (the spec ``kvbus_lookup`` takes as its weights argument).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from kvbus.schemas.events import normalize_medium


def _clean(s: str) -> str:
    return s.replace("|", "_")


def describe(medium: str | None, ownership: str | None, group_idx: int | None) -> str:
    """Tier descriptor of an event's fields.

    ``medium`` None (vLLM < 0.10.2, SGLang's GPU pool) counts as GPU; ``group_idx`` None as group 0.
    """
    m = normalize_medium(medium) or "GPU"
    return f"{_clean(m)}|{_clean(ownership or '')}|{int(group_idx or 0)}"


def label(descriptor: str) -> str:
    """Display label of a descriptor: ``MEDIUM[@ownership][/g<group>]``."""
    medium, ownership, group = descriptor.split("|")
    out = medium
    if ownership:
        out += f"@{ownership}"
    if group not in ("", "0"):
        out += f"/g{group}"
    return out


def medium_of(tier_label: str) -> str:
    """The medium of a display label (the inverse of :func:`label` for it): ``CPU@kvcr`` -> ``CPU``,
    ``GPU/g1`` -> ``GPU``."""
    return tier_label.split("@", 1)[0].split("/", 1)[0]


def tier_label(medium: str | None, ownership: str | None, group_idx: int | None) -> str:
    """The label of an event's tier: ``label(describe(medium, ownership, group_idx))``."""
    return label(describe(medium, ownership, group_idx))


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
    def over(cls, overrides: Mapping[str, float]) -> "Weights":
        """``overrides`` laid over :data:`DEFAULT_WEIGHTS`; a name :data:`DEFAULT_WEIGHTS` knows in
        any case is upper-cased (``cpu`` = ``CPU``), other names (ownerships) are kept as given.
        ValueError for a name holding ``,`` or ``=`` (the spec could not carry it)."""
        merged = dict(DEFAULT_WEIGHTS)
        for name, value in overrides.items():
            name = name.strip()
            if not name or "," in name or "=" in name:
                raise ValueError(f"weight name {name!r} is empty or holds ',' or '='")
            merged[name.upper() if name.upper() in DEFAULT_WEIGHTS else name] = float(value)
        return cls(merged)

    @classmethod
    def parse(cls, spec: str | None) -> "Weights":
        """``"GPU=1,CPU=0.8,STORAGE=0.5"`` over the defaults (:meth:`over`)."""
        pairs: dict[str, float] = {}
        for part in (spec or "").split(","):
            part = part.strip()
            if not part:
                continue
            name, sep, value = part.partition("=")
            if not sep:
                raise ValueError(f"weight {part!r} is not NAME=VALUE")
            try:
                pairs[name] = float(value)
            except ValueError:
                raise ValueError(f"weight {part!r}: {value.strip()!r} is not a number") from None
        return cls.over(pairs)
