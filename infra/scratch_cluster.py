"""A throw-away Redis Cluster (of Redis, or of Valkey) for tests and benchmarks, started by the project's
own infra code (:mod:`kvbus.infra.redis_cluster`, what ``infra/stack up --redis-cluster 3`` runs) in its
own state directory, on free ports."""
from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Sequence

import redis
from redis.cluster import ClusterNode as PyClusterNode, RedisCluster

from kvbus.infra import redis_cluster
from kvbus.infra.redis_server import REDIS, ServerKind
from kvbus.infra.scratch_redis import RedisServer
from kvbus.infra.stack_env import Paths


class RedisClusterServer:
    """``masters`` masters + one replica each, ``kind`` servers (Redis by default); a context manager.
    ``url`` is its ``redis+cluster://`` URL."""

    def __init__(self, masters: int = 3, kind: ServerKind = REDIS):
        self.masters = masters
        self.root = Path(tempfile.mkdtemp(prefix=f"kvbus-{kind.name}-cluster-"))
        self.paths = Paths(self.root).ensure()
        self.nodes = redis_cluster.plan(masters, redis_cluster.free_base_port(masters), kind)

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


class OneNodeCluster(RedisServer):
    """A single ``redis-server`` in cluster mode owning all 16384 slots, no replica: the cost of
    cluster mode itself (its per-key slot bookkeeping), next to a plain server, on the same calls."""

    def __init__(self, args: Sequence[str] = ()):
        super().__init__(args)
        self.port = redis_cluster.free_base_port(1)  # its bus port (+10000) must be free and valid too
        self.args += ["--cluster-enabled", "yes", "--cluster-config-file", os.path.join(self.dir, "nodes.conf")]

    def start(self) -> "OneNodeCluster":
        super().start()
        r = self.client()
        r.execute_command("CLUSTER", "ADDSLOTSRANGE", 0, 16383)
        deadline = time.time() + 10
        while b"cluster_state:ok" not in r.execute_command("CLUSTER", "INFO"):
            if time.time() > deadline:
                raise RuntimeError("the one-node cluster did not reach cluster_state:ok")
            time.sleep(0.05)
        return self

    def cluster_client(self, **kw) -> RedisCluster:
        return RedisCluster(startup_nodes=[PyClusterNode("127.0.0.1", self.port)], **kw)


def _replicas_caught_up(cluster: RedisClusterServer) -> bool:
    """Every replica's link is up and it has applied its master's whole replication stream."""
    offsets = {n.port: cluster.node_client(n.port).info("replication")["master_repl_offset"]
               for n in cluster.nodes if n.master}
    for n in cluster.nodes:
        if not n.master:
            info = cluster.node_client(n.port).info("replication")
            if info.get("master_link_status") != "up" or info["slave_repl_offset"] < offsets[info["master_port"]]:
                return False
    return True


def wait_replicas_in_sync(cluster: RedisClusterServer, client: RedisCluster | None = None,
                          timeout: float = 30.0) -> None:
    """Wait until every replica has caught up with its master and, if ``client`` is given, until its
    slot map lists a replica per master (replicas enter ``CLUSTER SLOTS`` once gossip has them; the
    client's map is re-read meanwhile)."""
    deadline = time.time() + timeout
    while not _replicas_caught_up(cluster) or (client is not None and len(client.get_replicas()) < cluster.masters):
        if time.time() > deadline:
            raise RuntimeError("the replicas did not catch up, or are not in the client's slot map")
        time.sleep(0.05)
        if client is not None:
            client.nodes_manager.initialize()
