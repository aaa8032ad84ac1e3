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
from urllib.parse import parse_qs, urlsplit

import redis
from redis.cluster import ClusterNode, LoadBalancingStrategy, RedisCluster
from redis.exceptions import AskError, ClusterDownError, ClusterError, MovedError, TryAgainError

from kvbus.schemas.backoff import Backoff
from kvbus.schemas.events import BlockEvent, holder_key

from kvbus.sinks import functions
from kvbus.sinks.redis_store import (
    DEFAULT_PREFIX,
    DEFAULT_WEIGHTS,
    NAMES_TTL,
    VIEW_CHANGED,
    Offsets,
    RedisStore,
    ViewChanged,
    _offsets_arg,
    _with_extra,
    holder_names,
    parse_lookup,
)
from kvbus.sinks.store import ApplyResult, HolderMatch, ResidencyStore, Snapshot, split_holder, summary_from_counts
from kvbus.sinks.tiers import DEFAULT_POLICY, TierPolicy, Weights, label

log = logging.getLogger("kvbus.sinks")

CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
DEFAULT_SHARDS = 16
RETRY_FOR = 30.0
"""Seconds a call refused during a slot migration or failover (TRYAGAIN, ASK, MOVED, CLUSTERDOWN,
connection lost) is retried before the error is raised."""
MIGRATION_CHECK = 1.0
"""Seconds between two checks, by a store reading from replicas, of which shards' slots are being
migrated (those are read from their masters)."""
READ_FROM = ("primary", "replica")
"""Where lookups are read: ``primary`` (default; exact at every instant) or ``replica``."""
RETRYABLE = (MovedError, AskError, TryAgainError, ClusterDownError, ClusterError, redis.ConnectionError,
             redis.TimeoutError)


def is_cluster_url(url: str) -> bool:
    """Whether ``url`` names a Redis Cluster (``redis+cluster://``)."""
    return urlsplit(url).scheme in CLUSTER_SCHEMES


def parse_cluster_url(url: str) -> tuple[list[tuple[str, int]], dict[str, str]]:
    """``redis+cluster://h:p,h:p/0?shards=16`` -> ([(h, p), ...], {"shards": "16"}). The database
    must be 0 (Redis Cluster has no other)."""
    parts = urlsplit(url)
    if parts.scheme not in CLUSTER_SCHEMES:
        raise ValueError(f"not a redis+cluster:// URL: {url!r}")
    nodes = []
    for hp in parts.netloc.rpartition("@")[2].split(","):
        host, _, port = hp.strip().rpartition(":")
        nodes.append((host or "127.0.0.1", int(port or 6379)))
    db = parts.path.strip("/")
    if db not in ("", "0"):
        raise ValueError(f"{url!r}: Redis Cluster has only database 0")
    params = {k: v[-1] for k, v in parse_qs(parts.query).items()}
    return nodes, params


def cluster_client(url: str, **kw: Any) -> RedisCluster:
    """A ``RedisCluster`` client (bytes replies) from a ``redis+cluster://`` URL's seed nodes; with
    ``?read_from=replica`` its connections send ``READONLY`` (replicas then serve reads)."""
    nodes, params = parse_cluster_url(url)
    if read_from(params) == "replica":
        kw.setdefault("load_balancing_strategy", LoadBalancingStrategy.ROUND_ROBIN)
    auth = urlsplit(url)
    if auth.password:
        kw.setdefault("password", auth.password)
    if auth.username:
        kw.setdefault("username", auth.username)
    if urlsplit(url).scheme.startswith("rediss"):
        kw.setdefault("ssl", True)
    return RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in nodes], **kw)


def read_from(params: Mapping[str, str]) -> str:
    """The URL's ``read_from`` (:data:`READ_FROM`), ``primary`` when absent."""
    value = params.get("read_from", "primary")
    if value not in READ_FROM:
        raise ValueError(f"read_from={value!r}: expected one of {', '.join(READ_FROM)}")
    return value


