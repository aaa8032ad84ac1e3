"""``InMemoryStore``: the residency view as plain Python dicts.

The model of the contract (:mod:`kvbus.sinks.view.store`): simple enough to be obviously right, the oracle
of the Redis store in the tests (a test helper: the product's view is the Redis one).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from kvbus.schemas.events import AllBlocksCleared, BlockEvent, BlockRemoved, BlockStored, Reset, holder_key
from kvbus.schemas.lookup import HolderMatch, view_status
from kvbus.sinks.view.reader import summary_from_counts
from kvbus.sinks.view.refcounts import DEFAULT_POLICY, TierPolicy, Weights, group_spec, label
from kvbus.sinks.view.store import (
    ApplyResult,
    Checkpoint,
    HolderDump,
    LostShards,
    Offsets,
    ResidencyStore,
    Snapshot,
    ViewChanged,
    split_holder,
)
from tests.hybrid_rule import GroupSpec, hybrid_hit

MAX_TIERS = 64


@dataclass
class _Tier:
    origin: str
    blocks: dict[bytes, int] = field(default_factory=dict)  # hash -> count (>= 1)


@dataclass
class _Holder:
    positions: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    floor: int = -1
    tiers: dict[str, _Tier] = field(default_factory=dict)  # descriptor -> tier
    model: str | None = None  # the model its latest applied event named
    groups: dict[int, GroupSpec] = field(default_factory=dict)  # KV cache group -> what its stores said


class InMemoryStore(ResidencyStore):
    """The view in process memory, one shard. ``policy`` decides which tiers are ref-counted."""

    def __init__(self, policy: TierPolicy = DEFAULT_POLICY, prefix: str = "memory:"):
        self.policy = policy
        self.prefix = prefix
        self.holders: dict[str, _Holder] = {}
        self.tier_rc: dict[str, bool] = {}  # descriptor -> ref-counted (first use wins)
        self.seen: dict[str, float] = {}
        self._stale: dict[str, float] = {}
        self.vid: str | None = None
        self.off: dict[tuple[str, int], int] = {}
        self._status: dict[str, str] = {}
        self.locks: dict[str, str] = {}  # name -> token (no expiry: one process)
        self.written = False  # anything written since the last wipe (a view without status is then ready)

    # -- writes ---------------------------------------------------------------

    def apply(self, records: Iterable[tuple[str, BlockEvent]], *, view_id: str | None = None,
              offsets: Offsets | None = None, expected: Checkpoint | None = None) -> ApplyResult:
        records = list(records)
        self._check(view_id, offsets, expected)
        res = ApplyResult()
        for topic, ev in records:
            self._apply_one(topic, ev, res)
        self.off.update(offsets or {})
        self.written = self.written or bool(records or offsets)
        return res

    def _check(self, view_id: str | None, offsets: Offsets | None, expected: Mapping | None) -> None:
        if view_id and view_id != self.vid:
            raise ViewChanged(f"the view in memory is not view {view_id!r} any more (it is {self.vid!r})")
        if expected is not None:
            for k in [*expected, *(offsets or {})]:
                if self.off.get(k) != expected.get(k):
                    raise ViewChanged(f"the view in memory stores {self.off.get(k)} for {k}, not {expected.get(k)}")

    def _apply_one(self, topic: str, ev: BlockEvent, res: ApplyResult) -> None:
        name = holder_key(ev.replica, ev.dp_rank)
        event = ev.event
        if isinstance(event, BlockStored) and event.block_hashes:
            desc = self.policy.tier_of(event)
            if desc not in self.tier_rc and len(self.tier_rc) >= MAX_TIERS:
                res.failed.append((topic, ev, f"tier table full ({MAX_TIERS} tiers), cannot add {desc}"))
                return
        h = self.holders.setdefault(name, _Holder())
        pos = (ev.epoch, ev.seq, ev.index)
        old = h.positions.get(topic)
        if ev.epoch < h.floor or (old is not None and pos <= old):
            res.skipped += 1
            return
        if isinstance(event, BlockStored):
            res.entries_delta += self._store(h, topic, event)
            self._note_group(h, event)
        elif isinstance(event, BlockRemoved):
            res.entries_delta -= self._remove(h, event)
        elif isinstance(event, AllBlocksCleared):
            for desc in [d for d, t in h.tiers.items() if t.origin == topic]:
                res.entries_delta -= len(h.tiers.pop(desc).blocks)
            res.clears += 1
        elif isinstance(event, Reset):
            for desc in list(h.tiers):
                origin = h.tiers[desc].origin
                p = h.positions.get(origin)
                if origin == topic or p is None or p[0] < ev.epoch:
                    res.entries_delta -= len(h.tiers.pop(desc).blocks)
            h.floor = max(h.floor, ev.epoch)
            h.groups.clear()
            res.resets += 1
        h.positions[topic] = pos
        h.model = ev.model
        res.applied += 1
        self.seen[name] = max(self.seen.get(name, ev.ts), ev.ts)
        self._stale.pop(name, None)

    def _store(self, h: _Holder, topic: str, event: BlockStored) -> int:
        if not event.block_hashes:
            return 0
        desc = self.policy.tier_of(event)
        rc = self.tier_rc.setdefault(desc, self.policy.refcounted(desc))
        tier = h.tiers.setdefault(desc, _Tier(origin=topic))
        added = 0
        for hsh in event.block_hashes:
            if hsh not in tier.blocks:
                tier.blocks[hsh] = 1
                added += 1
            elif rc:
                tier.blocks[hsh] += 1
        return added

    @staticmethod
    def _note_group(h: _Holder, event: BlockStored) -> None:
        """Record what a store said of its KV cache group: the latest kind and window, the largest and
        smallest block size."""
        spec = group_spec(event)
        if spec is None:
            return
        kind, window, bs = spec.split(",")
        g = int(event.group_idx or 0)
        old = h.groups.get(g)
        size = int(bs)
        h.groups[g] = GroupSpec(kind, int(window) if window else None, max(size, old.block_size if old else 0),
                                min(size, old.min_block_size if old else size))

    def _remove(self, h: _Holder, event: BlockRemoved) -> int:
        desc = self.policy.tier_of(event)
        tier = h.tiers.get(desc)
        if tier is None:
            return 0
        removed = 0
        for hsh in event.block_hashes:
            n = tier.blocks.get(hsh)
            if n is None:
                continue
            if n > 1:
                tier.blocks[hsh] = n - 1
            else:
                del tier.blocks[hsh]
                removed += 1
        return removed

    def heartbeat(self, replica: str, dp_rank: int, ts: float) -> None:
        name = holder_key(replica, dp_rank)
        self.holders.setdefault(name, _Holder())
        self.seen[name] = max(self.seen.get(name, ts), ts)
        self._stale.pop(name, None)

    def expire_stale(self, max_age: float, now: float) -> list[str]:
        cutoff = now - max_age
        out = [n for n, ts in sorted(self.seen.items(), key=lambda kv: kv[1]) if ts <= cutoff]
        for name in out:
            self._forget(name, now)
        return out

    def drop_holder(self, replica: str, dp_rank: int, now: float) -> int:
        name = holder_key(replica, dp_rank)
        if name not in self.holders:
            return 0
        return self._forget(name, now)

    def _forget(self, name: str, now: float) -> int:
        h = self.holders[name]
        n = sum(len(t.blocks) for t in h.tiers.values())
        h.tiers.clear()
        h.model = None
        h.groups.clear()
        self.seen.pop(name, None)
        self._stale[name] = now
        return n

    # -- reads ----------------------------------------------------------------

    def lookup(
        self,
        chain: Sequence[bytes],
        *,
        weights: Weights | None = None,
        candidates: Sequence[str] | None = None,
        model: str | None = None,
    ) -> dict[str, HolderMatch]:
        weights = weights or Weights()
        allowed = None
        if candidates:
            allowed = {n for n in self.holders if n in candidates or split_holder(n)[0] in candidates}
        if model is not None:
            allowed = {n for n, h in self.holders.items() if h.model == model and (allowed is None or n in allowed)}
        block_map: dict[bytes, dict[str, list[str]]] = {}
        wanted = set(chain)
        for name, h in self.holders.items():
            if allowed is not None and name not in allowed:
                continue
            for desc, tier in h.tiers.items():
                for hsh in wanted.intersection(tier.blocks):
                    block_map.setdefault(hsh, {}).setdefault(name, []).append(desc)
        matched: dict[str, int] = {}
        score: dict[str, float] = {}
        runs: dict[str, dict[str, int]] = {}
        for i, hsh in enumerate(chain, start=1):
            holders = block_map.get(hsh, {})
            present = [n for n in holders if (i == 1 or matched.get(n) == i - 1)]
            if not present:
                break
            for n in present:
                matched[n] = i
                score[n] = score.get(n, 0.0) + max(weights.of(d) for d in holders[n])
                r = runs.setdefault(n, {})
                for d in holders[n]:
                    if r.get(d, 0) == i - 1:
                        r[d] = i
        ranks: dict[str, int] = {}
        for n in self.holders:
            ranks[split_holder(n)[0]] = ranks.get(split_holder(n)[0], 0) + 1
        out = {}
        for n, m in matched.items():
            replica, dp = split_holder(n)
            groups: dict[int, int] = {}
            specs = self.holders[n].groups
            if len(specs) >= 2:  # a hybrid model: vLLM's coordinator over the m blocks held in some tier
                held = {g: {j for j in range(m) if any(d.split("|")[2] == str(g) for d in block_map[chain[j]][n])}
                        for g in specs}
                m, groups = hybrid_hit(specs, held, m)
                if m == 0:
                    continue
                score[n] = sum(max(weights.of(d) for d in block_map[chain[j]][n]) for j in range(m))
            hm = HolderMatch(
                replica=replica,
                dp_rank=dp,
                matched=m,
                tiers={label(d): r for d, r in runs[n].items()},
                score=round(score[n], 6),
                dp_ranks=ranks[replica],
                groups=groups,
            )
            out[hm.name] = hm
        return out

    def stale(self) -> dict[str, float]:
        return dict(self._stale)

    def positions(self) -> dict[tuple[str, str], tuple[int, int, int]]:
        return {(n, t): p for n, h in self.holders.items() for t, p in h.positions.items()}

    def models(self) -> dict[str, str]:
        return {n: h.model for n, h in self.holders.items() if h.model is not None}

    def snapshot(self) -> Snapshot:
        out: Snapshot = {}
        for name, h in self.holders.items():
            tiers = {label(d): dict(t.blocks) for d, t in h.tiers.items() if t.blocks}
            if tiers:
                out[name] = tiers
        return out

    def summary(self) -> dict[str, dict[str, int]]:
        counts = {n: {label(d): len(t.blocks) for d, t in h.tiers.items() if t.blocks} for n, h in self.holders.items()}
        return summary_from_counts(counts)

    def size(self, exact: bool = True) -> dict[str, int]:
        blocks: set[bytes] = set()
        entries = 0
        for h in self.holders.values():
            for t in h.tiers.values():
                entries += len(t.blocks)
                blocks.update(t.blocks)
        return {"entries": entries, "blocks": len(blocks), "holders": len(self.seen)}

    # -- recovery -------------------------------------------------------------

    @staticmethod
    def _mine(shards: Iterable[int] | None) -> bool:
        return shards is None or 0 in shards

    def view_id(self) -> str | None:
        return self.vid

    def set_view_id(self, view_id: str, shards: Iterable[int] | None = None) -> None:
        if self._mine(shards):
            self.vid, self.written = view_id, True

    def drop_view_id(self, view_id: str, why: str) -> bool:
        if self.vid != view_id:
            return False
        self.vid = None
        self._status = {"state": "rebuilding", "since": repr(time.time()), "phase": why}
        return True

    def offsets(self) -> dict[tuple[str, int], int]:
        return dict(self.off)

    def set_offsets(self, offsets: Offsets, view_id: str | None = None, expected: Checkpoint | None = None,
                    shards: Iterable[int] | None = None) -> None:
        if not offsets or not self._mine(shards):
            return
        self._check(view_id, offsets, None if expected is None else {k: expected.get(k) for k in offsets})
        self.off.update(offsets)
        self.written = True

    def checkpoint(self, partitions: Iterable[tuple[str, int]]) -> Checkpoint:
        return {tp: self.off.get(tp) for tp in partitions}

    def advance(self, expected: Checkpoint, offsets: Offsets) -> Checkpoint:
        return {**expected, **offsets}

    def holds(self, expected: Checkpoint) -> bool:
        return self.checkpoint(expected) == expected

    def lost_shards(self) -> LostShards | None:
        return None

    def shard(self, replica: str, dp_rank: int) -> int:
        return 0

    def identity(self) -> tuple:
        return (id(self),)

    def status(self) -> dict[str, str]:
        if self._status.get("state"):
            return dict(self._status)
        return view_status([self._status], [self.written]).as_dict()

    def set_status(self, **fields: Any) -> None:
        self._status = {k: str(v) for k, v in fields.items()}

    def wipe(self, keep: Sequence[str] = ("status", "lock", "load"), shards: Iterable[int] | None = None) -> int:
        if not self._mine(shards):
            return 0
        n = sum(len(t.blocks) for h in self.holders.values() for t in h.tiers.values())
        self.holders.clear()
        self.tier_rc.clear()
        self.seen.clear()
        self._stale.clear()
        self.vid, self.off, self.written = None, {}, False
        if "status" not in keep:
            self._status = {}
        self.locks = {k: v for k, v in self.locks.items() if k in keep}
        return n

    def try_lock(self, name: str, token: str, ttl_ms: int) -> bool:
        if name in self.locks:
            return False
        self.locks[name] = token
        return True

    def renew_lock(self, name: str, token: str, ttl_ms: int) -> bool:
        return self.locks.get(name) == token

    def unlock(self, name: str, token: str) -> None:
        if self.locks.get(name) == token:
            del self.locks[name]

    def holder_ids(self) -> dict[int, str]:
        return dict(enumerate(sorted(self.holders)))

    def dump_holder(self, key: int) -> HolderDump:
        name = self.holder_ids()[key]
        h = self.holders[name]
        tiers = []
        for desc, t in h.tiers.items():
            raws = b"".join(t.blocks)
            extra = b"".join(raw * (n - 1) for raw, n in t.blocks.items())
            tiers.append((desc, self.tier_rc.get(desc, False), t.origin, raws, extra))
        groups = [(g, f"{sp.kind},{'' if sp.window is None else sp.window},{sp.block_size},{sp.min_block_size}")
                  for g, sp in sorted(h.groups.items())]
        return HolderDump(seen=self.seen.get(name), floor=None if h.floor < 0 else float(h.floor),
                          positions=[(t, *p) for t, p in h.positions.items()], tiers=tiers, model=h.model,
                          groups=groups)

    def restore_holder(self, replica: str, dp_rank: int, state: HolderDump, max_hashes: int = 16384) -> int:
        name = holder_key(replica, dp_rank)
        h = self.holders.setdefault(name, _Holder())
        h.positions.update({t: (e, s, i) for t, e, s, i in state.positions})
        if state.floor is not None:
            h.floor = max(h.floor, int(state.floor))
        if state.model is not None:
            h.model = state.model
        if state.seen is not None:
            self.seen[name] = state.seen
        added = 0
        for desc, rc, origin, raws, extra in state.tiers:
            self.tier_rc.setdefault(desc, rc)
            tier = h.tiers.setdefault(desc, _Tier(origin=origin))
            for j in range(0, len(raws), 8):
                if raws[j:j + 8] not in tier.blocks:
                    tier.blocks[raws[j:j + 8]] = 1
                    added += 1
            for j in range(0, len(extra), 8):
                tier.blocks[extra[j:j + 8]] += 1
        for g, spec in state.groups:
            kind, window, bmax, bmin = spec.split(",")
            h.groups[g] = GroupSpec(kind, int(window) if window else None, int(bmax), int(bmin))
        self.written = True
        return added

    def servers(self) -> list[tuple[str, Any]]:
        return []

    def reader(self) -> "InMemoryStore":
        """The model reads itself: it answers :class:`kvbus.sinks.view.reader.ViewReader`'s summary, size and stale."""
        return self
