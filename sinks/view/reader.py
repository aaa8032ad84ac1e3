"""The residency view's reader: :class:`ViewReader`, what every reader of the view may ask, and
:class:`ViewClient`, its implementation for a single Redis/Valkey and for a Redis Cluster (docs/client.md).

Routers (``kvbus.client``), ``kvbus serve``, ``kvbus top``, the demo and the sink's own gauges read the
view through it; only the writer's stores (:mod:`kvbus.sinks.view.store`) write it.

``ViewClient`` speaks the lookup protocol of :mod:`kvbus.schemas.lookup` over redis-py: one ``FCALL_RO
kvbus_lookup`` on a single Redis (or one of its replicas), one per shard on a Redis Cluster
(pipelined per node, concurrent across nodes, retried through slot migrations and failovers,
from replicas with ``?read_from=replica``: :mod:`kvbus.sinks.view.cluster`), holder names from a
cache it refreshes itself.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Iterable, Mapping, Protocol, Sequence

import redis
from redis.cluster import LoadBalancingStrategy, RedisCluster

from kvbus.runtime.security import redact_url
from kvbus.schemas import lookup, view_keys as vk
from kvbus.schemas.events import MixedHashes, canonical_hash, canonical_hashes
from kvbus.schemas.hashing import LoRA, block_hashes
from kvbus.schemas.lookup import DEFAULT_PREDICT_TTL, DEFAULT_PREFIX, NAMES_TTL, HolderMatch, HolderNames, ViewStatus
from kvbus.schemas.tiers import Weights, label
from kvbus.sinks.view.cluster import (
    MIGRATION_CHECK,
    RETRY_FOR,
    ShardCalls,
    cluster_client,
    is_cluster_url,
    is_missing,
    parse_cluster_url,
    read_from as url_read_from,
    url_shards,
)
from kvbus.sinks.view.ties import Shuffle, TieBreak, TieBreakLike, as_tie_break, rank

WeightsLike = Weights | Mapping[str, float] | str
"""What a ``weights`` argument takes: a mapping NAME -> weight laid over the defaults (names a
medium, e.g. ``GPU``, ``CPU``, or an ownership, e.g. ``kvcr``; ``*`` for any other tier), the same as a
string ``"GPU=1,CPU=0.5"``, or a :class:`~kvbus.schemas.tiers.Weights`."""


class ViewReader(Protocol):
    """What a reader of the residency view may ask. :class:`ViewClient` implements it for every backend
    (one Redis or Valkey server, or a replica of it; a Redis Cluster); ``tests/test_view_reader.py``
    holds each backend's answers to the same oracle."""

    def lookup(self, tokens: Sequence[int] | None = None, hashes: Sequence[int | bytes] | None = None,
               **options: Any) -> list[HolderMatch]:
        """The holders of the longest cached prefix of a prompt, best first (:meth:`ViewClient.lookup`)."""

    def status(self) -> ViewStatus:
        """Whether answers can be trusted now (ready, rebuilding, missing)."""

    def summary(self) -> dict[str, dict[str, int]]:
        """``{holder display name: {tier label: blocks}}``: the blocks each holder holds per tier (a holder's
        display name is its replica, or ``<replica>#<dp_rank>`` when the replica has several dp ranks;
        labels such as ``GPU``, ``CPU``, ``CPU@kvcr``); holders with no blocks are left out."""

    def size(self, exact: bool = True) -> dict[str, int]:
        """``{"entries": (holder, block, tier) entries, "blocks": distinct hashes, "holders": live holders}``.
        ``exact=False`` lets ``blocks`` count a hash once per shard of a sharded view (cheap: what gauges
        read every few seconds); a view of one shard is always exact."""

    def stale(self) -> dict[str, float]:
        """Holders expired for silence and not heard from since: holder name -> when it expired (Unix s)."""


def summary_from_counts(counts: Mapping[str, Mapping[str, int]]) -> dict[str, dict[str, int]]:
    """Turn ``{holder name: {label: n}}`` into display names, dropping empty holders."""
    names = lookup.display_names(counts)
    return {names[h]: dict(sorted(t.items())) for h, t in sorted(counts.items()) if any(t.values())}


