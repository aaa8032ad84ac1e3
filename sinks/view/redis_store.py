"""``RedisStore``: the residency view in Redis (one server, or one shard of a Redis Cluster view), written
and read through the ``kvbus`` functions (the protocol: sinks/view/protocol.py).

Layout and cost figures: docs/sinks-layout.md. A batch of records is written with one FCALL (each
holder's events in record order; more calls only past the per-call limits), pipelined: one round
trip; every lookup is one FCALL_RO.
"""
from __future__ import annotations

import logging
import re
import time
from typing import Any, Iterable, Iterator, Mapping, Sequence

import redis

from kvbus.schemas import view_keys
from kvbus.schemas.events import BlockEvent, holder_key
from kvbus.schemas.lookup import (
    DEFAULT_PREFIX,
    LOOKUP_FUNCTION,
    HolderMatch,
    HolderNames,
    hname_key,
    lookup_args,
    meta_key,
    option_args,
    parse_hname,
    status_key,
    view_status,
)
from kvbus.sinks.view import functions, protocol as vp
from kvbus.sinks.view.cluster import RETRYABLE
from kvbus.sinks.view.reader import ViewClient
from kvbus.sinks.view.refcounts import DEFAULT_POLICY, TierPolicy, Weights, label
from kvbus.sinks.view.store import (
    ApplyResult,
    Checkpoint,
    HolderDump,
    LostShards,
    Offsets,
    ResidencyStore,
    Snapshot,
    ViewChanged,
)
from kvbus.sinks.view.transport import NodeTransport, Transport

log = logging.getLogger("kvbus.sinks")

__all__ = ["DEFAULT_PREFIX", "DEFAULT_WEIGHTS", "RedisStore", "ViewChanged"]

DEFAULT_WEIGHTS = Weights()


