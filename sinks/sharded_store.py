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

``KVBUS_REDIS_URL`` names a cluster by its seed nodes: ``redis+cluster://h:p[,h:p...][/0][?shards=S][&read_from=replica]``
(:func:`open_store` picks this store for such a URL, :class:`~kvbus.sinks.redis_store.RedisStore` otherwise).
"""
from __future__ import annotations

import logging
import time
import zlib
from collections import defaultdict
from typing import Any, Iterable, Mapping, Sequence

import redis
from redis.cluster import ClusterNode, RedisCluster

from kvbus.schemas.events import BlockEvent, holder_key
from kvbus.schemas.lookup import (
    LOOKUP_FUNCTION,
    HolderNames,
    lookup_args,
    parse_hname,
    shard_prefix,
    status_key,
    view_status,
)
from kvbus.schemas.redis_view import (  # noqa: F401  (re-exported: the sinks' names for them)
    CLUSTER_SCHEMES,
    DEFAULT_SHARDS,
    MIGRATION_CHECK,
    READ_FROM,
    RETRY_FOR,
    RETRYABLE,
    ShardCalls,
    cluster_client,
    is_cluster_url,
    parse_cluster_url,
    read_from,
    url_shards,
)
from kvbus.sinks import functions
from kvbus.sinks.redis_store import (
    DEFAULT_PREFIX,
    DEFAULT_WEIGHTS,
    DROP_VID,
    Offsets,
    RedisStore,
    ViewChanged,  # noqa: F401  (raised by refused; the sinks' name for it)
    _offsets_arg,
    _with_extra,
    refused,
)
from kvbus.sinks.refcounts import DEFAULT_POLICY, TierPolicy, Weights, label
from kvbus.sinks.store import ApplyResult, HolderMatch, ResidencyStore, Snapshot, summary_from_counts

log = logging.getLogger("kvbus.sinks")


def open_store(url: str, prefix: str = DEFAULT_PREFIX, policy: TierPolicy = DEFAULT_POLICY, *,
               load: bool = True, client_kwargs: Mapping[str, Any] | None = None) -> "RedisStore | ShardedRedisStore":
    """The view at ``url``: :class:`ShardedRedisStore` for a ``redis+cluster://`` URL (its
    ``?shards=`` or :data:`DEFAULT_SHARDS`), else :class:`RedisStore`. ``client_kwargs``: more
    redis-py client arguments (credentials, TLS CA: ``Settings.redis_kwargs()``)."""
    kw = dict(client_kwargs or {})
    if not is_cluster_url(url):
        return RedisStore(redis.Redis.from_url(url, **kw), prefix, policy, load=load)
    _, params = parse_cluster_url(url)
    return ShardedRedisStore(cluster_client(url, **kw), prefix, policy, shards=url_shards(params),
                             load=load, read_from=read_from(params))


def shard_of(holder: str, shards: int) -> int:
    """The shard of holder ``"<replica>#<dp>"``: crc32 of its name mod ``shards`` (stable across
    processes and languages: zlib's CRC-32, as in Java's ``java.util.zip.CRC32``)."""
    return zlib.crc32(holder.encode()) % shards


class ShardedRedisStore(ResidencyStore):
    """The view over ``shards`` virtual shards on a Redis Cluster (module docstring).

    ``client``: a ``RedisCluster`` (bytes replies) or a ``redis+cluster://`` URL. ``load``: check
    every master's version and load the function library on each (a lookup client passes False).
    ``read_from``: where lookups are read (:data:`READ_FROM`; ``replica`` needs a client whose
    connections send READONLY: :func:`cluster_client` with ``?read_from=replica``);
    ``migration_check``: seconds between two checks of which shards are migrating, when reading
    from replicas.
    """

    def __init__(self, client: RedisCluster | str, prefix: str = DEFAULT_PREFIX,
                 policy: TierPolicy = DEFAULT_POLICY, *, shards: int = DEFAULT_SHARDS, load: bool = True,
                 retry_for: float = RETRY_FOR, read_from: str = "primary", migration_check: float = MIGRATION_CHECK,
                 **store_kw: Any):
        self.rc = cluster_client(client) if isinstance(client, str) else client
        self.r = self.rc  # what RedisStore callers read plain keys through (kvbus.sinks.rebuild.view_status)
        self.prefix = prefix
        self.policy = policy
        self.nshards = shards
        self.shards = [RedisStore(self.rc, shard_prefix(prefix, i), policy, load=False, declare_keys=True, **store_kw)
                       for i in range(shards)]
        self.calls = ShardCalls(self.rc, [st.fkeys for st in self.shards], read_from=read_from,
                                migration_check=migration_check, retry_for=retry_for,
                                reload=lambda: self.load_library(replace=True))
        """Every shard's function calls: routing, one round trip, retries (kvbus.schemas.redis_view)."""
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
        key = self.shards[0].prefix + "meta"
        self.rc.hsetnx(key, "shards", self.nshards)
        have = int(self.rc.hget(key, "shards"))
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
        """Where lookups are read (:data:`READ_FROM`)."""
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

    def _node(self, s: int, read: bool = False) -> ClusterNode:
        """The node a call of shard ``s`` goes to (:meth:`ShardCalls.node`)."""
        return self.calls.node(s, read)

    def migrating_shards(self) -> set[int]:
        """Shards whose slot some master reports migrating or importing (:meth:`ShardCalls.migrating`)."""
        return self.calls.migrating()

    def _execute(self, calls: list[tuple[int, str, list]], *, ordered: bool = True) -> list:
        """Run ``calls`` ((shard, function, args)) in one round trip, retried (:meth:`ShardCalls.execute`)."""
        return self.calls.execute(calls, ordered=ordered)

    # -- writes ---------------------------------------------------------------

    def apply(self, records: Iterable[tuple[str, BlockEvent]], *, view_id: str | None = None,
              offsets: Offsets | None = None,
              expected: (Mapping[tuple[str, int], int | None]
                         | Sequence[Mapping[tuple[str, int], int | None] | None] | None) = None,
              ) -> ApplyResult:
        """Apply records, each to its holder's shard, all shards in one round trip.

        Recovery (what a sink does; docs/sinks-layout.md "Recovery", per shard): ``view_id`` is
        checked by every call against its shard's id; ``offsets`` are stored in **every** shard with
        the batch (a shard with no record in the batch gets an offsets-only call in the same round
        trip), so all shards normally hold the same offsets; ``expected``: what the caller knows each
        shard holds — one mapping for all shards, or a list of one per shard (after a resync that
        found shards at different offsets). A shard that rolled back (its master failed over to a
        lagging replica) fails with :class:`ViewChanged`; the sink then resumes each partition from
        :meth:`offsets` (the minimum over shards: the stored positions make the replay harmless to
        the shards that were ahead) with ``expected`` = :meth:`shard_offsets`.
        """
        groups: dict[int, list[tuple[str, BlockEvent]]] = defaultdict(list)
        for rec in records:
            ev = rec[1]
            groups[self.shard(ev.replica, ev.dp_rank)].append(rec)
        exp = self._expected_per_shard(expected)
        calls: list[tuple[int, str, list]] = []
        parts: list[list] = []
        targets = range(self.nshards) if offsets else sorted(groups)
        for s in targets:
            st = self.shards[s]
            if s in groups:
                for part, args in _with_extra(st._iter_calls(groups[s]), view_id, offsets, exp[s]):
                    calls.append((s, "kvbus_apply", args))
                    parts.append(part)
            else:
                calls.append((s, "kvbus_apply", self._offsets_call(s, offsets, view_id, exp[s])))
                parts.append([])
        res = ApplyResult()
        if not calls:
            return res
        replies = self._execute(calls)
        for s in sorted(set(c[0] for c in calls)):
            refused([x for (t, _, _), x in zip(calls, replies) if t == s],
                    f"shard {s} of the view under {self.prefix!r}", view_id,
                    lambda: self._node(s).redis_connection)
        last_of = {s: j for j, (s, _, _) in enumerate(calls)}
        for j, ((s, _, args), part, reply) in enumerate(zip(calls, parts, replies)):
            if isinstance(reply, RETRYABLE):
                raise reply
            if isinstance(reply, Exception):
                st = self.shards[s]
                st._apply_one_by_one(part, args, reply, res, view_id)
                if offsets and last_of[s] == j:  # the call that stores them was refused
                    st.set_offsets(offsets, view_id, exp[s])
            else:
                RedisStore._add_reply(res, reply)
        return res

    def _expected_per_shard(self, expected) -> list:
        if expected is None or isinstance(expected, Mapping):
            return [expected] * self.nshards
        exp = list(expected)
        if len(exp) != self.nshards:
            raise ValueError(f"expected: {len(exp)} mappings for {self.nshards} shards")
        return exp

    def _offsets_call(self, s: int, offsets: Offsets, view_id: str | None, expected) -> list:
        want = {k: expected.get(k) for k in offsets} if expected is not None else None
        return [self.shards[s].prefix, 0, 0, 0, b"", view_id or "", _offsets_arg(want, offsets)]

    def set_offsets(self, offsets: Offsets, view_id: str | None = None, expected=None,
                    shards: Iterable[int] | None = None) -> None:
        """Store offsets in every shard (or in ``shards``) without events (one round trip);
        :class:`ViewChanged` like apply."""
        if not offsets:
            return
        exp = self._expected_per_shard(expected)
        calls = [(s, "kvbus_apply", self._offsets_call(s, offsets, view_id, exp[s]))
                 for s in (range(self.nshards) if shards is None else shards)]
        for (s, _, _), reply in zip(calls, self._execute(calls)):
            refused([reply], f"shard {s} of the view under {self.prefix!r}", view_id,
                    lambda: self._node(s).redis_connection)
            if isinstance(reply, Exception):
                raise reply

    def view_ids(self) -> list[str | None]:
        """Each shard's view id (None: that shard has no view: lost or never created)."""
        return [st.view_id() for st in self.shards]

    def view_id(self) -> str | None:
        """The view's id if every shard has the same one, else None (a shard lost or rebuilt apart)."""
        ids = set(self.view_ids())
        return ids.pop() if len(ids) == 1 else None

    def set_view_id(self, view_id: str, shards: Iterable[int] | None = None) -> None:
        """Mark every shard (or ``shards``) as view ``view_id``."""
        for s in range(self.nshards) if shards is None else shards:
            self.shards[s].set_view_id(view_id)

    def drop_view_id(self, view_id: str, why: str) -> bool:
        """Forget the view's id, and mark it ``rebuilding`` (phase ``why``), in every shard that still
        has ``view_id``: the whole view is rebuilt (sinks/rebuild.py). False: no shard had it any more."""
        now = repr(time.time())
        return sum(int(self.rc.eval(DROP_VID, 2, st.prefix + "meta", status_key(st.prefix), view_id, now, why))
                   for st in self.shards) > 0

    def servers(self) -> list[tuple[str, redis.Redis]]:
        """(name, client) of every master (the servers the view is written to)."""
        return [(node.name, node.redis_connection) for node in self.rc.get_primaries()]

    def lost_shards(self) -> tuple[str, list[int]] | None:
        """(the view id the other shards keep, the shards without one) when some shards lost the view
        (their master failed over to a replica without the data, or both lost it) while every other
        shard has the same id: those shards alone are rebuilt (sinks/rebuild.py). None when no shard
        lost it, or when no shard kept it, or the kept ids differ (then the whole view is rebuilt)."""
        ids = self.view_ids()
        kept = {i for i in ids if i is not None}
        if len(kept) != 1 or None not in ids:
            return None
        return kept.pop(), [s for s, i in enumerate(ids) if i is None]

    def shard_offsets(self) -> list[dict[tuple[str, int], int]]:
        """``P{s<i>}:off`` of each shard."""
        return [st.offsets() for st in self.shards]

    def offsets(self) -> dict[tuple[str, int], int]:
        """Where a sink resumes each partition: the minimum over shards of the offsets they store (a
        partition some shard has no offset for is left out: that shard has nothing of it)."""
        per = self.shard_offsets()
        common = set(per[0]).intersection(*per[1:]) if per else set()
        return {k: min(p[k] for p in per) for k in sorted(common)}

    def status(self) -> dict[str, str]:
        """The view's status for routers (``kvbus.sinks.rebuild.view_status``): a shard rebuilding makes the
        view rebuilding; no shard with a view: missing."""
        sts = [st.status() for st in self.shards]
        if any(st.get("state") for st in sts):
            return view_status(sts, ()).as_dict()
        pipe = self.rc.pipeline()
        for st in self.shards:
            pipe.exists(st.prefix + "meta")
        return view_status(sts, pipe.execute()).as_dict()

    # -- recovery (sinks/consumer.py, sinks/rebuild.py, sinks/snapshot.py) -----------------

    def checkpoint(self, partitions: Iterable[tuple[str, int]]) -> list[dict[tuple[str, int], int | None]]:
        """What each shard stores for ``partitions``: the ``expected`` a sink passes to :meth:`apply`
        (shards may differ after one of them rolled back)."""
        parts = list(partitions)
        return [st.checkpoint(parts) for st in self.shards]

    @staticmethod
    def advance(expected: Any, offsets: Offsets) -> Any:
        """``expected`` after a batch that stored ``offsets`` (in every shard) was applied."""
        return [{**e, **offsets} for e in expected]

    def holds(self, expected: Any) -> bool:
        """Whether every shard still stores what ``expected`` says for it."""
        return self.checkpoint(expected[0] if expected else ()) == list(expected)

    def identity(self) -> tuple:
        """The masters' run ids: changes when one restarts or fails over."""
        return tuple(sorted(str(n.redis_connection.info("server").get("run_id", "")) for n in self.rc.get_primaries()))

    def set_status(self, **fields: Any) -> None:
        """Write the view's status into every shard (routers read any of them: :meth:`status`)."""
        for st in self.shards:
            self.rc.delete(st.prefix + "status")
            self.rc.hset(st.prefix + "status", mapping={k: str(v) for k, v in fields.items()})

    def wipe(self, keep: Sequence[str] = ("status", "lock"), shards: Iterable[int] | None = None) -> int:
        """Delete every shard's (or ``shards``') keys but ``<shard prefix><keep>`` (a rebuild starts
        from nothing); the shard count is written again (it belongs to the view, not to its contents)."""
        n = sum(self.shards[s].wipe(keep) for s in (range(self.nshards) if shards is None else shards))
        self._check_shards()
        return n

    def holder_ids(self) -> dict[int, str]:
        """Holder key -> name over all shards; the key is ``shard << 32 | hid`` (hids are per shard)."""
        return {(s << 32) | hid: name for s, st in enumerate(self.shards) for hid, name in st.holder_ids().items()}

    def dump_holder(self, key: int) -> Any:
        """One holder's state (:meth:`RedisStore.dump_holder`), by its key from :meth:`holder_ids`."""
        return self.shards[key >> 32].dump_holder(key & 0xFFFFFFFF)

    def restore_holder(self, replica: str, dp_rank: int, state: Any, max_hashes: int = 16384) -> int:
        """Write one holder from a snapshot into its shard (:meth:`RedisStore.restore_holder`)."""
        return self.shards[self.shard(replica, dp_rank)].restore_holder(replica, dp_rank, state, max_hashes)

    def heartbeat(self, replica: str, dp_rank: int, ts: float) -> None:
        self._one(self.shard(replica, dp_rank), "kvbus_heartbeat", replica, dp_rank, repr(ts))

    def _one(self, s: int, name: str, *args: Any) -> Any:
        reply = self._execute([(s, name, [self.shards[s].prefix, *args])])[0]
        if isinstance(reply, Exception):
            raise reply
        return reply

    def expire_stale(self, max_age: float, now: float, batch: int = 64) -> list[str]:
        out: list[str] = []
        todo = list(range(self.nshards))
        while todo:
            calls = [(s, "kvbus_expire", [self.shards[s].prefix, repr(now - max_age), repr(now), batch]) for s in todo]
            nxt = []
            for (s, _, _), names in zip(calls, self._execute(calls, ordered=False)):
                if isinstance(names, Exception):
                    raise names
                out.extend(n.decode() if isinstance(n, bytes) else str(n) for n in names)
                if len(names) >= batch:
                    nxt.append(s)
            todo = nxt
        return out

    def drop_holder(self, replica: str, dp_rank: int, now: float) -> int:
        return int(self._one(self.shard(replica, dp_rank), "kvbus_drop", holder_key(replica, dp_rank), repr(now)))

    # -- reads ----------------------------------------------------------------

    def lookup(self, chain: Sequence[bytes], *, weights: Weights | None = None,
               candidates: Sequence[str] | None = None, model: str | None = None) -> dict[str, HolderMatch]:
        """One ``FCALL_RO kvbus_lookup`` per shard, pipelined per master, all masters at once; the
        union of the answers (holders are disjoint across shards). Holder names: a client-side cache
        of every shard's holder table (display names need the replica's dp ranks over all shards)."""
        if not chain:
            return {}
        spec = (weights or DEFAULT_WEIGHTS).spec()
        cands = list(candidates or ())
        calls = [(s, LOOKUP_FUNCTION, lookup_args(st.prefix, chain, spec, cands, model))
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
            pipe.hgetall(st.prefix + "hname")
        return [parse_hname(d) for d in pipe.execute()]

    def stale(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for st in self.shards:
            out.update(st.stale())
        return out

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

    def summary(self) -> dict[str, dict[str, int]]:
        counts: dict[str, dict[str, int]] = {}
        for st in self.shards:
            tnames = st._tier_names()
            for hid, name in st._holders().items():
                counts[name] = {label(tnames[code]): n for code, (n, _, _) in st._tiers_of(hid).items() if n}
        return summary_from_counts(counts)

    def size(self, exact: bool = True) -> dict[str, int]:
        """Entries and holders summed over shards; ``blocks`` = distinct hashes over all shards (a
        hash held in several shards is in each one's block table: ``exact`` reads every block
        table's field names, O(blocks); ``exact=False`` sums the shards' counts)."""
        sizes = [st.size() for st in self.shards]
        out = {k: sum(x[k] for x in sizes) for k in ("entries", "blocks", "holders")}
        if exact and sum(1 for x in sizes if x["blocks"]) > 1:
            seen: set[bytes] = set()
            for st in self.shards:
                meta = {k.decode(): int(v) for k, v in self.rc.hgetall(st.prefix + "meta").items()
                        if k in (b"bL", b"bS")}
                pipe = self.rc.pipeline()
                for b in range(2 ** meta.get("bL", 0) + meta.get("bS", 0)):
                    pipe.hkeys(f"{st.prefix}B:{b}")
                for fields in pipe.execute():
                    seen.update(fields)
            out["blocks"] = len(seen)
        return out

    def commandstats(self) -> dict[str, dict[str, dict[str, float]]]:
        """``INFO commandstats`` of every master: node -> command -> {calls, usec, usec_per_call}."""
        out = {}
        for node in self.rc.get_primaries():
            info = node.redis_connection.info("commandstats")
            out[node.name] = {k.removeprefix("cmdstat_"): v for k, v in info.items()}
        return out
