"""Redis memory as the sink must see it: the eviction policy the view needs, a full Redis, evictions.

A key Redis evicts is a part of the view gone without a word (a block missing, a holder's state or
its index cut), and nothing in Redis tells a client which key went. So:

* at start, the sink refuses a server whose ``maxmemory-policy`` is anything but ``noeviction``
  (:func:`check_no_eviction`; exit 2), read with ``CONFIG GET``, or from ``INFO memory`` where
  ``CONFIG`` is forbidden (managed offerings, an ACL user without ``+config``);
* under ``noeviction`` at ``maxmemory`` Redis refuses every write with OOM: the stores raise
  :class:`RedisFull` (never a dead letter: the events are good), the sink stops applying, says why,
  and applies again from where it stopped once Redis has memory (sinks/consumer.py);
* while it runs, the sink reads ``INFO stats`` ``evicted_keys`` of every server it writes to
  (:class:`EvictionWatch`, one cheap command per server and second): keys evicted anyway (the
  policy changed under a running sink) make it drop the view's id, so that the view is not ready
  and is rebuilt like a lost one (sinks/rebuild.py).
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Iterable

import redis

from kvbus.runtime.env import SettingError

log = logging.getLogger("kvbus.sinks")

POLICY_SETTING = "maxmemory-policy"
"""The Redis setting that says what Redis does at ``maxmemory``."""
NO_EVICTION = "noeviction"
"""The only value of :data:`POLICY_SETTING` the view survives: writes are refused, nothing is deleted."""


class RedisFull(RuntimeError):
    """Redis refused a write of the view for lack of memory (OOM: ``used_memory`` above
    ``maxmemory`` under ``noeviction``). Nothing of the refused calls was written; calls of the same
    batch before them may have been (their positions make applying them again harmless), and no
    later call of the batch was (each checks that its predecessor ran: sinks/view/redis_store.py)."""


def is_oom(e: BaseException) -> bool:
    """Whether ``e`` is Redis's refusal of a write at ``maxmemory`` (``OOM command not allowed ...``)."""
    return isinstance(e, redis.exceptions.OutOfMemoryError) or (
        isinstance(e, redis.ResponseError) and str(e).startswith("OOM "))


def memory_policy(r: redis.Redis) -> tuple[str | None, str]:
    """(the server's ``maxmemory-policy`` or None if it cannot be read, where it was read:
    ``"CONFIG GET"``, ``"INFO memory"`` or why neither answered)."""
    try:
        got = r.config_get(POLICY_SETTING)
        value = got.get(POLICY_SETTING) if isinstance(got, dict) else None
        if value is not None:
            return _text(value), "CONFIG GET"
    except redis.ResponseError as e:  # NoPermissionError, CONFIG renamed or disabled (unknown command)
        refused = f"CONFIG GET refused ({e})"
    else:
        refused = "CONFIG GET answered nothing"
    try:
        value = r.info("memory").get("maxmemory_policy")
    except redis.ResponseError as e:
        return None, f"{refused}; INFO memory refused ({e})"
    return (_text(value), "INFO memory") if value is not None else (None, f"{refused}; INFO memory has no policy")


def check_no_eviction(servers: Iterable[tuple[str, redis.Redis]]) -> None:
    """Refuse to run on a server that evicts keys: :class:`SettingError` (``kvbus sink`` exits 2 with
    its one line) naming the server, :data:`POLICY_SETTING`, its value and the one needed.
    ``servers``: (name, client) of every server the view is written to (a cluster: each master). A
    policy that cannot be read at all is logged as a warning, not refused (the sink still watches
    ``evicted_keys``)."""
    for name, r in servers:
        policy, source = memory_policy(r)
        if policy is None:
            log.warning("could not read %s of Redis at %s (%s): make sure it is %s, or evicted keys will be "
                        "missing from the view until the sink notices and rebuilds it", POLICY_SETTING, name,
                        source, NO_EVICTION)
        elif policy != NO_EVICTION:
            raise SettingError(
                f"Redis at {name} has {POLICY_SETTING} {policy} ({source}): it deletes keys of the view silently "
                f"when full; set {POLICY_SETTING} {NO_EVICTION} (CONFIG SET {POLICY_SETTING} {NO_EVICTION}, "
                f"and in its configuration)")


def describe_full(r: redis.Redis) -> str:
    """What an operator needs to know when Redis refuses writes for memory: its figures and what to do."""
    try:
        info = r.info("memory")
        figures = (f"used_memory {int(info.get('used_memory', 0)) / 1e6:.1f} MB, "
                   f"maxmemory {int(info.get('maxmemory', 0)) / 1e6:.1f} MB, "
                   f"{POLICY_SETTING} {info.get('maxmemory_policy', '?')}")
    except (redis.RedisError, ValueError) as e:
        figures = f"INFO memory unavailable: {e}"
    return (f"Redis is full and refuses the view's writes (OOM at maxmemory; {figures}). The sink stops "
            f"applying and loses nothing: it applies again from where it stopped once Redis has memory. "
            f"Raise maxmemory (CONFIG SET maxmemory <bytes>, and in its configuration) or give Redis more memory")


class EvictionWatch:
    """Counts the keys the servers of a view evicted since it was last :meth:`reset`.

    ``servers``: a function returning (name, client) of every server the view is written to now (a
    cluster's masters change with failovers). A server's count starts again when it restarts (its
    ``run_id`` changes): a restarted server lost the view whole, which the view's id tells. A
    server that refuses ``INFO`` is not watched (logged once)."""

    def __init__(self, servers: Callable[[], Iterable[tuple[str, redis.Redis]]]) -> None:
        self._servers = servers
        self._base: dict[str, tuple[str, int]] = {}
        self._refused: set[str] = set()
        self.reset()

    def _counts(self) -> dict[str, tuple[str, int]]:
        out = {}
        for name, r in self._servers():
            try:
                info = r.info("server", "stats")
            except redis.ResponseError as e:
                if name not in self._refused:
                    self._refused.add(name)
                    log.warning("Redis at %s refuses INFO (%s): keys it evicts will not be noticed", name, e)
                continue
            out[name] = (str(info.get("run_id", "")), int(info.get("evicted_keys", 0)))
        return out

    def reset(self) -> None:
        """Count from now on (after the view was rebuilt)."""
        self._base = self._counts()

    def evicted(self) -> dict[str, int]:
        """Servers that evicted keys since the last :meth:`reset`: name -> keys evicted."""
        out = {}
        for name, (run, n) in self._counts().items():
            base = self._base.get(name)
            if base is None or base[0] != run:
                self._base[name] = (run, n)
                continue
            if n > base[1]:
                out[name] = n - base[1]
        return out


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)
