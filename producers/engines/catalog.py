"""The engine registry: engine names -> adapters (as llm-d's ``NewAdapter`` does), format ids ->
releases, and what all the release tables say together (:data:`FORMATS`, :data:`SENT`)."""
from __future__ import annotations

import re

from kvbus.producers.engines import lmcache, sglang, vllm
from kvbus.producers.engines.base import Adapter, Release, union

ADAPTERS: dict[str, Adapter] = {a.engine: a for a in (vllm.ADAPTER, sglang.ADAPTER, lmcache.ADAPTER)}
"""Engine family name -> adapter, in the order their formats are listed."""

RELEASES: dict[str, Release] = {r.name: r for a in ADAPTERS.values() for r in a.releases}
"""Format id -> release."""

FORMATS: tuple[str, ...] = tuple(RELEASES)
"""Every wire-format id, each the first release of a layout change (protocol doc §4, §7, §8)."""

SENT: dict[str, tuple[str, ...]] = {
    "BlockStored": union(r.stored for r in RELEASES.values()),
    "BlockRemoved": union(r.removed for r in RELEASES.values()),
}
"""Event type -> every field some release of some engine sends, in order of first appearance: the
decoder's map layout and what the conversion (:class:`kvbus.producers.engines.convert.Conversion`) reads."""


def new_adapter(engine: str) -> Adapter:
    """The adapter of engine family ``engine`` (vllm, sglang, lmcache); ValueError if unknown."""
    try:
        return ADAPTERS[engine]
    except KeyError:
        raise ValueError(f"unknown engine {engine!r}; known: {', '.join(ADAPTERS)}") from None


def release(fmt: str) -> Release:
    """The :class:`Release` of a format id; ValueError if unknown."""
    try:
        return RELEASES[fmt]
    except KeyError:
        raise ValueError(f"unknown engine format {fmt!r}; known: {', '.join(FORMATS)}") from None


_VERSION = re.compile(r"^([a-z]+)-(\d+(?:\.\d+)*)")


def _vtuple(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in v.split("."))


def resolve_format(name: str) -> str:
    """Map ``<engine>-<release>`` (e.g. "vllm-0.27.1", "sglang-0.5.21") to the format id it speaks:
    the newest table row not newer than it. Exact format ids map to themselves. ValueError for
    unknown engines or releases older than the first supported one."""
    if name in RELEASES:
        return name
    m = _VERSION.match(name)
    if not m or m.group(1) not in ADAPTERS:
        raise ValueError(f"not an engine release {name!r}; expected e.g. vllm-0.27.1 or one of {FORMATS}")
    engine, version = m.group(1), _vtuple(m.group(2))
    best = None
    for fmt in ADAPTERS[engine].formats:
        if _vtuple(fmt.split("-", 1)[1]) <= version:
            best = fmt
    if best is None:
        raise ValueError(f"{name!r} is older than every supported {engine} format")
    return best
