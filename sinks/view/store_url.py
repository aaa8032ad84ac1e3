"""The view a ``KVBUS_REDIS_URL`` names: :func:`open_store`, what every user of a store opens it with
(the sink, ``kvbus top``, the benchmarks, the tests).

The URL forms (``redis://``, ``rediss://``, ``unix://``, ``redis+cluster://h:p[,h:p...][/0][?shards=S][&read_from=replica]``)
are parsed by :mod:`kvbus.sinks.view.cluster`, which the routers' client shares.
"""
from __future__ import annotations

from typing import Any, Mapping

import redis

from kvbus.schemas.lookup import DEFAULT_PREFIX
from kvbus.sinks.view.cluster import cluster_client, is_cluster_url, parse_cluster_url, read_from, url_shards
from kvbus.sinks.view.redis_store import RedisStore
from kvbus.sinks.view.refcounts import DEFAULT_POLICY, TierPolicy
from kvbus.sinks.view.sharded_store import ShardedRedisStore
from kvbus.sinks.view.store import ResidencyStore


def open_store(url: str, prefix: str = DEFAULT_PREFIX, policy: TierPolicy = DEFAULT_POLICY, *,
               load: bool = True, client_kwargs: Mapping[str, Any] | None = None) -> ResidencyStore:
    """The view at ``url``: a :class:`ShardedRedisStore` for a ``redis+cluster://`` URL (its
    ``?shards=`` or :data:`kvbus.sinks.view.cluster.DEFAULT_SHARDS` shards, its ``?read_from=``), else a
    :class:`RedisStore`. ``load``: check the servers and load the function library (a reader passes
    False). ``client_kwargs``: more redis-py client arguments (credentials, TLS CA:
    ``Settings.redis_kwargs()``)."""
    kw = dict(client_kwargs or {})
    if not is_cluster_url(url):
        return RedisStore(redis.Redis.from_url(url, **kw), prefix, policy, load=load)
    _, params = parse_cluster_url(url)
    return ShardedRedisStore(cluster_client(url, **kw), prefix, policy, shards=url_shards(params),
                             load=load, read_from=read_from(params))