class RedisStore(ResidencyStore):
    """The view in Redis under key prefix ``prefix``: one shard (a view of one shard is the whole view).

    ``client``: a ``redis.Redis`` (``decode_responses=False``) or a URL; plain keys are read through
    it (on Redis Cluster a ``RedisCluster``: a shard's keys share one slot). ``load``: check the
    server version and load the function library now (a read-only lookup client passes False).
    ``transport``: how the function calls are sent (default: to ``client``'s server,
    :class:`~kvbus.sinks.view.transport.NodeTransport`); ``what``: the view as messages name it.
    """

    def __init__(
        self,
        client: redis.Redis | str,
        prefix: str = DEFAULT_PREFIX,
        policy: TierPolicy = DEFAULT_POLICY,
        *,
        load: bool = True,
        max_events_per_call: int = vp.MAX_EVENTS_PER_CALL,
        max_hashes_per_call: int = vp.MAX_HASHES_PER_CALL,
        transport: Transport | None = None,
        what: str | None = None,
    ):
        self.r = redis.Redis.from_url(client) if isinstance(client, str) else client
        self.prefix = prefix
        self.policy = policy
        self.packer = vp.Packer(prefix, policy, max_events_per_call, max_hashes_per_call)
        """Packs records into ``kvbus_apply`` calls (per-call limits: ``packer.max_events``, ``packer.max_hashes``)."""
        self.transport: Transport = transport or NodeTransport(self.r)
        """The one way this store's function calls are sent."""
        self.what = what or f"the view under {prefix!r}"
        self._names = HolderNames()
        if load:
            functions.check_server(self.r)
            functions.ensure_library(self.r)

    # -- writes ---------------------------------------------------------------

    def apply(self, records: Iterable[tuple[str, BlockEvent]], *, view_id: str | None = None,
              offsets: Offsets | None = None,
              expected: Mapping[tuple[str, int], int | None] | None = None) -> ApplyResult:
        """Apply records: one FCALL for the whole batch (more when it exceeds the per-call limits), each
        sent as soon as it is packed and the replies read at the end (one round trip; Redis runs a
        call while the next is packed); each holder's records are applied in record order.

        ``view_id``: every call fails with :class:`ViewChanged`, before writing, unless the view's id
        (:meth:`view_id`) is this one. ``offsets``: (topic, partition) -> next Kafka offset, stored in
        ``P off`` by the batch's last call, atomically with it (:meth:`offsets`). ``expected``: what
        ``P off`` holds for each partition of ``offsets`` (None: nothing) as far as the caller knows
        (:meth:`checkpoint`); every call fails with :class:`ViewChanged` if it does not.

        A group the functions refuse (e.g. tier table full) is retried event by event; the events
        still refused are returned in ``failed`` and the rest is applied.
        """
        parts: list[list] = []

        def args() -> Iterator[list]:
            for part, a in self.packer.plan(records, view_id, offsets, expected):
                parts.append(part)
                yield a

        sent: list[list] = []
        replies = self.transport.run(vp.APPLY, args(), sent)
        if not sent:
            return ApplyResult()
        plan = list(zip(parts, sent))
        self.check_refused(replies, view_id)
        return self.settle(plan, replies, view_id, offsets, expected)

    def plan(self, records: Iterable[tuple[str, BlockEvent]], view_id: str | None = None,
             offsets: Offsets | None = None,
             expected: Mapping[tuple[str, int], int | None] | None = None) -> list[tuple[list, list]]:
        """The ``kvbus_apply`` calls of a batch, (records, arguments) each, for a caller that sends
        them itself (with other shards' calls: sinks/view/sharded_store.py), then passes their replies to
        :meth:`check_refused` and :meth:`settle`; a batch of no records that stores ``offsets`` is
        one call of no events."""
        return list(self.packer.plan(records, view_id, offsets, expected))

    def check_refused(self, replies: Sequence[Any], view_id: str | None) -> None:
        """Raise what the replies of a batch say about the whole batch (:func:`view_protocol.refused`:
        :class:`ViewChanged`, ACL, Redis full); nothing of the batch is settled then."""
        vp.refused(replies, self.what, view_id, self.transport.server)

    def settle(self, plan: Sequence[tuple[list, list]], replies: Sequence[Any], view_id: str | None,
               offsets: Offsets | None, expected: Mapping[tuple[str, int], int | None] | None) -> ApplyResult:
        """The result of a batch's calls (:meth:`plan`) from their replies: a refused call's events are
        applied one call each (those still refused go to ``failed``); if the call that stores
        ``offsets`` was refused, they are stored on their own."""
        res = ApplyResult()
        for (part, args), reply in zip(plan, replies):
            if isinstance(reply, RETRYABLE):
                raise reply
            if isinstance(reply, Exception):
                self._apply_one_by_one(part, args, reply, res, view_id)
            else:
                res.add(vp.apply_result(reply))
        if offsets and replies and isinstance(replies[-1], Exception):  # the call that stores them was refused
            self.set_offsets(offsets, view_id, expected)
        return res

    def _apply_one_by_one(self, part, args, err: Exception, res: ApplyResult, view_id: str | None) -> None:
        """The events of a refused call, one call each, in order: those still refused go to ``failed``
        (for the dead-letter topic); Redis full or the view changed stop the batch
        (:class:`RedisFull`, :class:`ViewChanged`)."""
        if not vp.chain_broken(err):
            log.warning("apply refused for %d holders (%s): retrying event by event", args[1], err)
        for topic, ev in part:
            one = self.packer.one([(topic, ev)], view_id)
            try:
                res.add(vp.apply_result(self.transport.call(vp.APPLY, *one)))
            except redis.ResponseError as e:
                self.check_refused([e], view_id)
                res.failed.append((topic, ev, f"{type(e).__name__}: {e}"))

    def heartbeat(self, replica: str, dp_rank: int, ts: float) -> None:
        self.transport.call(vp.HEARTBEAT, self.prefix, replica, dp_rank, repr(ts))

    def expire_stale(self, max_age: float, now: float, batch: int = 64) -> list[str]:
        out: list[str] = []
        while True:
            names = self.transport.call(vp.EXPIRE, self.prefix, repr(now - max_age), repr(now), batch)
            out.extend(vp.text(n) for n in names)
            if len(names) < batch:
                return out

    def drop_holder(self, replica: str, dp_rank: int, now: float) -> int:
        return int(self.transport.call(vp.DROP, self.prefix, holder_key(replica, dp_rank), repr(now)))

    # -- the view's identity, offsets and recovery (sinks/rebuild.py, sinks/snapshot.py) ----------

    @staticmethod
    def _mine(shards: Iterable[int] | None) -> bool:
        """Whether ``shards`` (None: all) names this view's only shard, 0."""
        return shards is None or 0 in shards

    def view_id(self) -> str | None:
        """``P meta vid``; None: no view (never created, or lost: Redis restarted without persistence,
        FLUSHALL, a new server)."""
        v = self.r.hget(meta_key(self.prefix), "vid")
        return vp.text(v) if v is not None else None

    def set_view_id(self, view_id: str, shards: Iterable[int] | None = None) -> None:
        if self._mine(shards):
            self.r.hset(meta_key(self.prefix), mapping=vp.view_meta(view_id))

    def drop_view_id(self, view_id: str, why: str) -> bool:
        return bool(self.r.eval(vp.DROP_VID, *vp.drop_vid_args(self.prefix, view_id, time.time(), why)))

    def servers(self) -> list[tuple[str, redis.Redis]]:
        """(name, client) of the server the view is written to."""
        r = self.transport.server()
        kw = r.connection_pool.connection_kwargs
        return [(str(kw.get("path") or f"{kw.get('host', '?')}:{kw.get('port', '?')}"), r)]

    def reader(self) -> ViewClient:
        """A :class:`~kvbus.sinks.view.reader.ViewClient` of this view (or of this shard, as a view of its
        own) on the server it is written to."""
        return ViewClient(self.transport.server(), self.prefix)

    def lost_shards(self) -> LostShards | None:
        return None

    def shard(self, replica: str, dp_rank: int) -> int:
        return 0

    def offsets(self) -> dict[tuple[str, int], int]:
        """(topic, partition) -> next Kafka offset to apply, as stored with the applies (``P off``)."""
        return vp.parse_offsets(self.r.hgetall(vp.off_key(self.prefix)))

    def set_offsets(self, offsets: Offsets, view_id: str | None = None,
                    expected: Mapping[tuple[str, int], int | None] | None = None,
                    shards: Iterable[int] | None = None) -> None:
        """A ``kvbus_apply`` of no events, so it fails with :class:`ViewChanged` like an apply would."""
        if not offsets or not self._mine(shards):
            return
        try:
            self.transport.call(vp.APPLY, *vp.offsets_only(self.prefix, offsets, view_id, expected))
        except redis.ResponseError as e:
            self.check_refused([e], view_id)
            raise

    def checkpoint(self, partitions: Iterable[tuple[str, int]]) -> dict[tuple[str, int], int | None]:
        """(topic, partition) -> the offset stored (None: nothing)."""
        off = self.offsets()
        return {tp: off.get(tp) for tp in partitions}

    def advance(self, expected: Checkpoint, offsets: Offsets) -> Checkpoint:
        return {**expected, **offsets}

    def holds(self, expected: Checkpoint) -> bool:
        return self.checkpoint(expected) == expected

    def identity(self) -> tuple:
        """Redis's run id."""
        return (str(self.transport.server().info("server").get("run_id", "")),)

    def recorded_status(self) -> dict[str, str]:
        """``P status`` as written (:meth:`set_status`); {} for a view that never had one written."""
        return {vp.text(k): vp.text(v) for k, v in self.r.hgetall(status_key(self.prefix)).items()}

    def status(self) -> dict[str, str]:
        st = self.recorded_status()
        if st.get("state"):
            return st
        return view_status([st], [bool(self.r.exists(meta_key(self.prefix)))]).as_dict()

    def set_status(self, **fields: Any) -> None:
        """Replace ``P status`` with ``fields`` (values as strings), atomically."""
        self.r.eval("redis.call('DEL', KEYS[1]) return redis.call('HSET', KEYS[1], unpack(ARGV))", 1,
                    status_key(self.prefix), *(x for k, v in fields.items() for x in (k, str(v))))

    def wipe(self, keep: Sequence[str] = view_keys.KEPT_BY_WIPE,
             shards: Iterable[int] | None = None) -> int:
        """Delete every key of the view (SCAN + UNLINK) but ``P <keep>``; returns the keys deleted."""
        if not self._mine(shards):
            return 0
        self._names = HolderNames()  # hids are given anew
        pattern = re.sub(r"([*?\[\]\\])", r"\\\1", self.prefix) + "*"
        spared = {(self.prefix + k).encode() for k in keep}
        n = 0
        batch: list[bytes] = []
        for key in self.r.scan_iter(match=pattern, count=1000):
            if key not in spared:
                batch.append(key)
            if len(batch) >= 1000:
                n += self.r.unlink(*batch)
                batch = []
        if batch:
            n += self.r.unlink(*batch)
        return n

    def try_lock(self, name: str, token: str, ttl_ms: int) -> bool:
        return vp.take_lock(self.r, vp.lock_key(self.prefix, name), token, ttl_ms)

    def renew_lock(self, name: str, token: str, ttl_ms: int) -> bool:
        return vp.renew_lock(self.r, vp.lock_key(self.prefix, name), token, ttl_ms)

    def unlock(self, name: str, token: str) -> None:
        vp.free_lock(self.r, vp.lock_key(self.prefix, name), token)

    def holder_ids(self) -> dict[int, str]:
        """hid -> holder name "<replica>#<dp_rank>" of every holder the view knows."""
        return self._holders()

    def dump_holder(self, key: int) -> HolderDump:
        """One holder's state by its hid, read atomically (``kvbus_dump``)."""
        return vp.parse_dump(self.transport.call(vp.DUMP, self.prefix, key, readonly=True))

    def restore_holder(self, replica: str, dp_rank: int, state: HolderDump, max_hashes: int = 16384) -> int:
        """``kvbus_restore``, in calls of at most ``max_hashes`` hashes per tier piece."""
        return sum(int(self.transport.call(vp.RESTORE, *args))
                   for args in vp.restore_calls(self.prefix, replica, dp_rank, state, max_hashes))

    # -- inspection: no interface has these; the tests and benchmarks compare the view with their
    # oracle through them, in the store's own terms (holder names, tier descriptors)

    def lookup(
        self,
        chain: Sequence[bytes],
        *,
        weights: Weights | None = None,
        candidates: Sequence[str] | None = None,
        model: str | None = None,
    ) -> dict[str, HolderMatch]:
        """One FCALL_RO (works on replicas and for read-only ACL users). Holder names come from a
        client-side cache of the holder table (:class:`kvbus.schemas.lookup.HolderNames`), read again
        when a reply names an unknown holder id or the cache is older than ``NAMES_TTL`` seconds."""
        if not chain:
            return {}
        spec = (weights or DEFAULT_WEIGHTS).spec()
        args = lookup_args(self.prefix, chain, spec, candidates or (), option_args(model=model))
        reply = self.transport.call(LOOKUP_FUNCTION, *args, readonly=True)
        return {m.name: m for m in self._names.answer([reply], lambda: [self._holders()])}

    def _holders(self) -> dict[int, str]:
        return parse_hname(self.r.hgetall(hname_key(self.prefix)))

    def _tier_names(self) -> dict[int, str]:
        return {int(k): vp.text(v) for k, v in self.r.hgetall(vp.tname_key(self.prefix)).items()}

    def _holder_state(self, hid: int) -> dict[str, bytes]:
        """Holder state fields (p:<topic>, t:<code>, f) -> binary values (kvbus.lua: POS, TSTATE, FLOOR)."""
        return {vp.text(k): v for k, v in self.r.hgetall(vp.holder_state_key(self.prefix, hid)).items()}

    def positions(self) -> dict[tuple[str, str], tuple[int, int, int]]:
        out = {}
        for hid, name in self._holders().items():
            for f, v in self._holder_state(hid).items():
                if f.startswith("p:"):
                    e, s, i = (int(x) for x in vp.STATE_POS.unpack(v))
                    out[(name, f[2:])] = (e, s, i)
        return out

    def models(self) -> dict[str, str]:
        """From ``P mh`` (model -> the hids of its live holders)."""
        names = self._holders()
        return {names[int(hid)]: vp.text(model) for model, hids in self.r.hgetall(vp.models_key(self.prefix)).items()
                for hid in hids.split()}

    def _tiers_of(self, hid: int) -> dict[int, tuple[int, int, int]]:
        """tier code -> (entries, L, S of its index) of one holder."""
        out = {}
        for f, v in self._holder_state(hid).items():
            if f.startswith("t:"):
                n, L, S = view_keys.STATE_TIER.unpack_from(v)
                out[int(f[2:])] = (int(n), L, S)
        return out

    def holder_blocks(self, hid: int, code: int) -> dict[bytes, int]:
        """Blocks of one (holder, tier) from its index, with reference counts."""
        n, L, S = self._tiers_of(hid).get(code, (0, 0, 0))
        pipe = self.r.pipeline(transaction=False)
        for b in range(2**L + S):
            pipe.get(vp.index_key(self.prefix, hid, code, b))
        blocks = {raw: 1 for log in pipe.execute() for raw in vp.index_live(log or b"")}
        for raw, extra in self.r.hgetall(vp.refcount_key(self.prefix, hid, code)).items():
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
        meta = self.r.hgetall(meta_key(self.prefix))
        holders, tnames = self._holders(), self._tier_names()
        out: dict[bytes, set[tuple[str, str]]] = {}

        def add(raw: bytes, m: int) -> None:
            out.setdefault(raw, set()).add((holders[m // 64], label(tnames[m % 64])))

        for b in range(view_keys.block_buckets(meta)):
            for raw, v in self.r.hgetall(vp.block_key(self.prefix, b)).items():
                if v == b"":
                    v = self.r.get(vp.wide_key(self.prefix, raw))
                members = [int.from_bytes(v[j:j + 3], "big") for j in range(0, len(v), 3)]
                assert members == sorted(set(members)), f"member string of {raw.hex()} is not sorted"
                for m in members:
                    add(raw, m)
        return out




