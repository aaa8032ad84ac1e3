"""A Redis Cluster on loopback from Debian's ``redis-server``: ``infra/stack up --redis-cluster N``.

``N`` masters and ``N`` replicas (one per master), each a ``redis-server --cluster-enabled yes``
on ports ``base .. base + 2N - 1`` (masters first; the cluster bus on port + 10000), joined by
``redis-cli --cluster create ... --cluster-replicas 1 --cluster-yes``. Base port:
``$KVBUS_REDIS_CLUSTER_PORT`` (default 7000). Pid files ``run/redis-cluster-<port>.pid``, logs
``logs/redis-cluster-<port>.log``, data (``nodes.conf``) ``data/redis-cluster/<port>``, all under
the state directory; ``down`` stops them by those pid files like every other service.

Ready = every node answers ``CLUSTER INFO`` with ``cluster_state:ok`` and all 16384 slots assigned,
and ``CLUSTER NODES`` shows ``N`` masters each with a replica.

The URL kvbus commands take (``KVBUS_REDIS_URL``) for a cluster names its seed nodes:
``redis+cluster://127.0.0.1:7000,127.0.0.1:7001,127.0.0.1:7002/0`` (masters of this stack; any
reachable subset works: the client discovers the rest). See :func:`cluster_url`.

The stack's cluster runs Redis; :func:`plan` with ``kind=VALKEY`` makes the same cluster of
``valkey-server`` nodes (the tests run the store contract on both; Debian's ``redis-cli`` 7.0 forms
a Valkey 9.1 cluster the same way).
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import redis_server, tools
from .procs import PidRecord, ServiceError, alive_record, port_open, start_process, wait_until
from .redis_server import REDIS, ServerKind
from .stack_env import LOOPBACK, REDIS_CLUSTER_PORT, Paths, RedisSettings

log = logging.getLogger("infra")

SLOTS = 16384
PREFIX = "redis-cluster-"
URL_SCHEME = "redis+cluster"
NODE_TIMEOUT_MS = 2000
START_TIMEOUT = 60.0


def base_port() -> int:
    return REDIS_CLUSTER_PORT.read(os.environ)


@dataclass(frozen=True)
class ClusterNode:
    port: int
    master: bool
    host: str = LOOPBACK
    #: the server program the node runs (Redis, or Valkey)
    kind: ServerKind = REDIS

    @property
    def name(self) -> str:
        return f"{PREFIX}{self.port}"

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def pid_path(self, paths: Paths) -> Path:
        return paths.run / f"{self.name}.pid"

    def log_path(self, paths: Paths) -> Path:
        return paths.logs / f"{self.name}.log"

    def data(self, paths: Paths) -> Path:
        return paths.data / "redis-cluster" / str(self.port)


def plan(masters: int, base: int | None = None, kind: ServerKind = REDIS) -> list[ClusterNode]:
    """The nodes of an ``masters``-master cluster of ``kind`` servers (masters first, then one replica each)."""
    if masters < 3:
        raise ServiceError(f"a Redis Cluster needs at least 3 masters (got {masters})")
    b = base_port() if base is None else base
    return [ClusterNode(b + i, i < masters, kind=kind) for i in range(2 * masters)]


def cluster_url(nodes: list[ClusterNode]) -> str:
    """``redis+cluster://h:p,h:p,.../0``: the masters as seed nodes."""
    return f"{URL_SCHEME}://" + ",".join(n.address for n in nodes if n.master) + "/0"


def _cli() -> str:
    """``redis-cli`` (Debian's ``redis-tools``, installed with ``redis-server``)."""
    path = shutil.which("redis-cli")
    return path or tools.ensure_command("redis-cli", ["redis-tools"])


def _client(node: ClusterNode) -> Any:
    return redis_server.require_client().Redis(host=node.host, port=node.port,
                                               socket_connect_timeout=1, socket_timeout=2)


def cluster_info(node: ClusterNode) -> dict[str, str]:
    """``CLUSTER INFO`` of one node as a dict ({} if it does not answer)."""
    try:
        with _client(node) as r:
            raw = r.execute_command("CLUSTER", "INFO")  # two words: redis-py leaves the reply unparsed
    except Exception:  # noqa: BLE001
        return {}
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    return dict(line.split(":", 1) for line in text.strip().splitlines() if ":" in line)


def _roles(node: ClusterNode) -> tuple[int, int]:
    """(masters with slots, replicas) in the node's ``CLUSTER NODES``."""
    with _client(node) as r:
        raw = r.execute_command("CLUSTER", "NODES")
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    masters = replicas = 0
    for line in text.strip().splitlines():
        parts = line.split()
        if "fail" in parts[2].split(",") or "fail?" in parts[2].split(","):
            continue
        if "master" in parts[2] and len(parts) > 8:
            masters += 1
        elif "slave" in parts[2]:
            replicas += 1
    return masters, replicas


def node_ready(node: ClusterNode) -> bool:
    info = cluster_info(node)
    return info.get("cluster_state") == "ok" and info.get("cluster_slots_assigned") == str(SLOTS)