def _now_ms() -> int:
    """This process's clock, Unix ms: what router leases are written and read in (routers' clocks are
    assumed in sync to well within a lease, as NTP keeps them)."""
    return int(time.time() * 1000)


def _text(v: bytes | str) -> str:
    return v.decode() if isinstance(v, bytes) else v


class FunctionsMissing(RuntimeError):
    """The server does not have the ``kvbus`` function library (a Redis restarted without persistence,
    ``FUNCTION FLUSH``, a replica before its first sync). A sink loads it when it starts and when it
    finds it missing; a router only reads."""


def as_weights(value: WeightsLike | None) -> Weights:
    """``value`` as :class:`~kvbus.schemas.tiers.Weights` (None: the defaults)."""
    if value is None:
        return Weights()
    if isinstance(value, Weights):
        return value
    if isinstance(value, str):
        return Weights.parse(value)
    return Weights.over(value)


def chain_of(tokens: Sequence[int] | None, hashes: Sequence[int | bytes] | None, block_size: int, algo: str,
             seed: str | None, *, lora: LoRA | None = None, cache_salt: str | None = None,
             engine_version: str | None = None) -> list[bytes]:
    """The chain of 8-byte hashes a lookup sends: ``hashes`` in their canonical form, or the hashes
    vLLM computes for ``tokens`` with the request's LoRA adapter and cache salt
    (:func:`kvbus.schemas.hashing.block_hashes`). ValueError unless exactly one of them is given, or
    when an extra key comes with ``hashes`` (those are hashed already)."""
    if (tokens is None) == (hashes is None):
        raise ValueError("give tokens= (prompt token ids) or hashes= (block hashes), not both or neither")
    if hashes is not None:
        if lora is not None or cache_salt is not None or engine_version is not None:
            raise ValueError("lora=, cache_salt= and engine_version= apply to tokens=: hashes= are hashed already")
        try:
            return canonical_hashes(hashes)[0]  # ints, or digests: the fast path of a chain of one kind
        except MixedHashes:
            return [canonical_hash(h) for h in hashes]
    return block_hashes(tokens, block_size, algo, seed=seed, lora=lora, cache_salt=cache_salt,
                        engine_version=engine_version)


