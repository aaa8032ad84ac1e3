"""Background processes tracked by pid files: start, identify, wait for, stop.

A pid file is JSON: ``{"name", "pid", "starttime", "marker", "argv", "log", "started_at"}``.
A process counts as *ours* only while ``/proc/<pid>`` exists, is not a zombie,
has the same kernel start time as recorded (guards against pid reuse) and its
command line contains ``marker``. Nothing here ever signals a process that is
not ours; nothing looks processes up by name.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

LOG_TAIL_LINES = 40


class ServiceError(RuntimeError):
    """A service failed to start, become ready or stop."""


@dataclass
class PidRecord:
    """What we remember about a process we started."""

    name: str
    pid: int
    starttime: int
    marker: str
    argv: list[str] = field(default_factory=list)
    log: str = ""
    started_at: float = 0.0

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)


def _stat_fields(pid: int) -> list[str] | None:
    """Fields of ``/proc/<pid>/stat`` after the ``(comm)``; ``None`` if gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # comm may contain spaces/parens: split after the last ')'
    return raw[raw.rfind(")") + 2 :].split()


def proc_starttime(pid: int) -> int | None:
    """Kernel start time (clock ticks since boot) of a live, non-zombie ``pid``."""
    fields = _stat_fields(pid)
    if not fields or fields[0] in ("Z", "X"):
        return None
    return int(fields[19])  # field 22 overall; index 19 after state


def proc_age(pid: int) -> float | None:
    """Seconds since a live, non-zombie ``pid`` started (None otherwise)."""
    start = proc_starttime(pid)
    if start is None:
        return None
    uptime = float(Path("/proc/uptime").read_text().split()[0])
    return max(0.0, uptime - start / os.sysconf("SC_CLK_TCK"))


def proc_cmdline(pid: int) -> str:
    """Command line of ``pid`` with NULs replaced by spaces ('' if unreadable)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def proc_rss_kib(pid: int) -> int | None:
    """Resident set size of ``pid`` in KiB, or ``None``."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def read_pid(path: Path) -> PidRecord | None:
    """Load a pid file; ``None`` if missing or unreadable."""
    try:
        data = json.loads(path.read_text())
        return PidRecord(**data)
    except (OSError, ValueError, TypeError):
        return None


def is_ours(rec: PidRecord | None) -> bool:
    """True if ``rec`` describes a live process that we started."""
    if rec is None:
        return False
    st = proc_starttime(rec.pid)
    if st is None or st != rec.starttime:
        return False
    return rec.marker in proc_cmdline(rec.pid)


def alive_record(path: Path) -> PidRecord | None:
    """The pid record at ``path`` if its process is alive and ours; else ``None``.

    A stale pid file (process gone or pid reused) is removed.
    """
    rec = read_pid(path)
    if rec is None:
        return None
    if is_ours(rec):
        return rec
    _reap(rec.pid)
    path.unlink(missing_ok=True)
    return None


def _rotate(log: Path, keep_bytes: int = 20 * 1024 * 1024) -> None:
    """Keep one previous log (``.1``) once it grows past ``keep_bytes``."""
    try:
        if log.stat().st_size > keep_bytes:
            log.replace(log.with_suffix(log.suffix + ".1"))
    except FileNotFoundError:
        pass


def start_process(
    name: str,
    argv: Sequence[str],
    *,
    pid_path: Path,
    log_path: Path,
    marker: str,
    cwd: Path | None = None,
    env: Mapping[str, str] | None = None,
) -> PidRecord:
    """Start ``argv`` detached (own session, stdin /dev/null, output appended to ``log_path``).

    The pid record is written to ``pid_path`` before returning.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    pid_path.parent.mkdir(parents=True, exist_ok=True)
    _rotate(log_path)
    with open(log_path, "ab", buffering=0) as log:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        log.write(f"\n===== {stamp} infra starts {name}: {' '.join(argv)}\n".encode())
        proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=str(cwd) if cwd else None,
            env=dict(env) if env is not None else None,
            start_new_session=True,
            close_fds=True,
        )
    # wait for the exec, not just the fork: until then /proc shows this Python's command line, and
    # a check in that window (e.g. up's running() right after start) took a starting node for a
    # stale pid file and deleted it (seen with three JVMs starting at once on a busy box)
    st = None
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline and proc.poll() is None:
        st = proc_starttime(proc.pid)
        if st is not None and marker in proc_cmdline(proc.pid):
            break
        time.sleep(0.01)
    if st is None:
        st = proc_starttime(proc.pid)
    rec = PidRecord(
        name=name,
        pid=proc.pid,
        starttime=st if st is not None else -1,
        marker=marker,
        argv=list(argv),
        log=str(log_path),
        started_at=time.time(),
    )
    tmp = pid_path.with_suffix(".tmp")
    tmp.write_text(rec.to_json())
    tmp.replace(pid_path)
    return rec


def _reap(pid: int) -> None:
    """Collect ``pid`` if it is an exited child of this process (no-op otherwise)."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except (ChildProcessError, OSError):
        pass


