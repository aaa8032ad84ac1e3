"""How a tier is named: one rule for the sink's view, the router's answers and the analytics report.

A tier is where a holder keeps a block: (medium, ownership, group_idx). Its descriptor
``"<MEDIUM>|<ownership>|<group>"`` is the key of the view's tier table in Redis; its label
(``GPU``, ``CPU@kvcr`` for a secondary tier named by ownership, ``GPU/g1`` for KV group 1) is what
``kvbus lookup``, ``kvbus top`` and ``kvbus report`` show.
"""
from __future__ import annotations

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


def tier_label(medium: str | None, ownership: str | None, group_idx: int | None) -> str:
    """The label of an event's tier: ``label(describe(medium, ownership, group_idx))``."""
    return label(describe(medium, ownership, group_idx))