class ViewClient:
    """A reader of the residency view under key prefix ``prefix``.

    ``url``: ``redis://``, ``rediss://`` or ``unix://`` for a single Redis (a replica serves
    lookups too), ``redis+cluster://h:p[,h:p...][?read_from=replica]`` for the sharded view on a
    Redis Cluster; or a ``redis.Redis`` / ``RedisCluster`` client (bytes replies). ``tie_break``:
    how tied holders are ordered unless a lookup says otherwise (:mod:`kvbus.sinks.view.ties`; default
    a :class:`~kvbus.sinks.view.ties.Shuffle` seeded from the OS). ``names_ttl``: seconds the cache of
    holder names is trusted. Redis Cluster only: ``read_from`` (``primary`` or ``replica``; default
    the URL's, else ``primary``), ``shards`` (the shard count used when the view does not record
    its own; default the URL's ``?shards=``, else 16), ``retry_for`` (seconds a call refused during
    a slot migration or failover is retried), ``migration_check`` (seconds between two checks of
    which shards migrate, when reading from replicas). ``redis_kwargs``: more redis-py client
    arguments (``username``, ``password``, ``ssl_ca_certs``, ``socket_timeout``, ...).

    No I/O happens before the first :meth:`lookup` or :meth:`status`. Safe to share between threads.
    """

    def __init__(self, url: str | redis.Redis | RedisCluster, prefix: str = DEFAULT_PREFIX, *,
                 tie_break: TieBreakLike | None = None, names_ttl: float = NAMES_TTL,
                 read_from: str | None = None, shards: int | None = None, retry_for: float = RETRY_FOR,
                 migration_check: float = MIGRATION_CHECK, **redis_kwargs: Any):
        self.prefix = prefix
        self.tie_break: TieBreak = as_tie_break(tie_break) if tie_break is not None else Shuffle()
        self._names = HolderNames(names_ttl)
        self._lock = threading.Lock()
        self._r: redis.Redis | None = None
        self._rc: RedisCluster | None = None
        self._url: str | None = None
        self._kwargs = redis_kwargs
        self._calls: ShardCalls | None = None
        self._cluster_opts = {"retry_for": retry_for, "migration_check": migration_check}
        if isinstance(url, RedisCluster):
            self._rc, self._cluster = url, True
        elif isinstance(url, redis.Redis):
            self._r, self._cluster = url, False
        else:
            self._url, self._cluster = url, is_cluster_url(url)
        params = parse_cluster_url(url)[1] if self._cluster and isinstance(url, str) else {}
        self.read_from = read_from or url_read_from(params)
        self._default_shards = shards if shards is not None else url_shards(params)

    @classmethod
    def from_env(cls, prefix: str = DEFAULT_PREFIX, **kw: Any) -> "ViewClient":
        """A client of ``KVBUS_REDIS_URL`` with the credentials of ``KVBUS_REDIS_USERNAME`` /
        ``_PASSWORD`` / ``_SSL_CA`` (:class:`kvbus.runtime.settings.Settings`)."""
        from kvbus.runtime.settings import Settings

        settings = Settings.from_env()
        return cls(settings.redis_url, prefix, **{**settings.redis_kwargs(), **kw})

    @property
    def cluster(self) -> bool:
        """Whether the view is the sharded view on a Redis Cluster."""
        return self._cluster

    # -- connections ------------------------------------------------------------

    def _redis(self) -> redis.Redis:
        if self._r is None:
            self._r = redis.Redis.from_url(self._url, **self._kwargs)
        return self._r

    def _cluster_client(self) -> RedisCluster:
        if self._rc is None:
            kw = dict(self._kwargs)
            if self.read_from == "replica":  # connections that send READONLY, whatever the URL says
                kw.setdefault("load_balancing_strategy", LoadBalancingStrategy.ROUND_ROBIN)
            self._rc = cluster_client(self._url, **kw)
        return self._rc

    def close(self) -> None:
        """Close the connections this client opened (not a client it was given)."""
        if self._url is not None:
            for c in (self._r, self._rc):
                if c is not None:
                    c.close()
            self._r = self._rc = None
            self._calls = None

    def __enter__(self) -> "ViewClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- the view's parts -------------------------------------------------------

    def _prefixes(self) -> list[str]:
        """Prefix of every view to ask: the view, or each shard of the sharded view."""
        if not self._cluster:
            return [self.prefix]
        return [lookup.shard_prefix(self.prefix, i) for i in range(len(self._calls.keys))] if self._calls else []

    def _shard_count(self) -> int:
        """The sharded view's shard count as it records it (``P{s0}:meta shards``), else the default."""
        raw = self._cluster_client().hget(lookup.meta_key(lookup.shard_prefix(self.prefix, 0)), lookup.SHARDS_FIELD)
        return int(raw) if raw is not None else self._default_shards

    def _ensure_shards(self) -> None:
        """(Re)build the shard calls when the shard count is unknown or changed."""
        n = self._shard_count()
        if self._calls is None or len(self._calls.keys) != n:
            keys = [lookup.declared_keys(lookup.shard_prefix(self.prefix, i)) for i in range(n)]
            self._calls = ShardCalls(self._cluster_client(), keys, read_from=self.read_from, **self._cluster_opts)

    def _pipeline(self) -> Any:
        return self._cluster_client().pipeline() if self._cluster else self._redis().pipeline(transaction=False)

    def _tables(self) -> list[dict[int, str]]:
        """Every view's holder table (``P hname``), after checking its layout (:class:`LayoutMismatch`)."""
        prefixes = self._prefixes()
        pipe = self._pipeline()
        for p in prefixes:
            pipe.hgetall(lookup.hname_key(p))
            pipe.hget(lookup.meta_key(p), lookup.LAYOUT_FIELD)
        replies = pipe.execute()
        for p, layout in zip(prefixes, replies[1::2]):
            lookup.check_layout(p, layout)
        return [lookup.parse_hname(t) for t in replies[0::2]]

    def _refresh(self) -> None:
        with self._lock:
            if self._cluster:
                self._ensure_shards()
            self._names.update(self._tables())

    # -- lookups ----------------------------------------------------------------

    def lookup(self, tokens: Sequence[int] | None = None, hashes: Sequence[int | bytes] | None = None, *,
               block_size: int = 16, algo: str = "sha256", seed: str | None = None,
               lora: LoRA | None = None, cache_salt: str | None = None, engine_version: str | None = None,
               weights: WeightsLike | None = None, candidates: Iterable[str] | None = None,
               model: str | None = None, predicted: float | None = None,
               tie_break: TieBreakLike | None = None) -> list[HolderMatch]:
        """The holders of the longest cached prefix of a prompt, best first.

        The prompt as ``tokens`` (its token ids, hashed as vLLM does: ``block_size`` tokens per
        block, the engine's ``--prefix-caching-hash-algo`` as ``algo`` (``sha256``, ``sha256_cbor``,
        ``xxhash``, ``xxhash_cbor``) and its ``PYTHONHASHSEED`` as ``seed``: None takes this
        process's, else vLLM's default, which the xxhash algorithms do not have:
        :class:`~kvbus.schemas.hashing.UnmatchableSeed`), or as ``hashes`` (the block hashes the
        engine publishes, block 0 first: vLLM's unsigned ints, SGLang's signed ints, or digests as
        bytes, of which the last 8 count). Only full blocks have hashes. A request with a LoRA
        adapter is hashed with ``lora`` (:class:`~kvbus.schemas.hashing.LoRA`: its name and the path
        the engines loaded it from), a salted one with ``cache_salt``; ``engine_version`` names the
        engines' vLLM release where it hashes differently (default: the newest rules).

        ``weights``: tier weights laid over the defaults (:data:`WeightsLike`); a holder's score is
        the sum over its matched blocks of the best weight among the tiers holding each block.
        ``candidates``: holder names ``"<replica>#<dp_rank>"`` or replica names (all its ranks) to
        restrict the answer to; None: every holder; empty: none. ``model``: the model the request is
        for (the engines' served model name, as their bridges name it with ``--model``): only holders
        whose latest event named this model answer, never those of another model or of an unknown one
        (a bridge without ``--model``, a view written before models); None: every holder, whatever its
        model. ``predicted``: count the view's predicted entries (:meth:`predict`) too, each predicted
        block with this weight (a number >= 0, e.g. 0.5: less than a real GPU block), only those predicted
        naming ``model`` when a model is named; a holder's answer then goes on past its last held block
        over the blocks it has predicted or holds, and its ``tiers`` add ``"predicted"``: the blocks
        matched, when a prediction lengthened them (None: only what the engines reported, as without
        predictions). ``tie_break``: this lookup's order of tied holders (default: the client's).

        Returns one :class:`~kvbus.schemas.lookup.HolderMatch` per holder that holds block 0 (or, with
        ``predicted``, has it predicted), by
        score descending, then matched descending, then ``tie_break``. Raises ValueError for bad
        input, :class:`FunctionsMissing` when the server lacks the function library,
        :class:`~kvbus.schemas.lookup.LayoutMismatch` for a view of another layout, and redis-py's
        errors when Redis cannot be reached.
        """
        return self._lookup(False, tokens=tokens, hashes=hashes, block_size=block_size, algo=algo, seed=seed,
                            lora=lora, cache_salt=cache_salt, engine_version=engine_version, weights=weights,
                            candidates=candidates, model=model, predicted=predicted, tie_break=tie_break)[0]

    def lookup_with_load(self, tokens: Sequence[int] | None = None, hashes: Sequence[int | bytes] | None = None,
                         **query: Any) -> tuple[list[HolderMatch], dict[str, lookup.Load]]:
        """:meth:`lookup` (the same arguments) and the routers' shared load (:meth:`load`), read in the
        same round trip on one server (on a Redis Cluster the load is one more call, to shard 0)."""
        return self._lookup(True, tokens=tokens, hashes=hashes, **query)

    def _lookup(self, with_load: bool, *, tokens: Sequence[int] | None, hashes: Sequence[int | bytes] | None,
                block_size: int = 16, algo: str = "sha256", seed: str | None = None, lora: LoRA | None = None,
                cache_salt: str | None = None, engine_version: str | None = None,
                weights: WeightsLike | None = None, candidates: Iterable[str] | None = None,
                model: str | None = None, predicted: float | None = None,
                tie_break: TieBreakLike | None = None) -> tuple[list[HolderMatch], dict[str, lookup.Load]]:
        options = lookup.option_args(model=model, predicted=predicted)
        chain = chain_of(tokens, hashes, block_size, algo, seed, lora=lora, cache_salt=cache_salt,
                         engine_version=engine_version)
        cands = None if candidates is None else [c for c in candidates]
        tb = as_tie_break(tie_break) if tie_break is not None else self.tie_break
        if not chain or cands == []:
            return [], self.load() if with_load else {}
        spec = as_weights(weights).spec()
        if self._names.stale or (self._cluster and self._calls is None):
            self._refresh()
        replies, raw_load = self._call(chain, spec, cands or (), options, with_load)
        with self._lock:
            found = self._names.answer(replies, self._tables)
        return rank(found, tb), lookup.parse_load(raw_load, _now_ms()) if with_load else {}

    def _call(self, chain: list[bytes], spec: str, cands: Sequence[str], options: Sequence[str],
              with_load: bool = False) -> tuple[list, Mapping | None]:
        """One ``kvbus_lookup`` reply per view (shard), and the load hash when ``with_load``."""
        raw_load = None
        try:
            if not self._cluster:
                args = lookup.lookup_args(self.prefix, chain, spec, cands, options)
                if not with_load:
                    return [self._redis().fcall_ro(lookup.LOOKUP_FUNCTION, 0, *args)], None
                pipe = self._redis().pipeline(transaction=False)
                pipe.fcall_ro(lookup.LOOKUP_FUNCTION, 0, *args)
                pipe.hgetall(self._load_key())
                replies = pipe.execute(raise_on_error=False)
                replies, raw_load = replies[:1], replies[1]
            else:
                replies = self._calls.execute([(s, lookup.LOOKUP_FUNCTION, lookup.lookup_args(p, chain, spec, cands,
                                                                                               options))
                                               for s, p in enumerate(self._prefixes())], ordered=False)
                if with_load:
                    raw_load = self._cluster_client().hgetall(self._load_key())
        except redis.ResponseError as e:
            raise self._missing(e) if is_missing(e) else e
        for r in (*replies, raw_load):
            if isinstance(r, Exception):
                raise self._missing(r) if is_missing(r) else r
        return replies, raw_load

    # -- shared load --------------------------------------------------------------

    def _load_key(self) -> str:
        """``P load`` (on a Redis Cluster: shard 0's, one slot every router writes and reads)."""
        return vk.LOAD(lookup.shard_prefix(self.prefix, 0) if self._cluster else self.prefix)

    def _writer(self) -> Any:
        return self._cluster_client() if self._cluster else self._redis()

    def load(self) -> dict[str, lookup.Load]:
        """The routers' shared load: replica -> :class:`~kvbus.schemas.lookup.Load` (requests in flight and
        their prompt tokens, summed over every router whose lease has not run out; replicas with none
        left out). One ``HGETALL``."""
        return lookup.parse_load(self._writer().hgetall(self._load_key()), _now_ms())

    def report(self, router: str, loads: Mapping[str, lookup.Load], lease: float = 30.0) -> None:
        """Write ``router``'s load on each replica of ``loads`` (its requests in flight there and their
        prompt tokens, as absolute values: each router owns its fields, so a lost write is mended by the
        next one) and renew its lease for ``lease`` seconds; ``loads`` may be empty (a renewal). One round
        trip. A router that stops reporting (it crashed) counts for nobody once its lease runs out;
        :class:`kvbus.client.load.LoadReporter` keeps a router's books and reports them."""
        key = self._load_key()
        fields: dict[str, int] = {lookup.lease_field(router): _now_ms() + int(lease * 1000)}
        for replica, load in loads.items():
            req, tok = lookup.load_fields(router, replica)
            fields[req], fields[tok] = load.requests, load.tokens
        self._writer().hset(key, mapping=fields)

    def forget_routers(self, older_than: float = 300.0) -> int:
        """Delete the load fields of routers whose lease ran out more than ``older_than`` seconds ago
        (they count for nobody already); the fields deleted."""
        key, now = self._load_key(), _now_ms()
        fields = [f for f in lookup.expired_fields(self._writer().hgetall(key), now - int(older_than * 1000))]
        return int(self._writer().hdel(key, *fields)) if fields else 0

    # -- predictions (a write: not part of ViewReader) ----------------------------

    def predict(self, holder: str, tokens: Sequence[int] | None = None, hashes: Sequence[int | bytes] | None = None,
                *, ttl: float = DEFAULT_PREDICT_TTL, model: str | None = None, block_size: int = 16,
                algo: str = "sha256", seed: str | None = None, lora: LoRA | None = None,
                cache_salt: str | None = None, engine_version: str | None = None) -> int:
        """Record a prompt's blocks as **predicted** on ``holder``, the holder a router just sent it to,
        for ``ttl`` seconds (docs/lookup-protocol.md, "Predicted entries"): until the engine's BlockStored
        reaches the view, lookups with ``predicted=<weight>`` count them, so that a burst of requests
        sharing a new prefix follows the first one instead of scattering.

        A **write** (``FCALL kvbus_predict``): the server must be the primary (a ``?read_from=replica``
        cluster client sends it to the shard's master; a client of a replica gets Redis's READONLY
        error), and ACL users need FCALL. That is why it is not part of :class:`ViewReader`, whose
        methods only read.

        ``holder``: ``"<replica>#<dp_rank>"``, or a replica name for its dp rank 0 (a
        :class:`~kvbus.schemas.lookup.HolderMatch`'s ``holder`` or ``name``). The prompt as ``tokens`` or
        ``hashes``, hashed as :meth:`lookup` hashes them (same ``block_size``, ``algo``, ``seed``,
        ``lora``, ``cache_salt``, ``engine_version``). ``ttl``: seconds the prediction counts (more than 0,
        at most :data:`~kvbus.schemas.lookup.MAX_PREDICT_TTL`); a block predicted again keeps the later
        expiry. ``model``: the model the request is for; lookups naming a model count only predictions
        made naming it (None: only lookups naming no model count them). A holder's predictions are for one
        model: predicting for another drops its earlier ones.

        The engine's BlockStored of a predicted block confirms it (the real entry counts from then on);
        a BlockRemoved of it, an AllBlocksCleared or Reset of the holder, or its expiry drops predictions
        made before them. Returns the number of blocks recorded: 0 for an empty chain, or when the view
        does not know the holder yet (no event or heartbeat from its bridge).
        """
        replica, dp_rank = lookup.predict_holder(holder)
        chain = chain_of(tokens, hashes, block_size, algo, seed, lora=lora, cache_salt=cache_salt,
                         engine_version=engine_version)
        if not chain:
            return 0
        try:
            if not self._cluster:
                args = lookup.predict_args(self.prefix, replica, dp_rank, chain, ttl, model)
                return int(self._redis().fcall(lookup.PREDICT_FUNCTION, 0, *args))
            with self._lock:
                self._ensure_shards()
            s = lookup.holder_shard(replica, dp_rank, len(self._calls.keys))
            args = lookup.predict_args(lookup.shard_prefix(self.prefix, s), replica, dp_rank, chain, ttl, model)
            (reply,) = self._calls.execute([(s, lookup.PREDICT_FUNCTION, args)])
        except redis.ResponseError as e:
            raise self._missing(e) if is_missing(e) else e
        if isinstance(reply, Exception):
            raise self._missing(reply) if is_missing(reply) else reply
        return int(reply)

    def _missing(self, err: Exception) -> FunctionsMissing:
        return FunctionsMissing(f"the kvbus functions are not loaded on this server ({err}); a sink loads them "
                                "when it starts and when it finds them missing: start one against the primary")

    # -- the view's extent -------------------------------------------------------

    def _ask(self, per_prefix: Any) -> list[list]:
        """Send ``per_prefix(pipe, prefix)``'s commands for every view (shard) in one round trip; each
        view's replies, in order."""
        if self._cluster:
            with self._lock:
                self._ensure_shards()
        prefixes = self._prefixes()
        pipe = self._pipeline()
        counts = []
        for p in prefixes:
            before = len(pipe)
            per_prefix(pipe, p)
            counts.append(len(pipe) - before)
        replies, out = pipe.execute(), []
        for n in counts:
            out.append(replies[:n])
            replies = replies[n:]
        return out

    def summary(self) -> dict[str, dict[str, int]]:
        """:meth:`ViewReader.summary`. Two round trips: the holder and tier tables, then each holder's
        state (its tiers' entry counts, ``t:<code>`` of ``P H:<hid>``)."""
        tables = self._ask(lambda pipe, p: (pipe.hgetall(lookup.hname_key(p)), pipe.hgetall(vk.TIER_NAME(p))))
        holders = [(p, hid, name, tnames) for p, (hname, tname) in zip(self._prefixes(), tables)
                   for tnames in [{int(k): _text(v) for k, v in tname.items()}]
                   for hid, name in lookup.parse_hname(hname).items()]
        pipe = self._pipeline()
        for p, hid, _name, _tnames in holders:
            pipe.hgetall(vk.HOLDER(p, hid))
        counts: dict[str, dict[str, int]] = {}
        for (_p, _hid, name, tnames), state in zip(holders, pipe.execute() if holders else []):
            tiers = counts.setdefault(name, {})
            for f, v in state.items():
                f = _text(f)
                if f.startswith("t:") and (n := int(vk.STATE_TIER.unpack_from(v)[0])):
                    tiers[label(tnames[int(f[2:])])] = n
        return summary_from_counts(counts)

    def size(self, exact: bool = True) -> dict[str, int]:
        """:meth:`ViewReader.size`: one round trip, and on a Redis Cluster with ``exact`` whose blocks are
        in several shards, one more reading every shard's block table (O(blocks))."""
        sizes = self._ask(lambda pipe, p: (pipe.hgetall(lookup.meta_key(p)), pipe.zcard(vk.SEEN(p))))
        out = {"entries": sum(int(meta.get(b"entries", 0)) for meta, _ in sizes),
               "blocks": sum(int(meta.get(b"blocks", 0)) for meta, _ in sizes),
               "holders": sum(int(n) for _, n in sizes)}
        if exact and sum(1 for meta, _ in sizes if int(meta.get(b"blocks", 0))) > 1:
            pipe = self._pipeline()
            for p, (meta, _) in zip(self._prefixes(), sizes):
                for b in range(vk.block_buckets(meta)):
                    pipe.hkeys(vk.BLOCKS(p, b))
            out["blocks"] = len({raw for fields in pipe.execute() for raw in fields})
        return out

    def stale(self) -> dict[str, float]:
        """:meth:`ViewReader.stale`."""
        zsets = self._ask(lambda pipe, p: pipe.zrange(vk.STALE(p), 0, -1, withscores=True))
        return {_text(n): float(s) for (members,) in zsets for n, s in members}

    # -- status -----------------------------------------------------------------

    def status(self) -> ViewStatus:
        """Whether answers can be trusted now: ``ready``, ``rebuilding`` (a sink is rebuilding a lost
        view: answers may miss blocks) or ``missing`` (no view), with what ``P status`` records
        (:class:`~kvbus.schemas.lookup.ViewStatus`). On a Redis Cluster: over all shards."""
        if self._cluster:
            with self._lock:
                self._ensure_shards()
        prefixes = self._prefixes()
        pipe = self._pipeline()
        for p in prefixes:
            pipe.hgetall(lookup.status_key(p))
            pipe.exists(lookup.meta_key(p))
        replies = pipe.execute()
        return lookup.view_status(replies[0::2], [bool(n) for n in replies[1::2]])

    def __repr__(self) -> str:
        where = redact_url(self._url) if self._url else type(self._rc or self._r).__name__
        return f"ViewClient({where!r}, prefix={self.prefix!r})"
