"""``kvbus report --sample``: a few records of each kind of each topic as the plain consumer decodes them,
printed as JSON (Avro's JSON encoding of unions: ``{"kvbus.BlockStored": {...}}``; bytes and fixed
as ``0x`` hex; long arrays cut to their first items), for docs/topics.md and for a first look."""
from __future__ import annotations

import json
from typing import Any, Callable, Iterable

from kvbus.analytics.reader import Record

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


SCAN = 2000
"""Records of a topic looked at, at most, for kinds of record not seen yet."""


def kind_of(value: Any) -> str:
    """The record's event kind: the ``event`` union's branch, or the first of ``events`` (raw), else ''."""
    if isinstance(value, dict):
        if isinstance(value.get("event"), tuple):
            return value["event"][0]
        if value.get("events") and isinstance(value["events"][0], tuple):
            return value["events"][0][0]
    return ""


def pick(records: Iterable[Record], per_kind: int, wanted: Callable[[], set[str]],
         scan: int = SCAN) -> dict[str, list[Record]]:
    """The first ``per_kind`` records of each event kind (:func:`kind_of`) of each topic; stops once
    ``scan`` records of each topic of ``wanted()`` (the topics with records in the range) were seen,
    or the range ends."""
    out: dict[str, list[Record]] = {}
    seen: dict[str, int] = {}
    taken: dict[tuple[str, str], int] = {}
    for r in records:
        seen[r.topic] = seen.get(r.topic, 0) + 1
        key = (r.topic, kind_of(r.value))
        if taken.get(key, 0) < per_kind:
            taken[key] = taken.get(key, 0) + 1
            out.setdefault(r.topic, []).append(r)
        if all(seen.get(t, 0) >= scan for t in wanted()):
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
