"""A throw-away ``redis-server`` for tests and benchmarks (a private Redis they may kill and restart)."""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from typing import Sequence

import redis

from kvbus.procs import free_port

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"


class RedisServer:
    """A throw-away ``redis-server`` on a free loopback port, no persistence, in a temp dir.

    Use as a context manager; ``url`` is its URL. ``args`` are extra server arguments
    (e.g. ``["--maxmemory", "4gb"]``, ``["--replicaof", "127.0.0.1", "6379"]``).
    """

    def __init__(self, args: Sequence[str] = ()):
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="kvbus-redis-")
        self.args = list(args)
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self, **kw) -> redis.Redis:
        """A client of this server."""
        return redis.Redis(host="127.0.0.1", port=self.port, **kw)

    def start(self) -> "RedisServer":
        cmd = [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
               "--dir", self.dir, "--logfile", os.path.join(self.dir, "redis.log"), *self.args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 10
        while True:
            try:
                if self.client().ping():
                    return self
            except redis.ConnectionError:
                if self.proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError(f"redis-server did not start: {cmd}")
                time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL the server, keeping its directory (``start`` again restarts it on the same port,
        loading whatever it persisted there: an RDB saved with SAVE, an AOF)."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "RedisServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def main_thread_cpu(r: redis.Redis) -> float:
    """CPU seconds the server's main thread has used (``INFO cpu``: user + sys of the main thread).

    Unlike ``INFO commandstats`` usec, which is wall time inside a command and grows whenever the
    server is descheduled, this counts only the work done: the figure to compare when several
    servers and the client share this machine's two cores."""
    info = r.info("cpu")
    return float(info["used_cpu_user_main_thread"]) + float(info["used_cpu_sys_main_thread"])


def wait_replica_synced(replica: redis.Redis, timeout: float = 30.0) -> None:
    """Wait until ``replica`` reports its link to its master up (first sync done)."""
    deadline = time.time() + timeout
    while replica.info("replication").get("master_link_status") != "up":
        if time.time() > deadline:
            raise RuntimeError("the replica did not finish its first sync")
        time.sleep(0.05)

