"""A throw-away Redis-protocol server for the tests and the benchmarks (a private Redis, or Valkey, they may kill
and restart), started with the stack's own command line (:func:`kvbus.infra.redis_server.server_argv`)."""
from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Sequence

import redis

from kvbus.children import free_port
from kvbus.infra.redis_server import REDIS, VALKEY, ServerKind, server_argv
from kvbus.infra.stack_env import RedisSettings

__all__ = ["REDIS", "VALKEY", "RedisServer", "main_thread_cpu", "wait_replica_synced"]


class RedisServer:
    """A throw-away server of ``kind`` (Debian's ``redis-server`` by default, ``VALKEY`` for Valkey) on a
    free loopback port, no persistence, in a temp dir (its log there too).

    Use as a context manager; ``url`` is its URL. ``args`` are extra server arguments
    (e.g. ``["--maxmemory", "4gb"]``, ``["--replicaof", "127.0.0.1", "6379"]``).
    """

    def __init__(self, args: Sequence[str] = (), kind: ServerKind = REDIS):
        self.port = free_port()
        self.kind = kind
        self.dir = tempfile.mkdtemp(prefix=f"kvbus-{kind.name}-")
        self.args = list(args)
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self, **kw) -> redis.Redis:
        """A client of this server."""
        return redis.Redis(host="127.0.0.1", port=self.port, **kw)

    def start(self) -> "RedisServer":
        rs = RedisSettings(self.url, "127.0.0.1", self.port)
        cmd = [*server_argv(rs, Path(self.dir), kind=self.kind), *self.args]
        with open(Path(self.dir) / f"{self.kind.name}.log", "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.time() + 10
        while True:
            try:
                if self.client().ping():
                    return self
            except redis.ConnectionError:
                if self.proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError(f"{self.kind.name} did not start: {cmd}; its log: {self.log_tail()}")
                time.sleep(0.05)

    def log_tail(self, chars: int = 2000) -> str:
        """The end of the server's log."""
        try:
            return (Path(self.dir) / f"{self.kind.name}.log").read_text(errors="replace")[-chars:]
        except OSError:
            return ""

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

