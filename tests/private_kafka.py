"""A throw-away single-node Kafka broker for tests that kill Kafka or need a fresh cluster."""
from __future__ import annotations

import os
import signal

from kvbus.children import free_port_block
from tests.waiting import eventually


class PrivateKafka:
    """A throw-away 1-node KRaft broker (kvbus.infra.kafka_broker) in its own state dir and ports,
    so the test can kill it without touching the shared stack. Only pids it started are killed."""

    def __init__(self, root, monkeypatch) -> None:
        from kvbus.infra import kafka_broker
        from kvbus.infra.stack_env import Paths

        shared_libs = Paths().kafka_libs
        assert shared_libs.is_dir(), "the shared stack's Kafka jars are needed (infra/stack up)"
        self.paths = Paths(root=root).ensure()
        (self.paths.root / "kafka").mkdir(parents=True, exist_ok=True)
        (self.paths.root / "kafka" / "libs").symlink_to(shared_libs)
        port = free_port_block(2)
        monkeypatch.setenv("KVBUS_BOOTSTRAP", f"127.0.0.1:{port}")
        self.kb = kafka_broker
        self.nodes = kafka_broker.plan(self.paths, 1)
        self.bootstrap = kafka_broker.bootstrap(self.nodes)
        self.pids: list[int] = []

    def up(self, timeout: float = 90.0) -> None:
        for rec in self.kb.start(self.paths, self.nodes):
            self.pids.append(rec.pid)
        ready = self.kb.Readiness(self.nodes)

        def probe() -> bool:
            try:
                return ready()
            except Exception:
                return False

        eventually(probe, timeout, what="the private Kafka broker ready (kafka_broker.Readiness)", interval=0.05)

    def kill(self) -> None:
        for pid in self.pids:
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
        self.pids.clear()