def open_store(url: str, prefix: str = DEFAULT_PREFIX, policy: TierPolicy = DEFAULT_POLICY, *,
               load: bool = True, client_kwargs: Mapping[str, Any] | None = None) -> "RedisStore | ShardedRedisStore":
    """The view at ``url``: :class:`ShardedRedisStore` for a ``redis+cluster://`` URL (its
    ``?shards=`` or :data:`DEFAULT_SHARDS`), else :class:`RedisStore`. ``client_kwargs``: more
    redis-py client arguments (credentials, TLS CA: ``Settings.redis_kwargs()``)."""
    kw = dict(client_kwargs or {})
    if not is_cluster_url(url):
        return RedisStore(redis.Redis.from_url(url, **kw), prefix, policy, load=load)
    _, params = parse_cluster_url(url)
    return ShardedRedisStore(cluster_client(url, **kw), prefix, policy, shards=int(params.get("shards", DEFAULT_SHARDS)),
                             load=load, read_from=read_from(params))


def shard_prefix(prefix: str, i: int) -> str:
    """Key prefix of virtual shard ``i``: ``P{s<i>}:`` (one hash slot per shard)."""
    return f"{prefix}{{s{i}}}:"


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
        if read_from not in READ_FROM:
            raise ValueError(f"read_from={read_from!r}: expected one of {', '.join(READ_FROM)}")
        if read_from == "replica" and not (self.rc.read_from_replicas or self.rc.load_balancing_strategy):
            raise ValueError("read_from='replica' needs a RedisCluster whose connections send READONLY "
                             "(load_balancing_strategy set; cluster_client(url) with ?read_from=replica)")
        self.read_from = read_from
        self.migration_check = migration_check
        self._migrating: set[int] = set()
        self._migrating_at = float("-inf")
        self.r = self.rc  # what RedisStore callers read plain keys through (kvbus.sinks.rebuild.view_status)
        self.prefix = prefix
        self.policy = policy
        self.nshards = shards
        self.retry_for = retry_for
        self.shards = [RedisStore(self.rc, shard_prefix(prefix, i), policy, load=False, declare_keys=True, **store_kw)
                       for i in range(shards)]
        self._shard_of: dict[tuple[str, int], int] = {}
        self._names: list[dict[int, tuple[str, str, int, int]]] = [{} for _ in range(shards)]
        self._names_at = float("-inf")
        self.retries = 0
        """Calls sent again after TRYAGAIN / ASK / MOVED / CLUSTERDOWN / a lost connection."""
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

    def _node(self, s: int, read: bool = False) -> ClusterNode:
        """The node a call of shard ``s`` goes to: its master, or for a read (``read``) by a store
        reading from replicas, its replica unless the shard is migrating (or has no replica)."""
        key = self.shards[s].fkeys[0]
        if read and self.read_from == "replica" and s not in self.migrating_shards():
            node = self.rc.get_node_from_key(key, replica=True)
            if node is not None:
                return node
        return self.rc.get_node_from_key(key)

    def migrating_shards(self) -> set[int]:
        """Shards whose slot some master reports migrating or importing (``CLUSTER NODES``: the
        ``[slot->-node]`` / ``[slot-<-node]`` entries of the master's own line), refreshed every
        ``migration_check`` s (:data:`MIGRATION_CHECK`). A store reading from replicas also re-reads
        the slot map then if a shard has no known replica (one may have joined or been promoted)."""
        now = time.monotonic()
        if now - self._migrating_at < self.migration_check:
            return self._migrating
        slots: set[int] = set()
        for node in self.rc.get_primaries():
            try:  # redis-py parses CLUSTER NODES: address -> {"flags", "migrations": [{"slot", ...}], ...}
                nodes = node.redis_connection.execute_command("CLUSTER NODES")
            except (ClusterError, redis.RedisError):
                continue
            for info in nodes.values():
                if "myself" in info.get("flags", ""):
                    slots.update(int(m["slot"]) for m in info.get("migrations", ()))
        self._migrating = {s for s, st in enumerate(self.shards) if self.rc.keyslot(st.fkeys[0]) in slots}
        self._migrating_at = now
        if self.read_from == "replica" and any(
                len(self.rc.nodes_manager.slots_cache.get(self.rc.keyslot(st.fkeys[0]), ())) < 2 for st in self.shards):
            try:  # a shard without a known replica: one joined or was promoted since the slot map was read
                self.rc.nodes_manager.initialize()
            except (ClusterError, redis.RedisError):
                pass
        return self._migrating

    def _send(self, calls: list[tuple[int, str, list]], idxs: list[int]) -> dict[int, Any]:
        """Send calls ``idxs`` of ``calls`` ((shard, function, args)): all commands to every node are
        written first, then the replies read (nodes run them concurrently). Reply or exception per call."""
        by_node: dict[str, tuple[ClusterNode, list[int]]] = {}
        out: dict[int, Any] = {}
        for j in idxs:
            try:
                node = self._node(calls[j][0], read=calls[j][1] == "kvbus_lookup")
            except (ClusterError, redis.RedisError) as e:  # slot not covered during a failover
                out[j] = e
                continue
            by_node.setdefault(node.name, (node, []))[1].append(j)
        sent: list[tuple[ClusterNode, Any, list[int]]] = []
        for node, js in by_node.values():
            r = node.redis_connection
            pool = r.connection_pool
            try:
                conn = pool.get_connection()
            except (redis.ConnectionError, redis.TimeoutError) as e:
                for j in js:
                    out[j] = e
                continue
            try:
                packed = []
                for j in js:
                    s, name, args = calls[j]
                    keys = self.shards[s].fkeys
                    packed += conn.pack_command("FCALL_RO" if name == "kvbus_lookup" else "FCALL", name, len(keys), *keys, *args)
                conn.send_packed_command(packed)
                sent.append((node, conn, js))
            except (redis.ConnectionError, redis.TimeoutError) as e:
                conn.disconnect()
                pool.release(conn)
                for j in js:
                    out[j] = e
        for node, conn, js in sent:
            r, pool = node.redis_connection, node.redis_connection.connection_pool
            try:
                for k, j in enumerate(js):
                    try:
                        out[j] = r.parse_response(conn, "FCALL")
                    except redis.ResponseError as e:
                        out[j] = e
                    except (redis.ConnectionError, redis.TimeoutError) as e:
                        conn.disconnect()
                        for j2 in js[k:]:
                            out[j2] = e
                        break
            except BaseException:
                conn.disconnect()
                raise
            finally:
                pool.release(conn)
        return out

    def _execute(self, calls: list[tuple[int, str, list]], *, ordered: bool = True) -> list:
        """Run ``calls`` ((shard, function, args)) in one round trip, retrying those refused during a
        slot migration or failover (:data:`RETRYABLE`) for up to ``retry_for`` s. Within a shard,
        calls run in order: after a refused call, the shard's later calls are sent again with it
        (``ordered``: a later call that ran although an earlier one was refused, possible only if a
        migration is aborted between them, raises RuntimeError). Replies, an error as its exception."""
        replies: list = [None] * len(calls)
        pending = list(range(len(calls)))
        deadline = time.monotonic() + self.retry_for
        loaded = False
        backoff = Backoff(first=0.005, cap=0.1)  # a slot moves or a replica is promoted within ms
        while pending:
            got = self._send(calls, pending)
            retry: list[int] = []
            refused: set[int] = set()
            missing = False
            for j in pending:
                s, r = calls[j][0], got[j]
                if s in refused:
                    if not isinstance(r, Exception) and ordered:
                        raise RuntimeError(f"shard {s}: a call ran after an earlier one of the batch was refused "
                                           "(slot migration aborted mid-batch?); resync the shard")
                    retry.append(j)
                elif isinstance(r, RETRYABLE) or (isinstance(r, Exception) and functions.is_missing(r)):
                    missing = missing or functions.is_missing(r)
                    refused.add(s)
                    retry.append(j)
                    replies[j] = r
                else:
                    replies[j] = r
            if not retry:
                break
            if missing and not loaded:
                self.load_library(replace=True)
                loaded = True
            elif time.monotonic() > deadline:
                for j in retry:
                    if replies[j] is None:
                        replies[j] = ClusterError("not sent: an earlier call of the shard was refused")
                break
            else:
                self.retries += len(retry)
                if any(isinstance(got[j], (MovedError, ClusterDownError, ClusterError, redis.ConnectionError,
                                           redis.TimeoutError)) for j in retry):
                    try:
                        self.rc.nodes_manager.initialize()
                    except (ClusterError, redis.RedisError):
                        pass
                time.sleep(backoff.next())  # while the slot moves or a replica is promoted
            pending = retry
        return replies

    # -- writes ---------------------------------------------------------------

    def apply(self, records: Iterable[tuple[str, BlockEvent]], *, view_id: str | None = None,
              offsets: Offsets | None = None,
              expected: Mapping[tuple[str, int], int | None] | Sequence[Mapping[tuple[str, int], int | None] | None] | None = None,
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
        for (s, _, args), reply in zip(calls, replies):
            if isinstance(reply, redis.ResponseError) and VIEW_CHANGED in str(reply):
                raise ViewChanged(f"shard {s} of the view under {self.prefix!r} is not view {view_id!r} any more: {reply}")
            if isinstance(reply, redis.exceptions.NoPermissionError):
                raise reply  # Redis's ACL refuses this client the call: a setting to fix, not bad events
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
        for s, reply in enumerate(self._execute(calls)):
            if isinstance(reply, redis.ResponseError) and VIEW_CHANGED in str(reply):
                raise ViewChanged(f"shard {s} of the view under {self.prefix!r} is not view {view_id!r} any more: {reply}")
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
        for st in sts:
            if st.get("state") == "rebuilding":
                return st
        for st in sts:
            if st.get("state"):
                return st
        pipe = self.rc.pipeline()
        for st in self.shards:
            pipe.exists(st.prefix + "meta")
        return {"state": "ready" if any(pipe.execute()) else "missing"}

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
               candidates: Sequence[str] | None = None) -> dict[str, HolderMatch]:
        """One ``FCALL_RO kvbus_lookup`` per shard, pipelined per master, all masters at once; the
        union of the answers (holders are disjoint across shards). Holder names: a client-side cache
        of every shard's holder table (display names need the replica's dp ranks over all shards)."""
        if not chain:
            return {}
        spec = (weights or DEFAULT_WEIGHTS).spec()
        joined = b"".join(chain)
        cands = list(candidates or ())
        calls = [(s, "kvbus_lookup", [st.prefix, joined, spec, *cands]) for s, st in enumerate(self.shards)]
        replies = self._execute(calls, ordered=False)
        for r in replies:
            if isinstance(r, Exception):
                raise r
        if time.monotonic() - self._names_at > NAMES_TTL:
            self._refresh_names()
        out: dict[str, HolderMatch] = {}
        try:
            for s, reply in enumerate(replies):
                if reply[1]:
                    out.update(parse_lookup(reply, self._names[s]))
        except KeyError:  # a holder created since the cache was read
            self._refresh_names()
            out = {}
            for s, reply in enumerate(replies):
                if reply[1]:
                    out.update(parse_lookup(reply, self._names[s]))
        return out

    def _hnames(self) -> list[dict[int, str]]:
        """Per shard: hid -> holder name."""
        pipe = self.rc.pipeline()
        for st in self.shards:
            pipe.hgetall(st.prefix + "hname")
        return [{int(k): v.decode() for k, v in d.items() if k} for d in pipe.execute()]

    def _refresh_names(self) -> None:
        per = self._hnames()
        ranks: dict[str, int] = {}
        splits = []
        for names in per:
            split = {hid: split_holder(n) for hid, n in names.items()}
            for replica, _ in split.values():
                ranks[replica] = ranks.get(replica, 0) + 1
            splits.append(split)
        self._names = [holder_names(split, ranks) for split in splits]
        self._names_at = time.monotonic()

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
