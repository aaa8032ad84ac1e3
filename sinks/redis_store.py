"""``RedisStore``: the residency view in Redis, written and read through the ``kvbus`` functions.

Layout and cost figures: docs/sinks-layout.md. Every write is one FCALL per (holder, topic) group of
a batch, pipelined, so a batch costs one round trip; every lookup is one FCALL_RO.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any, Iterable, Sequence

import redis

from schemas.events import AllBlocksCleared, BlockEvent, BlockRemoved, BlockStored, Reset, holder_key

from sinks import functions
from sinks.store import (
    ApplyResult,
    HolderMatch,
    ResidencyStore,
    Snapshot,
    split_holder,
    summary_from_counts,
)
from sinks.tiers import DEFAULT_POLICY, TierPolicy, Weights, label

log = logging.getLogger("kvbus.sinks")

DEFAULT_PREFIX = "kvbus:"
MAX_EVENTS_PER_CALL = 1000
MAX_HASHES_PER_CALL = 8000
"""Events and block hashes per FCALL: bound how long one call keeps Redis busy (~10-20 ms)."""


def signed_int(raw: bytes) -> int:
    """A canonical 8-byte hash as the signed 64-bit integer the per-holder index stores."""
    return int.from_bytes(raw, "big", signed=True)


def raw_hash(value: int) -> bytes:
    """Inverse of :func:`signed_int`."""
    return value.to_bytes(8, "big", signed=True)


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


class RedisStore(ResidencyStore):
    """The view in Redis under key prefix ``prefix``.

    ``client``: a ``redis.Redis`` (``decode_responses=False``) or a URL. ``load``: check the server
    version and load the function library now (a read-only lookup client passes False).
    """

    def __init__(
        self,
        client: redis.Redis | str,
        prefix: str = DEFAULT_PREFIX,
        policy: TierPolicy = DEFAULT_POLICY,
        *,
        load: bool = True,
        max_events_per_call: int = MAX_EVENTS_PER_CALL,
        max_hashes_per_call: int = MAX_HASHES_PER_CALL,
    ):
        self.r = redis.Redis.from_url(client) if isinstance(client, str) else client
        self.prefix = prefix
        self.policy = policy
        self.max_events_per_call = max_events_per_call
        self.max_hashes_per_call = max_hashes_per_call
        self._rc: dict[str, str] = {}
        if load:
            functions.check_server(self.r)
            functions.ensure_library(self.r)

    # -- writes ---------------------------------------------------------------

    def _event_args(self, topic: str, ev: BlockEvent) -> tuple:
        e = ev.event
        if isinstance(e, (BlockStored, BlockRemoved)):
            desc = self.policy.tier_of(e)
            rc = self._rc.get(desc)
            if rc is None:
                rc = self._rc[desc] = "1" if self.policy.refcounted(desc) else "0"
            kind = "S" if isinstance(e, BlockStored) else "R"
            return (kind, topic, ev.epoch, ev.seq, ev.index, repr(ev.ts), desc, rc, b"".join(e.block_hashes))
        if isinstance(e, AllBlocksCleared):
            return ("C", topic, ev.epoch, ev.seq, ev.index, repr(ev.ts), "", "0", b"")
        if isinstance(e, Reset):
            return ("X", topic, ev.epoch, ev.seq, ev.index, repr(ev.ts), "", "0", b"")
        raise TypeError(f"not a kvbus event: {type(e).__name__}")

    def _calls(self, records: Iterable[tuple[str, BlockEvent]]) -> list[tuple[list[tuple[str, BlockEvent]], list]]:
        groups: "OrderedDict[str, list[tuple[str, BlockEvent]]]" = OrderedDict()
        for topic, ev in records:
            groups.setdefault(holder_key(ev.replica, ev.dp_rank), []).append((topic, ev))
        calls = []
        for recs in groups.values():
            ev0 = recs[0][1]
            head = [self.prefix, ev0.replica, ev0.dp_rank]
            part: list[tuple[str, BlockEvent]] = []
            args: list = list(head)
            nhashes = 0
            for topic, ev in recs:
                a = self._event_args(topic, ev)
                if part and (len(part) >= self.max_events_per_call
                             or nhashes + len(a[8]) // 8 > self.max_hashes_per_call):
                    calls.append((part, args))
                    part, args, nhashes = [], list(head), 0
                part.append((topic, ev))
                args.extend(a)
                nhashes += len(a[8]) // 8
            calls.append((part, args))
        return calls

    def apply(self, records: Iterable[tuple[str, BlockEvent]]) -> ApplyResult:
        """Apply records: one FCALL per holder (in record order), all in one pipeline (one round trip).

        A group the functions refuse (e.g. tier table full) is retried event by event; the events
        still refused are returned in ``failed`` and the rest is applied.
        """
        res = ApplyResult()
        calls = self._calls(records)
        if not calls:
            return res
        replies = self._pipeline(calls)
        if any(functions.is_missing(x) for x in replies if isinstance(x, Exception)):
            functions.load_library(self.r)
            replies = self._pipeline(calls)
        for (part, args), reply in zip(calls, replies):
            if isinstance(reply, Exception):
                self._apply_one_by_one(part, args, reply, res)
            else:
                self._add_reply(res, reply)
        return res

    def _pipeline(self, calls: list) -> list:
        pipe = self.r.pipeline(transaction=False)
        for _, args in calls:
            pipe.fcall("kvbus_apply", 0, *args)
        return pipe.execute(raise_on_error=False)

    def _apply_one_by_one(self, part, args, err: Exception, res: ApplyResult) -> None:
        log.warning("apply refused for %s#%s (%s): retrying event by event", args[1], args[2], err)
        for i, (topic, ev) in enumerate(part):
            one = args[:3] + args[3 + 9 * i: 12 + 9 * i]
            try:
                self._add_reply(res, functions.call(self.r, "kvbus_apply", *one))
            except redis.ResponseError as e:
                res.failed.append((topic, ev, f"{type(e).__name__}: {e}"))

    @staticmethod
    def _add_reply(res: ApplyResult, reply: list) -> None:
        applied, skipped, delta, resets, clears = (int(x) for x in reply)
        res.add(ApplyResult(applied, skipped, delta, resets, clears))

    def heartbeat(self, replica: str, dp_rank: int, ts: float) -> None:
        functions.call(self.r, "kvbus_heartbeat", self.prefix, replica, dp_rank, repr(ts))

    def expire_stale(self, max_age: float, now: float, batch: int = 64) -> list[str]:
        out: list[str] = []
        while True:
            names = functions.call(self.r, "kvbus_expire", self.prefix, repr(now - max_age), repr(now), batch)
            out.extend(_s(n) for n in names)
            if len(names) < batch:
                return out

    def drop_holder(self, replica: str, dp_rank: int, now: float) -> int:
        return int(functions.call(self.r, "kvbus_drop", self.prefix, holder_key(replica, dp_rank), repr(now)))

    # -- reads ----------------------------------------------------------------

    def lookup(
        self,
        chain: Sequence[bytes],
        *,
        weights: Weights | None = None,
        candidates: Sequence[str] | None = None,
    ) -> dict[str, HolderMatch]:
        """One FCALL_RO (works on replicas and for read-only ACL users)."""
        if not chain:
            return {}
        weights = weights or Weights()
        args: list = [self.prefix, b"".join(chain), len(weights.by_name)]
        for name, w in weights.by_name.items():
            args.extend((name, repr(float(w))))
        args.extend(candidates or ())
        return parse_lookup(functions.call(self.r, "kvbus_lookup", *args, readonly=True))

    def stale(self) -> dict[str, float]:
        return {_s(n): float(s) for n, s in self.r.zrange(self.prefix + "stale", 0, -1, withscores=True)}

    def _holders(self) -> dict[int, str]:
        return {int(k): _s(v) for k, v in self.r.hgetall(self.prefix + "hname").items() if k}

    def _tier_names(self) -> dict[int, str]:
        return {int(k): _s(v) for k, v in self.r.hgetall(self.prefix + "tname").items()}

    def _holder_state(self, hid: int) -> dict[str, str]:
        return {_s(k): _s(v) for k, v in self.r.hgetall(f"{self.prefix}H:{hid}").items()}

    def positions(self) -> dict[tuple[str, str], tuple[int, int, int]]:
        out = {}
        for hid, name in self._holders().items():
            for f, v in self._holder_state(hid).items():
                if f.startswith("p:"):
                    e, s, i = (int(x) for x in v.split())
                    out[(name, f[2:])] = (e, s, i)
        return out

    def _tiers_of(self, hid: int) -> dict[int, tuple[int, int, int]]:
        out = {}
        for f, v in self._holder_state(hid).items():
            if f.startswith("t:"):
                n, L, S, _ = v.split(" ", 3)
                out[int(f[2:])] = (int(n), int(L), int(S))
        return out

    def holder_blocks(self, hid: int, code: int) -> dict[bytes, int]:
        """Blocks of one (holder, tier) from its index, with reference counts."""
        n, L, S = self._tiers_of(hid).get(code, (0, 0, 0))
        pipe = self.r.pipeline(transaction=False)
        for b in range(2**L + S):
            pipe.smembers(f"{self.prefix}I:{hid}:{code}:{b}")
        blocks = {raw_hash(int(d)): 1 for members in pipe.execute() for d in members}
        for raw, extra in self.r.hgetall(f"{self.prefix}R:{hid}:{code}").items():
            blocks[raw] = blocks.get(raw, 1) + int(extra)
        return blocks

    def snapshot(self) -> Snapshot:
        tnames = self._tier_names()
        out: Snapshot = {}
        for hid, name in self._holders().items():
            tiers = {}
            for code in self._tiers_of(hid):
                blocks = self.holder_blocks(hid, code)
                if blocks:
                    tiers[label(tnames[code])] = blocks
            if tiers:
                out[name] = tiers
        return out

    def block_table(self) -> dict[bytes, set[tuple[str, str]]]:
        """The forward map read from the block table: hash -> {(holder name, tier label)} (tests)."""
        meta = {_s(k): int(v) for k, v in self.r.hgetall(self.prefix + "meta").items()}
        holders, tnames = self._holders(), self._tier_names()
        out: dict[bytes, set[tuple[str, str]]] = {}

        def add(raw: bytes, m: int) -> None:
            out.setdefault(raw, set()).add((holders[m // 64], label(tnames[m % 64])))

        for b in range(2 ** meta.get("bL", 0) + meta.get("bS", 0)):
            for raw, v in self.r.hgetall(f"{self.prefix}B:{b}").items():
                if v == b"":
                    for m in self.r.smembers(f"{self.prefix}W:".encode() + raw):
                        add(raw, int(m))
                else:
                    for j in range(0, len(v), 3):
                        add(raw, int.from_bytes(v[j:j + 3], "big"))
        return out

    def summary(self) -> dict[str, dict[str, int]]:
        tnames = self._tier_names()
        counts = {
            name: {label(tnames[code]): n for code, (n, _, _) in self._tiers_of(hid).items() if n}
            for hid, name in self._holders().items()
        }
        return summary_from_counts(counts)

    def size(self) -> dict[str, int]:
        meta = self.r.hmget(self.prefix + "meta", "entries", "blocks")
        return {
            "entries": int(meta[0] or 0),
            "blocks": int(meta[1] or 0),
            "holders": int(self.r.zcard(self.prefix + "seen")),
        }


def parse_lookup(reply: list) -> dict[str, HolderMatch]:
    """Turn ``kvbus_lookup``'s reply into ``{display name: HolderMatch}``."""
    names, rids, nums, descs = reply
    labels = {int(descs[i]): label(_s(descs[i + 1])) for i in range(0, len(descs), 2)}
    out: dict[str, HolderMatch] = {}
    k = 0
    for name, rh in zip(names, rids):
        matched, score, n = int(nums[k]), int(nums[k + 1]), int(nums[k + 2])
        tiers = {labels[int(nums[k + 3 + 2 * j])]: int(nums[k + 4 + 2 * j]) for j in range(n)}
        k += 3 + 2 * n
        replica, dp = split_holder(_s(name))
        hm = HolderMatch(replica, dp, matched, tiers, score / 1e6, len(_s(rh or b"").split()))
        out[hm.name] = hm
    return out
