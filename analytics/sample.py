"""``kvbus report --sample``: a few records of each topic as the plain consumer decodes them,
printed as JSON (Avro's JSON encoding of unions: ``{"kvbus.BlockStored": {...}}``; bytes and fixed
as ``0x`` hex; long arrays cut to their first items), for docs/topics.md and for a first look."""
from __future__ import annotations

import json
from typing import Any, Callable, Iterable

from analytics.reader import Record

LIST_ITEMS = 6
"""Items of an array shown before the rest is summarised as ``"... N more"``."""


def jsonable(value: Any, cut: int | None = LIST_ITEMS) -> Any:
    """``value`` as the deserializer returned it, in JSON-able form (see the module doc)."""
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], str):
        return {value[0]: jsonable(value[1], cut)}
    if isinstance(value, dict):
        return {k: jsonable(v, cut) for k, v in value.items()}
    if isinstance(value, (bytes, bytearray)):
        return "0x" + bytes(value).hex()
    if isinstance(value, list):
        items = [jsonable(v, cut) for v in (value if cut is None else value[:cut])]
        if cut is not None and len(value) > cut:
            items.append(f"... {len(value) - cut} more")
        return items
    return value


def pick(records: Iterable[Record], per_topic: int, wanted: Callable[[], set[str]]) -> dict[str, list[Record]]:
    """The first ``per_topic`` records of each topic; stops reading once each topic of ``wanted()``
    (the topics that have records in the range) has them."""
    out: dict[str, list[Record]] = {}
    for r in records:
        got = out.setdefault(r.topic, [])
        if len(got) < per_topic:
            got.append(r)
        if all(len(out.get(t, ())) >= per_topic for t in wanted()):
            break
    return out


def render(samples: dict[str, list[Record]]) -> str:
    """One section per topic: ``# <topic>`` then one JSON line per record (key and value)."""
    lines: list[str] = []
    for topic in sorted(samples):
        lines.append(f"# {topic}")
        for r in samples[topic]:
            lines.append(json.dumps({"key": r.key, "value": jsonable(r.value)}, separators=(", ", ": ")))
    return "\n".join(lines)
