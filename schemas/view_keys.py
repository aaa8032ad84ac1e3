"""The residency view's keys in Redis: every key of layout :data:`kvbus.schemas.lookup.LAYOUT`, declared
once. The writer (``sinks/view/lua/kvbus.lua`` and :mod:`kvbus.sinks.view.protocol`), the readers
(:mod:`kvbus.schemas.lookup`, the Go package ``clients/go/kvbuslookup``) and docs/sinks-layout.md's key
tables name the same keys: ``tests/test_view_keys.py`` holds each of them to this list.

A key is the view's prefix ``P`` (``kvbus:``; on Redis Cluster one prefix per shard,
:func:`kvbus.schemas.lookup.shard_prefix`) followed by its :attr:`ViewKey.name`, and for the families
(``H:``, ``I:``, ...) by the parts :attr:`ViewKey.parts` names, ``:``-separated.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, Mapping


@dataclass(frozen=True)
class ViewKey:
    """One key (or one family of keys) of the view."""

    name: str
    """What follows the prefix: ``meta``, or a family's stem ending in ``:`` (``H:``)."""
    kind: str
    """Its Redis type: HASH, ZSET, STRING, or NONE (never written)."""
    parts: tuple[str, ...] = ()
    """A family's parts after the stem, in order (``("hid",)`` for ``H:<hid>``)."""
    readers: bool = False
    """Whether routers read it (the lookup protocol's keys); else only the sinks do."""

    def __call__(self, prefix: str, *parts: object) -> str:
        """The key under ``prefix``, with ``parts`` for a family (as many as :attr:`parts`)."""
        if len(parts) != len(self.parts):
            raise ValueError(f"{self.name} takes {len(self.parts)} parts, got {len(parts)}")
        return prefix + self.name + ":".join(str(p) for p in parts)


META = ViewKey("meta", "HASH", readers=True)
"""The view's metadata: ``layout``, ``vid``, sizes and split state; on shard 0 of a cluster ``shards``."""
GUARD = ViewKey("guard", "NONE", readers=True)
"""Never written: every call on Redis Cluster declares it, so that Redis refuses the call (TRYAGAIN)
while the shard's slot migrates."""
HNAME = ViewKey("hname", "HASH", readers=True)
"""Holder id -> holder name ``<replica>#<dp_rank>``."""
STATUS = ViewKey("status", "HASH", readers=True)
"""Whether answers can be trusted (``state``, ``since``, ``phase``, ...), written by the sinks."""
LOAD = ViewKey("load", "HASH", readers=True)
"""Routers' shared load (kvbus.client.load): ``<router> NUL <replica>`` -> its requests in flight,
``<router> NUL <replica> NUL t`` -> their prompt tokens, ``<router>`` -> the router's lease (Unix ms it
counts until). Written by routers, never by the sinks; on Redis Cluster in shard 0's slot."""
HID = ViewKey("hid", "HASH")
"""Holder name -> holder id."""
REPLICA_HIDS = ViewKey("rh", "HASH")
"""Replica -> the hids of its dp ranks."""
TIER_ID = ViewKey("tid", "HASH")
"""Tier descriptor -> tier code."""
TIER_NAME = ViewKey("tname", "HASH")
"""Tier code -> tier descriptor."""
TIER_COUNTED = ViewKey("trc", "HASH")
"""Tier code -> ``1`` if the tier is reference-counted."""
MODEL_HIDS = ViewKey("mh", "HASH")
"""Model -> the hids of its live holders."""
GROUPS = ViewKey("gs", "HASH")
"""Hid -> the KV cache groups of a hybrid-model holder."""
OFFSETS = ViewKey("off", "HASH")
"""``<topic>:<partition>`` -> the next Kafka offset to apply (and the chains of split batches)."""
SEEN = ViewKey("seen", "ZSET")
"""Live holders by when last heard from."""
STALE = ViewKey("stale", "ZSET")
"""Expired holder names by when they expired."""
LOCK = ViewKey("lock", "STRING")
"""The rebuild lock: one sink rebuilds."""
SNAPSHOT_LOCK = ViewKey("snaplock", "STRING")
"""The snapshot lock: one sink snapshots per period."""
HOLDER = ViewKey("H:", "HASH", ("hid",))
"""One holder's state: positions, reset floor, tiers, model, groups."""
INDEX = ViewKey("I:", "STRING", ("hid", "code", "bucket"))
"""One bucket of a (holder, tier) index: a toggle log of its blocks."""
REFCOUNTS = ViewKey("R:", "HASH", ("hid", "code"))
"""Reference counts above one of a counted tier."""
BLOCKS = ViewKey("B:", "HASH", ("bucket",))
"""One bucket of the block table: raw hash -> its members."""
WIDE = ViewKey("W:", "STRING", ("raw hash",))
"""The members of a block held by many holders (the raw hash's 8 bytes follow the stem)."""
PREDICTED = ViewKey("X:", "ZSET", ("hid",))
"""A holder's predicted entries (``kvbus_predict``, written by routers): raw hash -> when the prediction
expires (the server's clock, ms); the key expires with its latest prediction."""
PREDICTED_HOLDERS = ViewKey("xh", "HASH")
"""Hid -> ``"<expiry ms> <model>"`` of each holder with predicted entries (model empty: none named);
expires with its latest entry."""

KEYS: tuple[ViewKey, ...] = (META, GUARD, HNAME, STATUS, LOAD, HID, REPLICA_HIDS, TIER_ID, TIER_NAME, TIER_COUNTED,
                             MODEL_HIDS, GROUPS, OFFSETS, SEEN, STALE, LOCK, SNAPSHOT_LOCK, HOLDER, INDEX,
                             REFCOUNTS, BLOCKS, WIDE, PREDICTED, PREDICTED_HOLDERS)
"""Every key of the view."""
WRITTEN_BY_PYTHON = frozenset({STATUS.name, LOCK.name, SNAPSHOT_LOCK.name, GUARD.name, LOAD.name})
"""Keys the function library never names: the sinks write the status and the locks from Python, routers
their load, and the guard is only declared."""
KEPT_BY_WIPE = (STATUS.name, LOCK.name, LOAD.name)
"""What a sink's wipe of the view (a rebuild) keeps: the status routers read, the rebuild lock, and the
routers' load (it is theirs, not the view's contents)."""


# ----------------------------------------------------------------------------- values readers decode

STATE_TIER = struct.Struct(">dII")
"""A holder's state field ``t:<code>`` (in :data:`HOLDER`): entries, L, S of the tier's index, then its origin
topic (kvbus.lua: TSTATE). Readers take the entries: a holder's blocks on that tier."""


def block_buckets(meta: Mapping[bytes, Any]) -> int:
    """How many :data:`BLOCKS` buckets the block table has, from ``HGETALL P meta`` (``bL``, ``bS``)."""
    return 2 ** int(meta.get(b"bL", 0)) + int(meta.get(b"bS", 0))
