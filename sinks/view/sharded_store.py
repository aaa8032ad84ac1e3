"""``ShardedRedisStore``: the residency view spread over the masters of a Redis Cluster.

Layout (docs/sinks-layout.md, "Redis Cluster"): ``S`` virtual shards (default 16), shard ``i`` a
complete single-node view of its holders under the prefix ``P{s<i>}:`` (the ``{s<i>}`` hash tag puts
all of a shard's keys in one slot); a holder's shard is ``crc32("<replica>#<dp>") % S``. Every
function call declares ``P{s<i>}:meta`` and ``P{s<i>}:guard`` (a key never written): Redis Cluster
routes the call to the shard's master, and while the shard's slot is being migrated it refuses the
call (TRYAGAIN) instead of running it on half-moved keys; this store retries it (a slot migration
costs a retry, never an error or a lost event). Shards are moved between masters by Redis Cluster's
own slot migration (``redis-cli --cluster reshard`` / ``rebalance``).

* ``apply``: each record goes to its holder's shard; every shard's calls of a batch are sent in one
  round trip, pipelined per master, all masters at once; each holder's records stay in order.
* ``lookup``: one ``FCALL_RO kvbus_lookup`` per shard, pipelined per master and concurrent across
  masters; holders are disjoint across shards, so the answer is the union of the shards' answers,
  and it waits for every shard (a holder's prefix is never cut short by a late shard).
* view id and offsets (Recovery): each shard is a view with its own ``P{s<i>}:meta vid`` and
  ``P{s<i>}:off``; see :meth:`ShardedRedisStore.apply` for what a sink must do.

* reads from replicas (``read_from="replica"``, URL ``?read_from=replica``): lookups go to each
  shard's replica (``READONLY`` connections), except for shards whose slot a master reports migrating
  or importing (checked every :data:`MIGRATION_CHECK` s): those go to their master, which refuses them
  until the migration ends (a replica has no migration state and would answer from a half-moved
  shard); writes always go to masters. A replica answers from a state between two of its master's function calls
  (a call's effects replicate as one transaction), so an answer is never cut short mid-write, but it
  lags by the replication delay, and a migration that starts between two checks may be read from a
  half-moved shard for up to :data:`MIGRATION_CHECK` s (docs/sinks-layout.md).

The store is routing plus one :class:`~kvbus.sinks.view.redis_store.RedisStore` per shard (``shards``), each
sending its calls through :class:`~kvbus.sinks.view.transport.ShardTransport`; a batch's calls of every
shard are planned by the shards and sent here in one round trip.

``KVBUS_REDIS_URL`` names a cluster by its seed nodes: ``redis+cluster://h:p[,h:p...][/0][?shards=S][&read_from=replica]``
(:func:`kvbus.sinks.view.store_url.open_store` picks this store for such a URL).
"""
from __future__ import annotations

import logging
from collections import defaultdict
from typing import Any, Iterable, Mapping, Sequence

import redis
from redis.cluster import ClusterNode, RedisCluster

from kvbus.schemas import view_keys
from kvbus.schemas.events import BlockEvent, holder_key
from kvbus.schemas.lookup import (
    DEFAULT_PREFIX,
    LOOKUP_FUNCTION,
    SHARDS_FIELD,
    HolderMatch,
    HolderNames,
    declared_keys,
    hname_key,
    lookup_args,
    meta_key,
    option_args,
    parse_hname,
    shard_of,
    shard_prefix,
    view_status,
)
from kvbus.sinks.view import functions, protocol as vp
from kvbus.sinks.view.cluster import DEFAULT_SHARDS, MIGRATION_CHECK, RETRY_FOR, ShardCalls, cluster_client
from kvbus.sinks.view.reader import ViewClient
from kvbus.sinks.view.redis_store import DEFAULT_WEIGHTS, RedisStore
from kvbus.sinks.view.refcounts import DEFAULT_POLICY, TierPolicy, Weights
from kvbus.sinks.view.store import (
    ApplyResult,
    Checkpoint,
    HolderDump,
    LostShards,
    Offsets,
    ResidencyStore,
    Snapshot,
)
from kvbus.sinks.view.transport import ShardTransport

