"""The hybrid-model prefix rule in plain Python: the model :class:`tests.memory_store.InMemoryStore` answers
with, written as vLLM 0.33 writes it (``HybridKVCacheCoordinator.find_longest_cache_hit`` in
``vllm/v1/core/kv_cache_coordinator.py``, each manager's ``find_longest_cache_hit`` in
``single_type_kv_cache_manager.py``): block by block scans, obviously the same as vLLM's, against which
the Redis function's interval arithmetic (``kvbus.lua``, ``hybrid_hit``) is tested. The rule itself,
for users: docs/lookup-protocol.md, "Hybrid models".

Positions are 0-based indices into the lookup's chain (one hash per ``unit`` tokens); a group holds a
position when any of the holder's tiers of that group holds that hash.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

FULL, SLIDING, MAMBA, CHUNKED = "full", "sliding", "mamba", "chunked"
RULES = {"full_attention": FULL, "mla_attention": FULL, "sink_full_attention": FULL,
         "sliding_window": SLIDING, "sliding_window_mla": SLIDING, "mamba": MAMBA}
"""Manager rule per ``kv_cache_spec_kind``; any other kind (``unknown``, ``chunked_local_attention``
whose chunk size events do not carry, a kind of a later release) is held to the full-attention rule."""
FINE_KINDS = frozenset({"full_attention", "mla_attention", "sink_full_attention", "mamba"})
"""Kinds whose managers support fine-grained (hash-block) hits (``supports_fine_grained_hash_lookup``)."""


@dataclass(frozen=True)
class GroupSpec:
    """What a holder's events said of one KV cache group."""

    kind: str
    window: int | None
    block_size: int
    min_block_size: int

    @property
    def rule(self) -> str:
        r = RULES.get(self.kind, FULL)
        return FULL if r == SLIDING and not self.window else r


def hybrid_hit(specs: Mapping[int, GroupSpec], held: Mapping[int, set[int]], n: int) -> tuple[int, dict[int, int]]:
    """(hit, per-group hits), in chain positions, of a request of ``n`` positions whose groups hold ``held``
    (group -> positions): the coordinator's fixed point, and each spec group evaluated alone."""
    sizes = [s for g in specs.values() for s in (g.block_size, g.min_block_size) if s > 0]
    unit = math.gcd(*sizes) if sizes else 1
    bs = {gid: g.block_size if g.block_size > 0 else unit for gid, g in specs.items()}
    fine = any(g.rule == MAMBA and bs[gid] > unit for gid, g in specs.items()) and all(
        g.kind in FINE_KINDS or bs[gid] == unit for gid, g in specs.items())
    align = unit if fine else math.lcm(*bs.values())
    spec_groups: dict[tuple, list[int]] = {}
    for gid in sorted(specs):
        g = specs[gid]
        spec_groups.setdefault((g.rule, g.window if g.rule == SLIDING else None, bs[gid], g.kind), []).append(gid)
    order = sorted(spec_groups.items(), key=lambda kv: kv[0][0] != FULL)  # stable: full attention first

    def cached(gids: list[int], pos: int) -> bool:
        return all(pos in held.get(g, ()) for g in gids)

    def find(key: tuple, gids: list[int], max_length: int) -> int:
        rule, window, size, _ = key
        s = size // unit
        if rule == FULL:
            n_full = 0
            while n_full < max_length // size and cached(gids, (n_full + 1) * s - 1):
                n_full += 1
            hit = n_full * size
            if align < size and size % align == 0:  # phase 2: a partial block (fine-grained)
                first = n_full * s
                for j in range(min(first + s - 1, max_length // unit, n) - 1, first - 1, -1):
                    if cached(gids, j):
                        hit = (j + 1) * unit
                        break
            return hit - hit % align
        if rule == MAMBA:
            if align < size and size % align == 0:  # fine-grained: the last state at any hash block
                for j in range(min(max_length // unit, n) - 1, -1, -1):
                    if cached(gids, j):
                        return (j + 1) * unit
                return 0
            for i in range(max_length // size - 1, -1, -1):
                if cached(gids, (i + 1) * s - 1):
                    if size != align and (i + 1) * size % align != 0:
                        continue
                    return (i + 1) * size
            return 0
        need = -(-(window - 1) // size)  # SLIDING
        contiguous = 0
        for i in range(max_length // size - 1, -1, -1):
            if cached(gids, (i + 1) * s - 1):
                if contiguous == 0 and size != align and (i + 1) * size % align != 0:
                    continue
                contiguous += 1
                if contiguous >= need:
                    return (i + contiguous) * size
            else:
                contiguous = 0
        while size != align and contiguous * size % align != 0:
            contiguous -= 1
        return contiguous * size

    hit = n * unit
    full_hits: dict[tuple, int] = {}
    simple = len(order) == 2 and order[0][0][0] == FULL
    while True:
        curr = hit
        for key, gids in order:
            if key[0] == FULL and key in full_hits:
                curr = min(curr, full_hits[key])
                continue
            curr = find(key, gids, curr)
            if key[0] == FULL:
                full_hits[key] = curr
        if curr >= hit:
            break
        hit = curr
        if simple:
            break
    per_group = {gid: find(key, gids, n * unit) // unit for key, gids in order for gid in gids}
    return hit // unit, per_group
