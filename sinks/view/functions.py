"""The ``kvbus`` Redis function library (``sinks/view/lua/kvbus.lua``): loading and calling it.

Functions are loaded once with ``FUNCTION LOAD REPLACE`` and called with FCALL / FCALL_RO. When a
server lost them (restart without persistence, ``FUNCTION FLUSH``, a new replica), a call fails with
"Function not found": :func:`call` loads the library and retries once. So does a write refused for its
arguments by another version of the library (a sink of another release, started later, loaded its
own): the library loaded is this release's again, whose functions still take the older calls.
"""
from __future__ import annotations

import hashlib
import re
from functools import lru_cache
from pathlib import Path
from typing import Any, Sequence

import redis

from kvbus.schemas.lookup import LAYOUT
from kvbus.sinks.view.cluster import is_missing, is_refused_arguments  # noqa: F401  (re-exported for the sinks)

LIBRARY_PATH = Path(__file__).parent / "lua" / "kvbus.lua"
MIN_REDIS = (7, 0, 0)


@lru_cache(maxsize=None)
def library_version() -> str:
    """Version of the library: a digest of ``kvbus.lua`` and the layout it is loaded with, so any
    change reloads it."""
    return hashlib.sha1(LIBRARY_PATH.read_bytes() + LAYOUT.encode()).hexdigest()[:16]


@lru_cache(maxsize=None)
def library_code() -> str:
    """Source of the ``kvbus`` library as loaded (``@VERSION@`` and ``@LAYOUT@`` filled in)."""
    return LIBRARY_PATH.read_text().replace("@VERSION@", library_version()).replace("@LAYOUT@", LAYOUT)


def layout_version() -> str:
    """The key layout version the library writes and accepts: :data:`kvbus.schemas.lookup.LAYOUT`
    (the one place it is written), the ``layout`` field of ``P meta`` and the version of the lookup
    protocol a router checks (docs/lookup-protocol.md, "Versions")."""
    return LAYOUT


class FunctionsUnavailable(RuntimeError):
    """The kvbus functions are missing and this connection cannot load them (replica, read-only user)."""


def check_server(r: redis.Redis) -> None:
    """Raise if the server is older than Redis 7.0 (no functions)."""
    version = r.info("server").get("redis_version", "0")
    parts = tuple(int(x) for x in re.findall(r"\d+", str(version))[:3])
    if parts < MIN_REDIS:
        raise RuntimeError(f"Redis {version} has no functions: kvbus needs Redis >= 7.0")


def load_library(r: redis.Redis) -> None:
    """``FUNCTION LOAD REPLACE`` the library; :class:`FunctionsUnavailable` if the server refuses."""
    try:
        r.function_load(library_code(), replace=True)
    except (redis.exceptions.NoPermissionError, redis.exceptions.ReadOnlyError) as e:
        raise FunctionsUnavailable(
            f"kvbus functions are not loaded on this server and cannot be loaded from here ({e}); "
            "start a sink against the primary, it loads them"
        ) from e


def ensure_library(r: redis.Redis) -> None:
    """Load the library unless the server already has this version."""
    try:
        current = r.fcall_ro("kvbus_version", 0)
    except redis.ResponseError as e:
        if not is_missing(e):
            raise
        current = None
    if isinstance(current, bytes):
        current = current.decode()
    if current != library_version():
        load_library(r)


def needs_library(err: BaseException, readonly: bool = False) -> bool:
    """Whether a call's error may be cured by loading this release's library: the library is missing,
    or (a write) it refused the call's arguments, as another version of it does (nothing was written)."""
    return is_missing(err) or (not readonly and is_refused_arguments(err))


def call(r: redis.Redis, name: str, *args: Any, readonly: bool = False, keys: Sequence[str] = ()) -> Any:
    """FCALL (or FCALL_RO) ``name`` with ``keys`` (none: a standalone Redis; Redis Cluster: the
    declared keys of the call's slot) and ``args``; loads this release's library and calls once more
    if it is missing, or is another version that refuses a write's arguments (:func:`needs_library`)."""
    fn = r.fcall_ro if readonly else r.fcall
    try:
        return fn(name, len(keys), *keys, *args)
    except redis.ResponseError as e:
        if not needs_library(e, readonly):
            raise
        if not is_missing(e):
            ensure_library(r)  # the same version loaded: the refusal stands (raised again below)
        else:
            load_library(r)
    return fn(name, len(keys), *keys, *args)