log = logging.getLogger("kvbus.sinks")


class ShardedRedisStore(ResidencyStore):
    """The view over ``shards`` virtual shards on a Redis Cluster (module docstring).

    ``client``: a ``RedisCluster`` (bytes replies) or a ``redis+cluster://`` URL. ``load``: check
    every master's version and load the function library on each (a lookup client passes False).
    ``read_from``: where lookups are read (:data:`kvbus.sinks.view.cluster.READ_FROM`; ``replica``
    needs a client whose connections send READONLY: :func:`cluster_client` with ``?read_from=replica``);
    ``migration_check``: seconds between two checks of which shards are migrating, when reading
    from replicas. ``store_kw``: more arguments of each shard's :class:`RedisStore` (per-call limits).
    """

    def __init__(self, client: RedisCluster | str, prefix: str = DEFAULT_PREFIX,
                 policy: TierPolicy = DEFAULT_POLICY, *, shards: int = DEFAULT_SHARDS, load: bool = True,
                 retry_for: float = RETRY_FOR, read_from: str = "primary", migration_check: float = MIGRATION_CHECK,
                 **store_kw: Any):
        self.rc = cluster_client(client) if isinstance(client, str) else client
        self.prefix = prefix
        self.policy = policy
        self.nshards = shards
        self.calls = ShardCalls(self.rc, [declared_keys(shard_prefix(prefix, i)) for i in range(shards)],
                                read_from=read_from, migration_check=migration_check, retry_for=retry_for,
                                reload=lambda: self.load_library(replace=True))
        """Every shard's function calls: routing, one round trip, retries (kvbus.sinks.view.cluster)."""
        self.shards = [RedisStore(self.rc, shard_prefix(prefix, i), policy, load=False,
                                  transport=ShardTransport(self.calls, i),
                                  what=f"shard {i} of the view under {prefix!r}", **store_kw)
                       for i in range(shards)]
        """Shard ``i``: a complete view of its holders under ``P{s<i>}:``."""
        self._shard_of: dict[tuple[str, int], int] = {}
        self._names = HolderNames()
        if load:
            self.load_library()
            self._check_shards()

    # -- plumbing ---------------------------------------------------------------

    def load_library(self, replace: bool = False) -> None:
        """Check the version of, and load the library on, every master (replicas copy it)."""
        for node in self.rc.get_primaries():
            r = node.redis_connection
            functions.check_server(r)
            if replace:
                functions.load_library(r)
            else:
                functions.ensure_library(r)

    def _check_shards(self) -> None:
        """The shard count is part of the view: refuse to write a view made with another one."""
        key = meta_key(self.shards[0].prefix)
        self.rc.hsetnx(key, SHARDS_FIELD, self.nshards)
        have = int(self.rc.hget(key, SHARDS_FIELD))
        if have != self.nshards:
            raise ValueError(f"the view under {self.prefix!r} has {have} shards, not {self.nshards}")

    def shard(self, replica: str, dp_rank: int) -> int:
        """Shard index of holder (replica, dp_rank)."""
        k = (replica, dp_rank)
        s = self._shard_of.get(k)
        if s is None:
            s = self._shard_of[k] = shard_of(holder_key(replica, dp_rank), self.nshards)
        return s

    @property
    def read_from(self) -> str:
        """Where lookups are read (:data:`kvbus.sinks.view.cluster.READ_FROM`)."""
        return self.calls.read_from

    @property
    def retry_for(self) -> float:
        """Seconds a refused call is retried."""
        return self.calls.retry_for

    @property
    def migration_check(self) -> float:
        """Seconds between two checks of which shards are migrating, when reading from replicas."""
        return self.calls.migration_check

    @migration_check.setter
    def migration_check(self, value: float) -> None:
        self.calls.migration_check = value

    @property
    def retries(self) -> int:
        """Calls sent again after TRYAGAIN / ASK / MOVED / CLUSTERDOWN / a lost connection."""
        return self.calls.retries

    def node(self, s: int, read: bool = False) -> ClusterNode:
        """The node a call of shard ``s`` goes to now (:meth:`ShardCalls.node`): its master, or for a
        ``read`` when reading from replicas, its replica."""
        return self.calls.node(s, read)

    def migrating_shards(self) -> set[int]:
        """Shards whose slot is being migrated now (:meth:`ShardCalls.migrating`)."""
        return self.calls.migrating()

    def _execute(self, calls: Sequence[tuple[int, str, list]], ordered: bool = True) -> list:
        return self.calls.execute(calls, ordered=ordered)

    # -- writes ---------------------------------------------------------------

    def apply(self, records: Iterable[tuple[str, BlockEvent]], *, view_id: str | None = None,
              offsets: Offsets | None = None, expected: Checkpoint | None = None) -> ApplyResult:
        """Apply records: each to its holder's shard, planned by that shard (:meth:`RedisStore.plan`),
        every shard's calls sent in one round trip (:class:`ShardCalls`).

        ``view_id``: each shard checks it against its own id; ``offsets`` are stored in **every** shard with
        the batch (a shard with no record in the batch gets an offsets-only call in the same round
        trip), so all shards normally hold the same offsets; ``expected``: the :meth:`checkpoint`
        (what each shard holds; shards differ after one of them rolled back), or one mapping for all
        shards. A shard that rolled back (its master failed over to a lagging replica) fails with
        :class:`~kvbus.sinks.view.store.ViewChanged`; the sink then resumes each partition from
        :meth:`offsets` (the minimum over shards: the stored positions make the replay harmless to
        the shards that were ahead) with ``expected`` = :meth:`checkpoint`.
        """
        groups: dict[int, list[tuple[str, BlockEvent]]] = defaultdict(list)
        for rec in records:
            ev = rec[1]
            groups[self.shard(ev.replica, ev.dp_rank)].append(rec)
        exp = self._expected_per_shard(expected)
        targets = range(self.nshards) if offsets else sorted(groups)
        plans = {s: self.shards[s].plan(groups.get(s, ()), view_id, offsets, exp[s]) for s in targets}
        calls = [(s, vp.APPLY, args) for s, plan in plans.items() for _, args in plan]
        if not calls:
            return ApplyResult()
        replies = self._execute(calls)
        per: dict[int, list] = defaultdict(list)
        for (s, _, _), reply in zip(calls, replies):
            per[s].append(reply)
        for s in plans:  # a view changed anywhere stops the batch before any shard settles
            self.shards[s].check_refused(per[s], view_id)
        res = ApplyResult()
        for s, plan in plans.items():
            res.add(self.shards[s].settle(plan, per[s], view_id, offsets, exp[s]))
        return res

    def _expected_per_shard(self, expected) -> list:
        if expected is None or isinstance(expected, Mapping):
            return [expected] * self.nshards
        exp = list(expected)
        if len(exp) != self.nshards:
            raise ValueError(f"expected: {len(exp)} mappings for {self.nshards} shards")
        return exp

    def _targets(self, shards: Iterable[int] | None) -> Iterable[int]:
        return range(self.nshards) if shards is None else shards

    def set_offsets(self, offsets: Offsets, view_id: str | None = None, expected: Checkpoint | None = None,
                    shards: Iterable[int] | None = None) -> None:
        """Store offsets in every shard (or in ``shards``) without events, in one round trip."""
        if not offsets:
            return
        exp = self._expected_per_shard(expected)
        calls = [(s, vp.APPLY, vp.offsets_only(self.shards[s].prefix, offsets, view_id, exp[s]))
                 for s in self._targets(shards)]
        for (s, _, _), reply in zip(calls, self._execute(calls)):
            self.shards[s].check_refused([reply], view_id)
            if isinstance(reply, Exception):
                raise reply

    def heartbeat(self, replica: str, dp_rank: int, ts: float) -> None:
        self.shards[self.shard(replica, dp_rank)].heartbeat(replica, dp_rank, ts)

    def expire_stale(self, max_age: float, now: float, batch: int = 64) -> list[str]:
        """Every shard's expiry calls at once, again for those that had more."""
        out: list[str] = []
        todo = list(range(self.nshards))
        while todo:
            calls = [(s, vp.EXPIRE, [self.shards[s].prefix, repr(now - max_age), repr(now), batch]) for s in todo]
            nxt = []
            for (s, _, _), names in zip(calls, self._execute(calls, ordered=False)):
                if isinstance(names, Exception):
                    raise names
                out.extend(vp.text(n) for n in names)
                if len(names) >= batch:
                    nxt.append(s)
            todo = nxt
        return out

    def drop_holder(self, replica: str, dp_rank: int, now: float) -> int:
        return self.shards[self.shard(replica, dp_rank)].drop_holder(replica, dp_rank, now)

    # -- the view's identity, offsets and recovery ------------------------------

    def view_ids(self) -> list[str | None]:
        """Each shard's view id (None: that shard has no view: lost or never created)."""
        return [st.view_id() for st in self.shards]

    def view_id(self) -> str | None:
        """The view's id if every shard has the same one, else None (a shard lost or rebuilt apart)."""
        ids = set(self.view_ids())
        return ids.pop() if len(ids) == 1 else None

    def set_view_id(self, view_id: str, shards: Iterable[int] | None = None) -> None:
        for s in self._targets(shards):
            self.shards[s].set_view_id(view_id)

    def drop_view_id(self, view_id: str, why: str) -> bool:
        """In every shard that still has ``view_id``: the whole view is rebuilt (sinks/rebuild.py)."""
        return sum(st.drop_view_id(view_id, why) for st in self.shards) > 0

    def servers(self) -> list[tuple[str, redis.Redis]]:
        """(name, client) of every master (the servers the view is written to)."""
        return [(node.name, node.redis_connection) for node in self.rc.get_primaries()]

    def reader(self) -> ViewClient:
        """A :class:`~kvbus.sinks.view.reader.ViewClient` of the sharded view, on this store's cluster client."""
        return ViewClient(self.rc, self.prefix, shards=self.nshards)

    def lost_shards(self) -> LostShards | None:
        """Some shards lost the view (their master failed over to a replica without the data, or both
        lost it) while every other shard has the same id: those shards alone are rebuilt."""
        ids = self.view_ids()
        kept = {i for i in ids if i is not None}
        if len(kept) != 1 or None not in ids:
            return None
        return LostShards(kept.pop(), [s for s, i in enumerate(ids) if i is None])

    def shard_offsets(self) -> list[dict[tuple[str, int], int]]:
        """``P{s<i>}:off`` of each shard."""
        return [st.offsets() for st in self.shards]

    def offsets(self) -> dict[tuple[str, int], int]:
        """The minimum over shards of the offsets they store (a partition some shard has no offset for
        is left out: that shard has nothing of it)."""
        per = self.shard_offsets()
        common = set(per[0]).intersection(*per[1:]) if per else set()
        return {k: min(p[k] for p in per) for k in sorted(common)}

    def status(self) -> dict[str, str]:
        """A shard rebuilding makes the view rebuilding; no shard with a view: missing."""
        sts = [st.recorded_status() for st in self.shards]
        if any(st.get("state") for st in sts):
            return view_status(sts, ()).as_dict()
        pipe = self.rc.pipeline()
        for st in self.shards:
            pipe.exists(meta_key(st.prefix))
        return view_status(sts, pipe.execute()).as_dict()

    def checkpoint(self, partitions: Iterable[tuple[str, int]]) -> list[dict[tuple[str, int], int | None]]:
        """What each shard stores for ``partitions`` (a list: shards may differ after one rolled back)."""
        parts = list(partitions)
        return [st.checkpoint(parts) for st in self.shards]

    def advance(self, expected: Checkpoint, offsets: Offsets) -> Checkpoint:
        """Every shard stored ``offsets``."""
        return [{**e, **offsets} for e in self._expected_per_shard(expected)]

    def holds(self, expected: Checkpoint) -> bool:
        exp = self._expected_per_shard(expected)
        return self.checkpoint(exp[0] or ()) == exp

    def identity(self) -> tuple:
        """The masters' run ids: changes when one restarts or fails over."""
        return tuple(sorted(str(n.redis_connection.info("server").get("run_id", "")) for n in self.rc.get_primaries()))

    def set_status(self, **fields: Any) -> None:
        """Into every shard (routers read any of them: :meth:`status`)."""
        for st in self.shards:
            st.set_status(**fields)

    def wipe(self, keep: Sequence[str] = view_keys.KEPT_BY_WIPE,
             shards: Iterable[int] | None = None) -> int:
        """Every shard's (or ``shards``') keys but ``<shard prefix><keep>``; the shard count is written
        again (it belongs to the view, not to its contents)."""
        n = sum(self.shards[s].wipe(keep) for s in self._targets(shards))
        self._names = HolderNames()  # the wiped shards' hids are given anew
        self._check_shards()
        return n

    def try_lock(self, name: str, token: str, ttl_ms: int) -> bool:
        return vp.take_lock(self.rc, vp.lock_key(self.prefix, name), token, ttl_ms)

    def renew_lock(self, name: str, token: str, ttl_ms: int) -> bool:
        return vp.renew_lock(self.rc, vp.lock_key(self.prefix, name), token, ttl_ms)

    def unlock(self, name: str, token: str) -> None:
        vp.free_lock(self.rc, vp.lock_key(self.prefix, name), token)

    def holder_ids(self) -> dict[int, str]:
        """Holder key -> name over all shards; the key is ``shard << 32 | hid`` (hids are per shard)."""
        return {(s << 32) | hid: name for s, st in enumerate(self.shards) for hid, name in st.holder_ids().items()}

    def dump_holder(self, key: int) -> HolderDump:
        """By its key from :meth:`holder_ids`."""
        return self.shards[key >> 32].dump_holder(key & 0xFFFFFFFF)

    def restore_holder(self, replica: str, dp_rank: int, state: HolderDump, max_hashes: int = 16384) -> int:
        """Into its shard."""
        return self.shards[self.shard(replica, dp_rank)].restore_holder(replica, dp_rank, state, max_hashes)

    # -- inspection: no interface has these; the tests and benchmarks compare the view with their
    # oracle through them, in the store's own terms (holder names, tier descriptors)

    def lookup(self, chain: Sequence[bytes], *, weights: Weights | None = None,
               candidates: Sequence[str] | None = None, model: str | None = None) -> dict[str, HolderMatch]:
        """One ``FCALL_RO kvbus_lookup`` per shard, pipelined per master, all masters at once; the
        union of the answers (holders are disjoint across shards). Holder names: a client-side cache
        of every shard's holder table (display names need the replica's dp ranks over all shards)."""
        if not chain:
            return {}
        spec = (weights or DEFAULT_WEIGHTS).spec()
        cands, opts = list(candidates or ()), option_args(model=model)
        calls = [(s, LOOKUP_FUNCTION, lookup_args(st.prefix, chain, spec, cands, opts))
                 for s, st in enumerate(self.shards)]
        replies = self._execute(calls, ordered=False)
        for r in replies:
            if isinstance(r, Exception):
                raise r
        return {m.name: m for m in self._names.answer(replies, self._hnames)}

    def _hnames(self) -> list[dict[int, str]]:
        """Per shard: hid -> holder name."""
        pipe = self.rc.pipeline()
        for st in self.shards:
            pipe.hgetall(hname_key(st.prefix))
        return [parse_hname(d) for d in pipe.execute()]

    def positions(self) -> dict[tuple[str, str], tuple[int, int, int]]:
        out: dict = {}
        for st in self.shards:
            out.update(st.positions())
        return out

    def models(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for st in self.shards:
            out.update(st.models())
        return out

    def snapshot(self) -> Snapshot:
        out: Snapshot = {}
        for st in self.shards:
            out.update(st.snapshot())
        return out

    def commandstats(self) -> dict[str, dict[str, dict[str, float]]]:
        """``INFO commandstats`` of every master: node -> command -> {calls, usec, usec_per_call}."""
        out = {}
        for node in self.rc.get_primaries():
            info = node.redis_connection.info("commandstats")
            out[node.name] = {k.removeprefix("cmdstat_"): v for k, v in info.items()}
        return out
