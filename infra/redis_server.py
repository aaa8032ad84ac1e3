"""Redis (Debian's ``redis-server``, 7.x for FUNCTION LOAD) on ``KVBUS_REDIS_URL``'s port.

If something already answers PING there and we did not start it, it is reused as
*external* and never stopped by ``down``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from . import tools
from .procs import PidRecord, ServiceError, alive_record, port_open, start_process
from .settings import Paths, RedisSettings

log = logging.getLogger("infra")

NAME = "redis"
MIN_MAJOR = 7


def pid_path(paths: Paths) -> Path:
    return paths.run / "redis.pid"


def log_path(paths: Paths) -> Path:
    return paths.logs / "redis.log"


def binary() -> str:
    """Path of ``redis-server``, installing Debian's package if missing."""
    return tools.ensure_command("redis-server", ["redis-server"])


def require_client() -> Any:
    """The redis-py module; fails with an install hint if it is missing."""
    try:
        import redis
    except ImportError as exc:  # pragma: no cover
        raise ServiceError("redis (redis-py) is not importable; install it into the venv: .venv/bin/pip install redis") from exc
    return redis


def _client(rs: RedisSettings) -> Any:
    return require_client().Redis.from_url(rs.url, socket_connect_timeout=1, socket_timeout=2)


def ping(rs: RedisSettings) -> bool:
    """True if Redis at ``rs.url`` answers PING."""
    try:
        with _client(rs) as r:
            return bool(r.ping())
    except ServiceError:
        raise
    except Exception:  # noqa: BLE001
        return False


def server_version(rs: RedisSettings) -> str:
    """``redis_version`` from INFO server ('' if unreachable)."""
    try:
        with _client(rs) as r:
            return str(r.info("server").get("redis_version", ""))
    except Exception:  # noqa: BLE001
        return ""


def running(paths: Paths) -> PidRecord | None:
    """Our live redis-server, if any."""
    return alive_record(pid_path(paths))


def marker(rs: RedisSettings) -> str:
    # redis-server rewrites its title to "redis-server <bind>:<port>"
    return f"{rs.host}:{rs.port}"


def server_argv(rs: RedisSettings, data: Path, *, aof: str | None = None) -> list[str]:
    """Command line of a redis-server on ``rs``'s host and port, files in ``data``: no persistence
    (the stack's view is rebuilt from Kafka), or ``aof`` = an ``appendfsync`` policy (``everysec``,
    ``always``, ``no``) for an append-only file that a restart reloads (fault tests)."""
    persistence = ["--appendonly", "no"] if aof is None else ["--appendonly", "yes", "--appendfsync", aof]
    return [binary(), "--port", str(rs.port), "--bind", rs.host, "--daemonize", "no", "--save", "",
            *persistence, "--dir", str(data), "--logfile", ""]


def start(paths: Paths, rs: RedisSettings) -> tuple[PidRecord | None, bool]:
    """Start our redis-server unless ours runs or a foreign one answers PING.

    Returns ``(new_record_or_None, external)``.
    """
    if running(paths) is not None:
        return None, False
    if ping(rs):
        log.info("reusing the Redis that already answers on %s (not started by this stack; down leaves it alone)", rs.url)
        return None, True
    if port_open(rs.host, rs.port):
        raise ServiceError(f"{NAME}: port {rs.port} is in use but does not answer Redis PING; free it or change KVBUS_REDIS_URL")
    data = paths.data / "redis"
    data.mkdir(parents=True, exist_ok=True)
    argv = server_argv(rs, data)
    rec = start_process(NAME, argv, pid_path=pid_path(paths), log_path=log_path(paths), marker=marker(rs), cwd=data)
    return rec, False


def check_version(rs: RedisSettings) -> str:
    """Warn if the server is older than Redis 7 (no FUNCTION LOAD). Returns the version."""
    ver = server_version(rs)
    try:
        major = int(ver.split(".")[0])
    except ValueError:
        return ver
    if major < MIN_MAJOR:
        log.warning("Redis %s at %s is older than 7.0: FUNCTION LOAD is unavailable", ver, rs.url)
    return ver
