"""Reaching the residency view in Redis: what its writer (the sinks' stores) and its readers
(:mod:`kvbus.client`) do the same way, with redis-py.

* ``KVBUS_REDIS_URL`` names a single Redis (``redis://``, ``rediss://``, ``unix://``) or a Redis
  Cluster by its seed nodes: ``redis+cluster://h:p[,h:p...][/0][?shards=S][&read_from=replica]``
  (:func:`is_cluster_url`, :func:`parse_cluster_url`, :func:`cluster_client`);
* which errors mean the function library is missing (:func:`is_missing`) or the call must be sent
  again (:data:`RETRYABLE`);
* :class:`ShardCalls`: function calls on the shards of a sharded view (``P{s<i>}:``, one hash slot
  each; docs/sinks-layout.md, "Redis Cluster"), every shard's calls in one round trip, pipelined per
  node and concurrent across nodes, retried while a slot migrates or a master fails over; lookups
  read from replicas on request, except shards whose slot is being migrated.

The protocol itself (keys, arguments, replies) is :mod:`kvbus.schemas.lookup`.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Mapping, Sequence
from urllib.parse import parse_qs, urlsplit

import redis
from redis.cluster import ClusterNode, LoadBalancingStrategy, RedisCluster
from redis.exceptions import AskError, ClusterDownError, ClusterError, MovedError, TryAgainError

from kvbus.runtime.backoff import Backoff
from kvbus.schemas.lookup import LOOKUP_FUNCTION

CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
DEFAULT_SHARDS = 16
"""Shards of a sharded view whose URL names none (``?shards=``)."""
RETRY_FOR = 30.0
"""Seconds a call refused during a slot migration or failover (TRYAGAIN, ASK, MOVED, CLUSTERDOWN,
connection lost) is retried before the error is raised."""
MIGRATION_CHECK = 1.0
"""Seconds between two checks, by a reader of replicas, of which shards' slots are being migrated
(those are read from their masters)."""
READ_FROM = ("primary", "replica")
"""Where lookups are read: ``primary`` (default; exact at every instant) or ``replica``."""
RETRYABLE = (MovedError, AskError, TryAgainError, ClusterDownError, ClusterError, redis.ConnectionError,
             redis.TimeoutError)
"""Errors of a call on Redis Cluster that are answered by sending it again (never by skipping a shard)."""
READ_FUNCTIONS = frozenset({LOOKUP_FUNCTION})
"""Functions called with ``FCALL_RO`` by :class:`ShardCalls` (they may run on replicas)."""


def is_missing(err: BaseException) -> bool:
    """Whether ``err`` says the called function does not exist on the server (``ERR Function not
    found``: the library is not loaded there)."""
    return isinstance(err, redis.ResponseError) and "function not found" in str(err).lower()


REFUSED_ARGUMENTS = "kvbus: malformed arguments"
"""What a kvbus function answers, before writing anything, to arguments it does not take: also what
a library of an older release (loaded by a sink of that release) answers to a newer caller."""


def is_refused_arguments(err: BaseException) -> bool:
    """Whether ``err`` is a kvbus function refusing its arguments (:data:`REFUSED_ARGUMENTS`): nothing
    was written; a caller whose library is not the loaded one loads its own and calls again."""
    return isinstance(err, redis.ResponseError) and REFUSED_ARGUMENTS in str(err)


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


def read_from(params: Mapping[str, str]) -> str:
    """The URL's ``read_from`` (:data:`READ_FROM`), ``primary`` when absent."""
    value = params.get("read_from", "primary")
    if value not in READ_FROM:
        raise ValueError(f"read_from={value!r}: expected one of {', '.join(READ_FROM)}")
    return value


def url_shards(params: Mapping[str, str]) -> int:
    """The URL's ``shards`` (:data:`DEFAULT_SHARDS` when absent); ValueError unless a positive integer."""
    raw = params.get("shards", str(DEFAULT_SHARDS))
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n <= 0:
        raise ValueError(f"shards={raw!r}: expected a positive integer")
    return n


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
    if auth.scheme.startswith("rediss"):
        kw.setdefault("ssl", True)
    return RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in nodes], **kw)


Call = tuple[int, str, list]
"""One function call on a sharded view: (shard, function name, arguments after the keys)."""


