"""The servers a view lives on, for tests that run one body on each: one Redis, one Valkey and a 3-master
Redis Cluster (each as its URL, what routers open, and a client, what a sink's store writes with)."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

from kvbus.infra.scratch_cluster import RedisClusterServer
from kvbus.infra.scratch_redis import REDIS, VALKEY, RedisServer
from kvbus.sinks.view.redis_store import RedisStore
from kvbus.sinks.view.sharded_store import ShardedRedisStore
from kvbus.sinks.view.store import ResidencyStore

KINDS = ("redis", "valkey", "redis-cluster")


@contextmanager
def view_server(kind: str) -> Iterator[tuple[str, Any]]:
    """(URL, client) of a fresh server of ``kind`` (one of :data:`KINDS`), stopped on exit."""
    if kind == "redis-cluster":
        with RedisClusterServer(3, REDIS) as cl:
            yield cl.url, cl.client()
        return
    with RedisServer(kind=VALKEY if kind == "valkey" else REDIS) as srv:
        yield srv.url, srv.client()


def writer(client: Any, prefix: str) -> ResidencyStore:
    """The store a sink writes the view under ``prefix`` with, on ``client``'s server (or cluster)."""
    return ShardedRedisStore(client, prefix) if hasattr(client, "get_primaries") else RedisStore(client, prefix)
