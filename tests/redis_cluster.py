"""A throw-away Redis Cluster for tests and benchmarks, started by the project's own infra code
(:mod:`infra.redis_cluster`, what ``infra/stack up --redis-cluster 3`` runs) in its own state
directory, on free ports."""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import redis
from redis.cluster import ClusterNode as PyClusterNode, RedisCluster

from infra import redis_cluster
from infra.settings import Paths


class RedisClusterServer:
    """``masters`` masters + one replica each; a context manager. ``url`` is its ``redis+cluster://`` URL."""

    def __init__(self, masters: int = 3):
        self.masters = masters
        self.root = Path(tempfile.mkdtemp(prefix="kvbus-rcluster-"))
        self.paths = Paths(self.root).ensure()
        self.nodes = redis_cluster.plan(masters, redis_cluster.free_base_port(masters))

    @property
    def url(self) -> str:
        return redis_cluster.cluster_url(self.nodes)

    def client(self, **kw) -> RedisCluster:
        return RedisCluster(startup_nodes=[PyClusterNode(n.host, n.port) for n in self.nodes if n.master], **kw)

    def node_client(self, port: int) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=port)

    def start(self) -> "RedisClusterServer":
        redis_cluster.start(self.paths, self.nodes, timeout=60)
        return self

    def stop(self) -> None:
        redis_cluster.stop(self.paths, self.nodes)
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> "RedisClusterServer":
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()
