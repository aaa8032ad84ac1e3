"""The residency view: what the sink writes to Redis and routers read, in one place.

Three interfaces, each declared once (docs/architecture.md has what each backend implements):

* :class:`~kvbus.sinks.view.reader.ViewReader` (``reader.py``): lookup, status, summary, size,
  staleness. :class:`~kvbus.sinks.view.reader.ViewClient` implements it for a single Redis/Valkey
  and for a Redis Cluster; ``kvbus.client`` re-exports it for routers, ``kvbus top`` and the demo read
  through it. It needs only the ``[client]`` install (no Kafka, no Faust).
* :class:`~kvbus.sinks.view.store.ViewWriter` (``store.py``): apply a batch, expire silent holders,
  drop a holder (the sink's consumer loop).
* :class:`~kvbus.sinks.view.store.ViewRecovery` (``store.py``): the view's id, consumer offsets and
  checkpoints, locks, and dumps of a holder (rebuilds and snapshots).

Modules:
  protocol.py      the writer's side of the function protocol: packing, keys, replies
  lua/kvbus.lua    the function library the view is written and read through
  functions.py     loading and calling that library
  cluster.py       reaching the view's servers: Redis Cluster URLs and clients, each shard's calls in
                   one round trip (``ShardCalls``)
  transport.py     how one shard's function calls are sent (one server, or one Redis Cluster shard)
  redis_store.py   ``RedisStore``: the view (or one shard of it) in one Redis server
  sharded_store.py ``ShardedRedisStore``: the shards of a view on a Redis Cluster
  store_url.py     ``open_store``: the store a KVBUS_REDIS_URL names
  refcounts.py     the ref-counting policy
  redis_memory.py  the eviction policy the view needs, a full Redis (``RedisFull``), evicted keys

The key layout is the contract's (:mod:`kvbus.schemas.view_keys`, with the lookup wire protocol in
:mod:`kvbus.schemas.lookup`): the Go client reads it too. Layout and semantics: docs/sinks-layout.md.
"""
