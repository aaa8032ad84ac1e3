"""What an engine family's adapter declares: its release table, from which the decoder's wire structs
(:mod:`kvbus.producers.wire_structs`) and the fleet's encoder (:mod:`kvbus.simulator.engine_wire`) are derived.

A table is a tuple of :func:`row` entries, oldest release first; each row is the first release of a
wire-layout change and says only what changed since the row before (fields appended, flags
flipped). A release between two rows speaks the older one (vLLM 0.27 speaks "vllm-0.26").
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Iterable

from kvbus.producers.engines.convert import KINDS


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
    lora_id_with_lora_name: bool = False
    """A BlockStored that names a LoRA adapter (``lora_name``) always carries its ``lora_id`` too (vLLM
    sets both from the request's adapter)."""


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
    releases. ``own_mediums``: medium values (upper-cased) that this family publishes and no other does.
    ``first``: the base :class:`Release` the first row applies to.
    """

    engine: str
    label: str
    table: tuple[Change, ...]
    first: Release
    array_layout: str | None = None
    arrays_take_every_field: bool = False
    own_mediums: tuple[str, ...] = ()
    releases: tuple[Release, ...] = ()
    shapes: dict[str, tuple[tuple[tuple[str, ...], Release], ...]] = field(default_factory=dict, repr=False,
                                                                             compare=False)
    """Event type -> the ``(fields in position order, release)`` of each tagged array it may send."""

    def __post_init__(self) -> None:
        out, cur = [], self.first
        for ch in self.table:
            cur = replace(cur, name=ch.name, stored=cur.stored + ch.stored, removed=cur.removed + ch.removed,
                          **ch.flags)
            out.append(cur)
        object.__setattr__(self, "releases", tuple(out))
        arrays = [r for r in out if not r.maps]
        for tag, every in zip(("BlockStored", "BlockRemoved"), self.array_fields()):
            shapes = {_fields(r, tag): r for r in arrays}
            if self.arrays_take_every_field and arrays:
                for n in range(min(map(len, shapes)), len(every) + 1):
                    shapes.setdefault(every[:n], arrays[-1])
            self.shapes[tag] = tuple(shapes.items())

    @property
    def formats(self) -> tuple[str, ...]:
        """Format ids of the table, oldest first."""
        return tuple(r.name for r in self.releases)

    def array_fields(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(BlockStored, BlockRemoved) fields of the array decoding layout, in position order."""
        rels = self.releases if self.arrays_take_every_field else [r for r in self.releases if not r.maps]
        return union(r.stored for r in rels), union(r.removed for r in rels)

    def read(self, event: Any) -> dict[str, Any] | None:
        """``event`` (a plain msgpack-decoded map or tagged array) read as some release of this family
        would have sent it, as field -> value; None when no release could have. A release could when the
        event has its shape (array length; map keys: the required ones present, the others only when
        set), every value set is of its field's kind (:data:`kvbus.producers.engines.convert.KINDS`),
        its hashes are of the release's kind (signed or unsigned ints, digests) and it keeps the
        release's promises (:attr:`Release.lora_id_with_lora_name`). Events other than BlockStored and
        BlockRemoved fit every release ({})."""
        if isinstance(event, dict):
            tag = event.get("type")
            if tag not in self.shapes:
                return {}
            values = {k: v for k, v in event.items() if k != "type"}
            candidates = [(_fields(r, tag), r) for r in self.releases if r.maps]
        elif isinstance(event, list) and event and isinstance(event[0], str):
            tag = event[0]
            if tag not in self.shapes:
                return {}
            values = None
            candidates = [s for s in self.shapes[tag] if len(s[0]) == len(event) - 1]
        else:
            return None
        kinds = KINDS[tag]
        for fields, r in candidates:
            if values is None:
                got = dict(zip(fields, event[1:]))
            else:
                required = fields[:r.stored_required if tag == "BlockStored" else r.removed_required]
                if any(k not in fields for k in values) or any(f not in values for f in required) \
                        or any(v is None for k, v in values.items() if k not in required):
                    continue
                got = values
            if any(v is not None and not isinstance(v, kinds.get(k, object)) for k, v in got.items()):
                continue
            if not _hashes_fit(r, got.get("block_hashes")):
                continue
            if r.lora_id_with_lora_name and got.get("lora_name") is not None and got.get("lora_id") is None:
                continue
            return got
        return None

    def consistent(self, event: Any) -> bool:
        """Whether some release of this family could have sent ``event`` (:meth:`read`)."""
        return self.read(event) is not None


def _fields(r: Release, tag: str) -> tuple[str, ...]:
    return r.stored if tag == "BlockStored" else r.removed


def _hashes_fit(r: Release, hashes: Any) -> bool:
    """Whether release ``r`` writes hashes like ``hashes``: signed int64 or unsigned uint64 ints, or
    digests (bytes) where it can send them. Not a list (or absent): nothing to tell."""
    if not isinstance(hashes, list):
        return True
    for h in hashes:
        if type(h) is int:
            if h < 0 and not r.signed_hashes or h >= 1 << 63 and r.signed_hashes:
                return False
        elif not (r.bytes_hashes and isinstance(h, bytes)):
            return False
    return True


def union(groups: Iterable[tuple[str, ...]]) -> tuple[str, ...]:
    """Field names of ``groups`` in order of first appearance."""
    out: dict[str, None] = {}
    for g in groups:
        out.update(dict.fromkeys(g))
    return tuple(out)

