"""What an engine family's adapter declares: its release table, from which the decoder's wire structs
(:mod:`kvbus.producers.wire_structs`) and the fleet's encoder (:mod:`kvbus.engine_wire`) are derived.

A table is a tuple of :func:`row` entries, oldest release first; each row is the first release of a
wire-layout change and says only what changed since the row before (fields appended, flags
flipped). A release between two rows speaks the older one (vLLM 0.27 speaks "vllm-0.26").
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Iterable

@dataclass(frozen=True)
class Release:
    """How one engine release encodes a batch (one row of a release table, changes applied)."""

    name: str
    """Format id, e.g. "vllm-0.26": the first release of this layout."""
    engine: str
    """Engine family: vllm, sglang or lmcache (LMCache events inside a vLLM stream)."""
    maps: bool
    """Events as maps ``{"type": ..., field: value}`` (True) or tagged arrays ``[tag, f1, ...]`` (False)."""
    dp_rank: bool
    """The envelope carries dp_rank as its 3rd element (``[ts, events, dp_rank]``)."""
    stored: tuple[str, ...]
    """BlockStored fields in wire order (array positions 1.., or map key order)."""
    removed: tuple[str, ...]
    """BlockRemoved fields in wire order."""
    stored_required: int
    """Map formats: the first N stored fields are written even when None; later ones only when set."""
    removed_required: int
    """Map formats: the first N removed fields are written even when None."""
    signed_hashes: bool
    """Integer hashes are written as signed int64 (else unsigned uint64)."""
    bytes_hashes: bool
    """The release can send raw digests as ``bin`` (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0)."""
    replay_topic: bool
    """Replay replies carry the topic frame (vLLM >= 0.26, SGLang 0.5.23)."""
    lower_stored_medium: bool = False
    """BlockStored medium is written lower-case (LMCache's in-process path sends "cpu")."""


@dataclass(frozen=True)
class Change:
    """One table row: the release ``name`` and what it changes relative to the row before."""

    name: str
    stored: tuple[str, ...] = ()
    """BlockStored fields the release appends."""
    removed: tuple[str, ...] = ()
    """BlockRemoved fields the release appends."""
    flags: dict[str, Any] = field(default_factory=dict)
    """Release attributes (maps, dp_rank, signed_hashes, bytes_hashes, replay_topic, ...) it sets."""


def row(name: str, *, stored: Iterable[str] = (), removed: Iterable[str] = (), **flags: Any) -> Change:
    """A release-table row: release ``name`` appends ``stored``/``removed`` fields and sets ``flags``
    (:class:`Release` attributes)."""
    return Change(name, tuple(stored), tuple(removed), flags)


@dataclass(frozen=True)
class Adapter:
    """One engine family: its release table and what the decoder needs to read it.

    ``label``: the ``EventBatch.engine`` of its streams (LMCache events travel in a vLLM stream:
    "vllm"). ``array_layout``: name of its tagged-array decoding layout ("vllm", "sglang"), None if
    it never sent arrays. ``arrays_take_every_field``: decode its arrays with every field of every
    release (SGLang: its longer arrays are accepted defensively), not just those of its array
    releases. ``first``: the base :class:`Release` the first row applies to.
    """

    engine: str
    label: str
    table: tuple[Change, ...]
    first: Release
    array_layout: str | None = None
    arrays_take_every_field: bool = False
    releases: tuple[Release, ...] = ()

    def __post_init__(self) -> None:
        out, cur = [], self.first
        for ch in self.table:
            cur = replace(cur, name=ch.name, stored=cur.stored + ch.stored, removed=cur.removed + ch.removed,
                          **ch.flags)
            out.append(cur)
        object.__setattr__(self, "releases", tuple(out))

    @property
    def formats(self) -> tuple[str, ...]:
        """Format ids of the table, oldest first."""
        return tuple(r.name for r in self.releases)

    def array_fields(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(BlockStored, BlockRemoved) fields of the array decoding layout, in position order."""
        rels = self.releases if self.arrays_take_every_field else [r for r in self.releases if not r.maps]
        return union(r.stored for r in rels), union(r.removed for r in rels)

    def consistent(self, event: Any) -> bool:
        """Whether some release of this family could have sent ``event`` (a plain msgpack-decoded
        map or tagged array): its shape (array length, or map keys: required ones present, optional
        ones only when set) and its hashes (signed, unsigned or bytes) fit the release."""
        if isinstance(event, dict):
            tag = event.get("type")
            keys = [k for k in event if k != "type"]
            hashes = event.get("block_hashes")
        elif isinstance(event, list) and event and isinstance(event[0], str):
            tag, keys, hashes = event[0], None, event[1] if len(event) > 1 else None
        else:
            return False
        for r in self.releases:
            if tag == "BlockStored":
                fields, required = r.stored, r.stored_required
            elif tag == "BlockRemoved":
                fields, required = r.removed, r.removed_required
            else:
                return True  # AllBlocksCleared: every release
            if keys is None:
                if r.maps or len(event) != len(fields) + 1:
                    continue
            elif not r.maps or any(k not in fields for k in keys) or any(f not in event for f in fields[:required]) \
                    or any(event[k] is None for k in keys if k not in fields[:required]):
                continue
            if _hashes_fit(r, hashes):
                return True
        return False


def _hashes_fit(r: Release, hashes: Any) -> bool:
    if not isinstance(hashes, list):
        return True
    for h in hashes:
        if type(h) is int:
            if h < 0 and not r.signed_hashes or h >= 1 << 63 and r.signed_hashes:
                return False
        elif not r.bytes_hashes:
            return False
    return True


def union(groups: Iterable[tuple[str, ...]]) -> tuple[str, ...]:
    """Field names of ``groups`` in order of first appearance."""
    out: dict[str, None] = {}
    for g in groups:
        out.update(dict.fromkeys(g))
    return tuple(out)

