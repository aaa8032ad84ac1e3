"""kvbus sinks stage: consolidated block events (Kafka) -> residency view (Redis) <- routers.

Modules:
  consumer.py      the Kafka loop (``SinkConsumer``): decode, check, apply, dead-letter, commit, expire
  store.py         ``ResidencyStore`` interface (view and recovery), ``ApplyResult``, ``ViewChanged``
                   (``HolderMatch``: kvbus.schemas.lookup)
  store_url.py     ``open_store``: the store a KVBUS_REDIS_URL names
  redis_store.py   ``RedisStore``: the view (or one shard of it) in Redis, through the ``kvbus`` functions
  sharded_store.py ``ShardedRedisStore``: routing over the shards of a Redis Cluster view
  view_protocol.py the writer's side of the function protocol (lua/kvbus.lua): packing, keys, replies
  transport.py     how one shard's function calls are sent (one server, one Redis Cluster shard)
  functions.py     loading/calling the function library
  redis_memory.py  the eviction policy the view needs, a full Redis (``RedisFull``), evicted keys
  retention.py     the block topics' retention against the snapshot interval (checked at start)
  rebuild.py       rebuilding a lost view; snapshot.py: snapshots of the view to Kafka
  refcounts.py     ref-counting policy (tier names and lookup weights: kvbus.schemas.tiers)
  layout_gate.py   the order of a holder's events across the two block layouts while workers move
  hashes.py        hash strings and token -> vLLM block hash chains for lookups
  validate.py      checks a record must pass (else: dead-letter topic)
  metrics.py       Prometheus metrics
  demo_summary.py  ``summary()``: blocks per holder and tier, for the demo and the tests
  cli.py           ``kvbus sink`` / ``kvbus lookup`` (through kvbus.client)
  lua/             the function library (kvbus.lua) the view is written and read through
Layout and semantics: docs/sinks-layout.md.
"""

if __name__ != "kvbus.sinks":  # sinks/ is installed as kvbus.sinks (pyproject.toml, package-dir)
    raise ImportError(f"import kvbus.sinks, not {__name__}")
