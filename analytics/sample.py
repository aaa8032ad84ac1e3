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


def kinds_of(value: Any) -> list[str]:
    """The record's event kinds, in order: the ``event`` union's branch (one event), or the branch of each
    of its ``events`` (kvbus.raw's EventBatch: unions; a BlockEvents of block layout 2: entries whose
    ``event`` is the union); empty when the value holds no event."""
    if not isinstance(value, dict):
        return []
    if isinstance(value.get("event"), tuple):
        return [value["event"][0]]
    unions = [e.get("event") if isinstance(e, dict) else e for e in value.get("events") or ()]
    return [u[0] for u in unions if isinstance(u, tuple)]


def pick(records: Iterable[Record], per_kind: int, wanted: Callable[[], set[str]],
         scan: int = SCAN) -> dict[str, list[Record]]:
    """Records of each topic until each event kind of the topic is in ``per_kind`` of them (a record of
    several events, :func:`kinds_of`, is taken when one of its kinds is still short, and counts for each
    kind it holds; a record of no event counts as kind ``''``); stops once ``scan`` records of each topic
    of ``wanted()`` (the topics with records in the range) were seen, or the range ends."""
    out: dict[str, list[Record]] = {}
    seen: dict[str, int] = {}
    taken: dict[tuple[str, str], int] = {}
    for r in records:
        seen[r.topic] = seen.get(r.topic, 0) + 1
        keys = {(r.topic, k) for k in kinds_of(r.value) or [""]}
        if any(taken.get(key, 0) < per_kind for key in keys):
            for key in keys:
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
