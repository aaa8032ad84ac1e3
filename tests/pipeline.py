"""Helpers of the end-to-end tests: run kvbus subcommands as real processes against the
real stack, each test with its own topics, consumer groups and Redis key prefix."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from schemas.settings import Settings


def env_for(settings: Settings) -> dict[str, str]:
    """Environment that points a kvbus process at ``settings`` (services and topic names)."""
    t = settings.topics
    return {
        **os.environ,
        "KVBUS_BOOTSTRAP": settings.bootstrap,
        "KVBUS_REGISTRY_URL": settings.registry_url,
        "KVBUS_REDIS_URL": settings.redis_url,
        "KVBUS_PARTITIONS": str(settings.partitions),
        "KVBUS_TOPIC_RAW": t.raw,
        "KVBUS_TOPIC_BLOCKS": t.blocks,
        "KVBUS_TOPIC_INCOMPLETE": t.incomplete,
        "KVBUS_TOPIC_DLQ": t.dlq,
    }


@dataclass
class Pipeline:
    """kvbus subcommands started as processes; ``stop()`` ends them all."""

    settings: Settings
    workdir: Path
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    def start(self, name: str, *args: str) -> subprocess.Popen:
        """Start ``python -m kvbus <args>`` with output to ``<workdir>/<name>.log``."""
        log = open(self.workdir / f"{name}.log", "ab")
        p = subprocess.Popen([sys.executable, "-m", "kvbus", *args], stdout=log, stderr=subprocess.STDOUT,
                             env=env_for(self.settings), start_new_session=True)
        log.close()
        self.procs[name] = p
        return p

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to one process group and wait for it."""
        p = self.procs.pop(name)
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            pass
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()

    def stop(self) -> None:
        """SIGTERM every process, SIGKILL what is left."""
        for name in list(self.procs):
            self.kill(name, signal.SIGTERM)

    def log(self, name: str) -> str:
        """What a process printed so far (for assertion messages)."""
        path = self.workdir / f"{name}.log"
        return path.read_text(errors="replace")[-4000:] if path.exists() else ""

    def check_alive(self) -> None:
        """Fail with the log of any process that exited."""
        for name, p in self.procs.items():
            if p.poll() is not None:
                raise AssertionError(f"{name} exited with {p.returncode}:\n{self.log(name)}")

    def lookup_json(self, *args: str, check: bool = True) -> dict | str:
        """``kvbus lookup --json <args>`` as a process; its parsed output (with ``check=False``,
        its error output instead of failing when it exits non-zero)."""
        out = subprocess.run([sys.executable, "-m", "kvbus", "lookup", "--json", *args], env=env_for(self.settings),
                             capture_output=True, text=True, timeout=60)
        if out.returncode != 0 and not check:
            return out.stderr
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout.strip().splitlines()[-1])


def eventually(check: Callable[[], object], timeout: float, pipeline: Pipeline | None = None,
               interval: float = 0.5) -> object:
    """Poll ``check()`` until it returns a truthy value; fail after ``timeout`` seconds with its last value."""
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        if pipeline is not None:
            pipeline.check_alive()
        last = check()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"not reached in {timeout}s; last value: {last!r}")