def ready(nodes: list[ClusterNode]) -> bool:
    """Every node says ``cluster_state:ok`` with all slots assigned, and the first sees every
    master with its replica."""
    if not all(node_ready(n) for n in nodes):
        return False
    masters = sum(n.master for n in nodes)
    return _roles(nodes[0]) == (masters, len(nodes) - masters)


def running(paths: Paths, nodes: list[ClusterNode]) -> dict[str, PidRecord]:
    """Our live cluster nodes by name."""
    out = {}
    for n in nodes:
        rec = alive_record(n.pid_path(paths))
        if rec is not None:
            out[n.name] = rec
    return out


def running_ports(paths: Paths) -> list[int]:
    """Ports of the cluster nodes this state directory has alive (any size)."""
    ports = []
    for pf in sorted(paths.run.glob(f"{PREFIX}*.pid")) if paths.run.is_dir() else []:
        if alive_record(pf) is not None:
            ports.append(int(pf.stem[len(PREFIX):]))
    return sorted(ports)


def server_argv(node: ClusterNode, paths: Paths) -> list[str]:
    """The node's server command line: :func:`kvbus.infra.redis_server.server_argv` in cluster mode."""
    rs = RedisSettings(f"redis://{node.address}/0", node.host, node.port)
    return [*redis_server.server_argv(rs, node.data(paths), kind=node.kind), "--cluster-enabled", "yes",
            "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", str(NODE_TIMEOUT_MS)]


def start(paths: Paths, nodes: list[ClusterNode], *, timeout: float = START_TIMEOUT) -> list[PidRecord]:
    """Start the nodes that are not running and form the cluster unless it is formed already.

    Returns the records of the processes started. A node's port (or its bus port) taken by
    something else fails with :class:`ServiceError`.
    """
    live = running(paths, nodes)
    if len(live) == len(nodes) and ready(nodes):
        return []
    new: list[PidRecord] = []
    fresh = not live
    for n in nodes:
        if n.name in live:
            continue
        for p in (n.port, n.port + 10000):
            if port_open(n.host, p):
                raise ServiceError(f"redis cluster: port {p} is in use; free it or set KVBUS_REDIS_CLUSTER_PORT")
        d = n.data(paths)
        if fresh and d.exists():
            shutil.rmtree(d)  # a new cluster: forget a previous one's nodes.conf
        d.mkdir(parents=True, exist_ok=True)
        new.append(start_process(n.name, server_argv(n, paths), pid_path=n.pid_path(paths),
                                 log_path=n.log_path(paths), marker=n.address, cwd=d))
    for n in nodes:
        wait_until(n.name, lambda n=n: bool(_client(n).ping()), timeout=timeout,
                   records=[r for r in new if r.name == n.name], log=n.log_path(paths), interval=0.05)
    if fresh or cluster_info(nodes[0]).get("cluster_slots_assigned") == "0":
        masters = [n for n in nodes if n.master]
        argv = [_cli(), "--cluster", "create", *(n.address for n in masters),
                *(n.address for n in nodes if not n.master), "--cluster-replicas", "1", "--cluster-yes"]
        res = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
        if res.returncode != 0:
            raise ServiceError(f"redis cluster: {' '.join(argv)} failed ({res.returncode}):\n{res.stdout}{res.stderr}")
    wait_until(f"redis cluster ({sum(n.master for n in nodes)} masters)", lambda: ready(nodes), timeout=timeout,
               records=new, log=nodes[0].log_path(paths), interval=0.1)
    return new


def status(paths: Paths, nodes: list[ClusterNode]) -> dict[str, dict[str, Any]]:
    live = running(paths, nodes)
    out = {}
    for n in nodes:
        rec = live.get(n.name)
        out[n.name] = {
            "pid": rec.pid if rec else None,
            "address": n.address,
            "role": "master" if n.master else "replica",
            "running": rec is not None,
            "ready": rec is not None and node_ready(n),
            "log": str(n.log_path(paths)),
        }
    return out


def stop(paths: Paths, nodes: list[ClusterNode], timeout: float = 30.0) -> dict[str, str]:
    """Stop the nodes of ``nodes`` we started (by their pid files)."""
    from .procs import read_pid, stop_many

    items = [(rec, n.pid_path(paths)) for n in nodes if (rec := read_pid(n.pid_path(paths))) is not None]
    return stop_many(items, timeout=timeout)


def _bindable(port: int) -> bool:
    import socket

    with socket.socket() as s:
        try:
            s.bind((LOOPBACK, port))
            return True
        except OSError:
            return False


def free_base_port(masters: int, lo: int = 10000, hi: int = 22000) -> int:
    """A base port such that the ``2 * masters`` node ports and their bus ports (+10000) are free now
    (all below 32768: Linux's ephemeral ports start there, and an outgoing connection may hold one)."""
    import random

    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(lo, hi - 2 * masters)
        ports = [q for p in range(base, base + 2 * masters) for q in (p, p + 10000)]
        if all(_bindable(q) for q in ports):
            return base
    raise ServiceError(f"no free run of {2 * masters} ports in {lo}..{hi}")
