"""Helpers of the end-to-end tests: run kvbus subcommands as real processes against the
real stack, each test with its own topics, consumer groups and Redis key prefix."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable

from confluent_kafka import Producer

from kvbus.children import Children
from kvbus.runtime.settings import Settings
from kvbus.schemas.events import EventBatch, holder_key
from kvbus.schemas.serde import RecordSerde, registry_client
from tests.waiting import (
    Waiting,  # noqa: F401  (the checks' return value, re-exported)
    eventually as _eventually,
)


def env_for(settings: Settings) -> dict[str, str]:
    """Environment that points a kvbus process at ``settings`` (services and topic names)."""
    return {**os.environ, **settings.to_env()}


class Pipeline:
    """kvbus subcommands started as processes (``kvbus.children.Children``, as the demo does);
    ``stop()`` ends them all."""

    def __init__(self, settings: Settings, workdir: Path) -> None:
        self.settings = settings
        self.children = Children(log_dir=workdir, env=env_for(settings), log_prefix="")

    def start(self, name: str, *args: str, env: dict[str, str] | None = None) -> None:
        """Start ``python -m kvbus <args>`` with output to ``<workdir>/<name>.log``; ``env``: variables
        laid over the pipeline's for this process."""
        self.children.start(name, *args, env=env)

    def stop(self) -> None:
        """SIGTERM every process, SIGKILL what is left."""
        self.children.stop_all()

    def check_alive(self) -> None:
        """Fail with the log of any process that exited."""
        report = self.children.stopped_report(tail=4000)
        if report:
            raise AssertionError(report)

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
    """:func:`tests.waiting.eventually`, failing at once if a process of ``pipeline`` died."""
    return _eventually(check, timeout, interval=interval,
                       alive=pipeline.check_alive if pipeline is not None else None)


class RawProducer:
    """Writes EventBatch records to the raw topic as a bridge would (keyed by holder), for tests
    that need exact raw input."""

    def __init__(self, settings: Settings):
        self.topic = settings.topics.raw
        self.serde = RecordSerde(registry_client(settings.registry_url), "EventBatch")
        self.producer = Producer({"bootstrap.servers": settings.bootstrap, "enable.idempotence": True,
                                  "linger.ms": 5})

    def send(self, b: EventBatch) -> None:
        """Queue one batch."""
        self.producer.produce(self.topic, self.serde.dumps(b, self.topic), holder_key(b.replica, b.dp_rank).encode())
        self.producer.poll(0)

    def send_raw(self, key: bytes, value: bytes) -> None:
        """Queue raw bytes (bad input)."""
        self.producer.produce(self.topic, value, key)

    def flush(self) -> None:
        """Wait until everything queued is acknowledged."""
        assert self.producer.flush(30) == 0
