"""``InMemoryStore``: the residency view as plain Python dicts.

The model of the contract (:mod:`kvbus.sinks.store`): simple enough to be obviously right, the oracle
of the Redis store in the tests (a test helper: the product's view is the Redis one).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence

from kvbus.schemas.events import AllBlocksCleared, BlockEvent, BlockRemoved, BlockStored, Reset, holder_key
from kvbus.sinks.refcounts import DEFAULT_POLICY, TierPolicy, Weights, group_spec, label
from kvbus.sinks.store import (
    ApplyResult,
    HolderMatch,
    ResidencyStore,
    Snapshot,
    split_holder,
    summary_from_counts,
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
    """The view in process memory. ``policy`` decides which tiers are ref-counted."""

    def __init__(self, policy: TierPolicy = DEFAULT_POLICY):
        self.policy = policy
        self.holders: dict[str, _Holder] = {}
        self.tier_rc: dict[str, bool] = {}  # descriptor -> ref-counted (first use wins)
        self.seen: dict[str, float] = {}
        self._stale: dict[str, float] = {}

    # -- writes ---------------------------------------------------------------

    def apply(self, records: Iterable[tuple[str, BlockEvent]]) -> ApplyResult:
        res = ApplyResult()
        for topic, ev in records:
            self._apply_one(topic, ev, res)
        return res

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