class ShardCalls:
    """Function calls on the shards of a sharded view over a ``RedisCluster`` (module docstring).

    ``keys``: per shard, the keys its calls declare (the first routes the call: ``P{s<i>}:meta``,
    then ``P{s<i>}:guard``). ``read_from``: where calls of :data:`READ_FUNCTIONS` go
    (:data:`READ_FROM`; ``replica`` needs a client whose connections send READONLY:
    :func:`cluster_client` with ``?read_from=replica``). ``migration_check``: seconds between two
    checks of which shards are migrating, when reading from replicas. ``retry_for``: seconds a
    refused call is retried. ``reload``: loads the function library on every master; called once
    per :meth:`execute` when a call finds it missing, or refusing its arguments (a library of an older
    release, loaded by a sink of that release: such a call wrote nothing; once reloaded, a refusal is
    the call's reply); None: such a call's error is its reply.
    """

    def __init__(self, rc: RedisCluster, keys: Sequence[Sequence[str]], *, read_from: str = "primary",
                 migration_check: float = MIGRATION_CHECK, retry_for: float = RETRY_FOR,
                 reload: Callable[[], None] | None = None):
        if read_from not in READ_FROM:
            raise ValueError(f"read_from={read_from!r}: expected one of {', '.join(READ_FROM)}")
        if read_from == "replica" and not (rc.read_from_replicas or rc.load_balancing_strategy):
            raise ValueError("read_from='replica' needs a RedisCluster whose connections send READONLY "
                             "(load_balancing_strategy set; cluster_client(url) with ?read_from=replica)")
        self.rc = rc
        self.keys = [tuple(k) for k in keys]
        self.read_from = read_from
        self.migration_check = migration_check
        self.retry_for = retry_for
        self.reload = reload
        self._migrating: set[int] = set()
        self._migrating_at = float("-inf")
        self.retries = 0
        """Calls sent again after TRYAGAIN / ASK / MOVED / CLUSTERDOWN / a lost connection."""

    def node(self, s: int, read: bool = False) -> ClusterNode:
        """The node a call of shard ``s`` goes to: its master, or for a read (``read``) when reading
        from replicas, its replica unless the shard is migrating (or has no replica)."""
        key = self.keys[s][0]
        if read and self.read_from == "replica" and s not in self.migrating():
            node = self.rc.get_node_from_key(key, replica=True)
            if node is not None:
                return node
        return self.rc.get_node_from_key(key)

    def migrating(self) -> set[int]:
        """Shards whose slot some master reports migrating or importing (``CLUSTER NODES``: the
        ``[slot->-node]`` / ``[slot-<-node]`` entries of the master's own line), refreshed every
        ``migration_check`` s. When reading from replicas, the slot map is also read again then if a
        shard has no known replica (one may have joined or been promoted)."""
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
        self._migrating = {s for s, k in enumerate(self.keys) if self.rc.keyslot(k[0]) in slots}
        self._migrating_at = now
        if self.read_from == "replica" and any(
                len(self.rc.nodes_manager.slots_cache.get(self.rc.keyslot(k[0]), ())) < 2 for k in self.keys):
            try:  # a shard without a known replica: one joined or was promoted since the slot map was read
                self.rc.nodes_manager.initialize()
            except (ClusterError, redis.RedisError):
                pass
        return self._migrating

    def send(self, calls: Sequence[Call], idxs: Sequence[int]) -> dict[int, Any]:
        """Send calls ``idxs`` of ``calls``: all commands to every node are written first, then the
        replies read (nodes run them concurrently). Reply or exception per call index."""
        by_node: dict[str, tuple[ClusterNode, list[int]]] = {}
        out: dict[int, Any] = {}
        for j in idxs:
            try:
                node = self.node(calls[j][0], read=calls[j][1] in READ_FUNCTIONS)
            except (ClusterError, redis.RedisError) as e:  # slot not covered during a failover
                out[j] = e
                continue
            by_node.setdefault(node.name, (node, []))[1].append(j)
        sent: list[tuple[ClusterNode, Any, list[int]]] = []
        for node, js in by_node.values():
            pool = node.redis_connection.connection_pool
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
                    keys = self.keys[s]
                    packed += conn.pack_command("FCALL_RO" if name in READ_FUNCTIONS else "FCALL", name, len(keys),
                                                *keys, *args)
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

    def execute(self, calls: Sequence[Call], *, ordered: bool = True) -> list:
        """Run ``calls`` in one round trip, retrying those refused during a slot migration or failover
        (:data:`RETRYABLE`) for up to ``retry_for`` s. Within a shard, calls run in order: after a
        refused call, the shard's later calls are sent again with it (``ordered``: a later call that
        ran although an earlier one was refused, possible only if a migration is aborted between
        them, raises RuntimeError). Replies, an error as its exception."""
        replies: list = [None] * len(calls)
        pending = list(range(len(calls)))
        deadline = time.monotonic() + self.retry_for
        loaded = False
        backoff = Backoff(first=0.005, cap=0.1)  # a slot moves or a replica is promoted within ms
        while pending:
            got = self.send(calls, pending)
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
                elif isinstance(r, RETRYABLE) or (self.reload is not None and (
                        is_missing(r) or (is_refused_arguments(r) and not loaded))):
                    missing = missing or not isinstance(r, RETRYABLE)
                    refused.add(s)
                    retry.append(j)
                    replies[j] = r
                else:
                    replies[j] = r
            if not retry:
                break
            if missing and not loaded:
                self.reload()
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
                time.sleep(backoff.next())
            pending = retry
        return replies
