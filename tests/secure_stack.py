"""Helpers of the secured-stack tests: a secured stack of the tests' own (state directory, free
ports) through the same code as ``infra/stack up --secure``, and clients of one principal with
short timeouts and errors collected instead of logged."""
from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

from confluent_kafka import Consumer, KafkaError, Producer

from kvbus.children import free_port_block
from kvbus.infra import secure
from kvbus.infra.stack_env import read_env_file

QUIET = logging.getLogger("tests.secure.librdkafka")
QUIET.propagate = False
QUIET.addHandler(logging.NullHandler())


@contextlib.contextmanager
def secured(root: Path) -> Iterator[secure.SecureLayout]:
    """A secured stack under ``root`` on six free ports, up for the duration (down after unless
    ``KVBUS_KEEP_STACK=1``)."""
    layout = secure.SecureLayout(root, secure.SecurePorts.from_base(free_port_block(6)))
    try:
        secure.up(layout)
        yield layout
    finally:
        if os.environ.get("KVBUS_KEEP_STACK") != "1":
            secure.down(layout)


class Errors:
    """librdkafka's error callback: the errors it reported, for a test to wait on."""

    def __init__(self) -> None:
        self.seen: list[KafkaError] = []

    def __call__(self, err: KafkaError) -> None:
        self.seen.append(err)

    def codes(self) -> set[int]:
        return {e.code() for e in self.seen}


def kafka_conf(layout: secure.SecureLayout, principal: str, errors: Errors | None = None,
               **conf: Any) -> dict[str, Any]:
    """librdkafka configuration of ``principal`` on the secured listener (``conf`` last)."""
    out: dict[str, Any] = {"bootstrap.servers": layout.bootstrap, **secure.admin_conf(layout, principal),
                           "logger": QUIET, "socket.connection.setup.timeout.ms": 5000}
    if errors is not None:
        out["error_cb"] = errors
    return {**out, **conf}


def produce_one(conf: dict[str, Any], topic: str, value: bytes = b"x", timeout: float = 20.0,
                key: bytes | None = None) -> KafkaError | None:
    """Produce one record and wait for its delivery report: ``None`` if delivered, else its error."""
    reports: list[KafkaError | None] = []
    p = Producer({**conf, "message.timeout.ms": int(timeout * 1000)})
    p.produce(topic, value, key=key, on_delivery=lambda err, msg: reports.append(err))
    p.flush(timeout + 5)
    assert reports, f"no delivery report for {topic} within {timeout + 5:.0f}s"
    return reports[0]


def first_message(consumer: Consumer, timeout: float = 20.0) -> Any:
    """The first message or error event the consumer polls within ``timeout`` (None if none)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        msg = consumer.poll(0.5)
        if msg is not None:
            return msg
    return None


def wait_for(check: Callable[[], bool], timeout: float, poll: Callable[[], object] | None = None) -> bool:
    """Poll ``check`` (calling ``poll`` between checks, e.g. a client's ``poll(0.2)``) until it is
    true or ``timeout`` seconds passed; returns the last result."""
    deadline = time.monotonic() + timeout
    while True:
        if check():
            return True
        if time.monotonic() > deadline:
            return False
        if poll is not None:
            poll()
        else:
            time.sleep(0.1)


def principal_env(layout: secure.SecureLayout, principal: str, **extra: str) -> dict[str, str]:
    """This process's environment without any ``KVBUS_*`` variable (a developer's exports of the
    open stack must not leak in), plus ``principal``'s env file and ``extra``."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("KVBUS_")}
    return {**base, **read_env_file(layout.env_file(principal)), **extra}


class StagePipeline:
    """kvbus subcommands as processes, each run as a principal with that principal's env file
    (``kvbus.children.Children`` per principal, as tests.pipeline.Pipeline does for the open stack)."""

    def __init__(self, layout: secure.SecureLayout, workdir: Path) -> None:
        self.layout = layout
        self.workdir = workdir
        self.children: dict[str, Any] = {}

    def start(self, name: str, principal: str, *args: str) -> None:
        """Start ``python -m kvbus <args>`` as ``principal``; output in ``<workdir>/<name>.log``."""
        from kvbus.children import Children

        if principal not in self.children:
            self.children[principal] = Children(log_dir=self.workdir, env=principal_env(self.layout, principal),
                                                log_prefix="")
        self.children[principal].start(name, *args)

    def check_alive(self) -> None:
        """Fail with the log of any process that exited."""
        for children in self.children.values():
            report = children.stopped_report(tail=4000)
            if report:
                raise AssertionError(report)

    def stop(self) -> None:
        """SIGTERM every process, SIGKILL what is left."""
        for children in self.children.values():
            children.stop_all()

    def run(self, principal: str, *args: str, timeout: float = 60.0, **extra: str) -> Any:
        """``python -m kvbus <args>`` as ``principal`` to completion: the CompletedProcess."""
        import subprocess
        import sys

        return subprocess.run([sys.executable, "-m", "kvbus", *args],
                              env=principal_env(self.layout, principal, **extra),
                              capture_output=True, text=True, timeout=timeout)

    def watch(self, principal: str, args: tuple[str, ...], needle: str | None, timeout: float,
              **extra: str) -> tuple[int | None, str]:
        """Run ``python -m kvbus <args>`` as ``principal`` until its output contains ``needle`` (None:
        until it exits), it exits, or ``timeout`` seconds pass (then it is stopped):
        ``(exit code or None, output)``."""
        import subprocess
        import sys

        log_path = self.workdir / f"watch-{principal}-{args[0]}-{time.monotonic_ns()}.log"
        with open(log_path, "wb") as out:
            proc = subprocess.Popen([sys.executable, "-m", "kvbus", *args], stdout=out, stderr=subprocess.STDOUT,
                                    env=principal_env(self.layout, principal, **extra), start_new_session=True)
        try:
            wait_for(lambda: proc.poll() is not None
                     or (needle is not None and needle in log_path.read_text(errors="replace")), timeout)
        finally:
            code = proc.poll()
            if code is None:  # only its output matters now
                proc.kill()
                proc.wait(10)
        return code, log_path.read_text(errors="replace")
