"""Child processes of the demo: start ``kvbus`` subcommands, log to files, stop them all."""
from __future__ import annotations

import logging
import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("kvbus.demo")


@dataclass
class Child:
    """One started subcommand."""

    name: str
    """Display name (fleet, bridge-0, worker, sink)."""
    proc: subprocess.Popen
    """The process (leader of its own session, so its children stop with it)."""
    log_path: Path
    """Where its stdout/stderr go."""
    args: tuple[str, ...] = ()
    """Its ``kvbus`` arguments (what :meth:`Children.start` was given: a restart reuses them)."""


@dataclass
class Children:
    """Every process the demo started, stopped in reverse order of start."""

    log_dir: Path
    env: dict[str, str] = field(default_factory=lambda: dict(os.environ))
    log_prefix: str = "demo-"
    """Log files are ``<log_dir>/<log_prefix><name>.log``."""
    started: list[Child] = field(default_factory=list)

    def start(self, name: str, *args: str, env: dict[str, str] | None = None) -> Child:
        """Run ``python -m kvbus <args>`` in the background, output to ``<log_dir>/<log_prefix><name>.log``;
        ``env``: variables laid over :attr:`env` for this child (e.g. its principal's settings)."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        path = self.log_dir / f"{self.log_prefix}{name}.log"
        out = open(path, "ab")
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvbus", *args],
            stdout=out, stderr=subprocess.STDOUT, env={**self.env, **(env or {})}, start_new_session=True,
        )
        out.close()
        child = Child(name, proc, path, tuple(args))
        self.started.append(child)
        log.info("started %s (pid %d, log %s)", name, proc.pid, path)
        return child

    def dead(self) -> list[Child]:
        """Children that exited on their own."""
        return [c for c in self.started if c.proc.poll() is not None]

    def stopped_report(self, *, ignore: tuple[str, ...] = (), tail: int = 0) -> str | None:
        """None while every child (but those named in ``ignore``) runs; else one line per child that
        exited: name, exit code and log path, followed by the last ``tail`` characters of its log."""
        lines = []
        for c in self.dead():
            if c.name in ignore:
                continue
            lines.append(f"{c.name} exited with {c.proc.returncode} (log {c.log_path})")
            if tail:
                lines.append(c.log_path.read_text(errors="replace")[-tail:])
        return "\n".join(lines) or None

    def stop(self, child: Child, timeout: float = 15.0) -> None:
        """SIGTERM one child's process group, SIGKILL after ``timeout`` seconds."""
        if child.proc.poll() is None:
            try:
                os.killpg(child.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                child.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop in %.0fs: killing", child.name, timeout)
                os.killpg(child.proc.pid, signal.SIGKILL)
                child.proc.wait()
        try:  # anything the child left in its group
            os.killpg(child.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def stop_all(self) -> None:
        """Stop every child, newest first."""
        for child in reversed(self.started):
            self.stop(child)
        self.started.clear()


def wait_for(predicate, timeout: float, interval: float = 0.5) -> bool:
    """Poll ``predicate()`` until true or ``timeout`` seconds pass; returns the last result."""
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now, for a process to bind a moment later
    (:func:`free_port_block` of one port: below the ephemeral range, never one this process handed out)."""
    return free_port_block(1)


_HANDED_OUT: dict[int, float] = {}
"""Port -> when :func:`free_port_block` returned it in this process (``time.monotonic()``): free when
checked and bound a moment later by a child, so no search returns it again for
:data:`HANDED_OUT_FOR` seconds."""

HANDED_OUT_FOR = 120.0
"""Seconds a port handed out stays reserved in this process (a child binds well within them)."""


def free_port_block(n: int, start: int = 21000, stop: int = 32000) -> int:
    """A base port with ``n`` consecutive ports free after it (a fleet binds base..base+n-1; a
    Kafka node its port and port + 1). Searched below Linux's ephemeral range (32768-60999), where
    an outgoing connection could take a port between the check and the bind, in random order: two
    processes searching at once (a benchmark and a test run) once both took the first free block.
    Never the OS's pick for port 0: that is an ephemeral port, which any of the many outgoing Kafka
    connections of a run can take between the check and the child's bind."""
    now = time.monotonic()
    for port in [p for p, at in _HANDED_OUT.items() if now - at > HANDED_OUT_FOR]:
        del _HANDED_OUT[port]
    bases = list(range(start, stop - n, n))
    random.shuffle(bases)
    for base in bases:
        if any(port in _HANDED_OUT for port in range(base, base + n)):
            continue
        socks = []
        try:
            for port in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            _HANDED_OUT.update(dict.fromkeys(range(base, base + n), now))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports in {start}-{stop}")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds process ``pid`` has used so far (all its threads), from
    ``/proc/<pid>/stat``; 0.0 if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except OSError:
        return 0.0
    # after "(comm)": state is field 3, utime and stime are fields 14 and 15 of the full line
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