def _gone(rec: PidRecord) -> bool:
    _reap(rec.pid)
    st = proc_starttime(rec.pid)
    return st is None or st != rec.starttime


def stop_process(rec: PidRecord, *, pid_path: Path | None = None, timeout: float = 30.0) -> str:
    """Stop our process: SIGTERM, wait up to ``timeout`` s, then SIGKILL.

    Returns ``"not running"``, ``"stopped"`` or ``"killed"``. Removes ``pid_path``.
    """
    result = "not running"
    if is_ours(rec):
        try:
            os.kill(rec.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not _gone(rec):
            time.sleep(0.1)
        if _gone(rec):
            result = "stopped"
        else:
            try:
                os.kill(rec.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and not _gone(rec):
                time.sleep(0.05)
            if not _gone(rec):
                raise ServiceError(f"{rec.name}: pid {rec.pid} survived SIGKILL")
            result = "killed"
    if pid_path is not None:
        pid_path.unlink(missing_ok=True)
    return result


def stop_many(items: Sequence[tuple[PidRecord, Path]], *, timeout: float = 30.0) -> dict[str, str]:
    """Stop several of our processes concurrently (SIGTERM all, wait, SIGKILL stragglers)."""
    results: dict[str, str] = {}
    live = [(r, p) for r, p in items if is_ours(r)]
    for r, p in items:
        if (r, p) not in live:
            p.unlink(missing_ok=True)
            results[r.name] = "not running"
    for r, _ in live:
        try:
            os.kill(r.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not all(_gone(r) for r, _ in live):
        time.sleep(0.1)
    for r, p in live:
        results[r.name] = "stopped" if _gone(r) else stop_process(r, pid_path=p, timeout=0.0)
        p.unlink(missing_ok=True)
    return results


def tail(path: Path | str, lines: int = LOG_TAIL_LINES) -> str:
    """Last ``lines`` lines of a text file ('' if missing)."""
    try:
        with open(path, "r", errors="replace") as fh:
            return "".join(deque(fh, maxlen=lines))
    except OSError:
        return ""


def failure(service: str, reason: str, log: Path | str | None) -> ServiceError:
    """A :class:`ServiceError` naming ``service`` with the tail of its log."""
    msg = f"{service}: {reason}"
    if log:
        msg += f"\n----- last {LOG_TAIL_LINES} lines of {log} -----\n{tail(log).rstrip()}\n-----"
    return ServiceError(msg)


def wait_until(
    service: str,
    check: Callable[[], bool],
    *,
    timeout: float,
    records: Sequence[PidRecord] = (),
    log: Path | str | None = None,
    interval: float = 0.2,
) -> float:
    """Poll ``check()`` until true; fail early if any of ``records`` died.

    Returns the seconds waited. Raises :class:`ServiceError` (with a log tail) on timeout.
    """
    t0 = time.monotonic()
    while True:
        try:
            if check():
                return time.monotonic() - t0
        except Exception:  # noqa: BLE001 - readiness probes may fail in any way while starting
            pass
        for rec in records:
            if _gone(rec):
                raise failure(service, f"process {rec.pid} exited during startup", rec.log or log)
        if time.monotonic() - t0 > timeout:
            raise failure(service, f"not ready after {timeout:.0f}s", log or (records[0].log if records else None))
        time.sleep(interval)


def port_open(host: str, port: int, timeout: float = 0.5) -> bool:
    """True if something accepts TCP connections on ``host:port``."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False
