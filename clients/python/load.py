"""A router's share of the load every router sees: :class:`LoadReporter` keeps the books of the requests
one router sent and that have not completed, per replica, and reports them to the view's Redis, where
:meth:`kvbus.client.ViewClient.load` (and :meth:`~kvbus.client.ViewClient.lookup_with_load`, in the lookup's
round trip) sums every live router's (docs/routing.md, "Shared load").

Each router writes only its own fields, as absolute counts, under a lease it renews with every report:
a write lost to a Redis outage is mended by the next one, a Redis restarted empty is filled again by
each router's next report, and a router that crashed counts for nobody once its lease runs out.
"""
from __future__ import annotations

import logging
import os
import socket
import threading
import uuid
from contextlib import contextmanager
from typing import Iterator

from kvbus.schemas.lookup import Load
from kvbus.sinks.view.reader import ViewClient

log = logging.getLogger("kvbus.client.load")

DEFAULT_LEASE = 30.0
"""Seconds a router's reports count for after its last one (:meth:`LoadReporter.renew` keeps an idle
router's in-flight requests counted: call it more often than this)."""


def router_name() -> str:
    """A name for this router process: host, pid and a random part (unique across restarts)."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class LoadReporter:
    """The requests this router routed and that have not completed, per replica, reported to ``view``'s
    Redis as router ``router`` (default :func:`router_name`) under a lease of ``lease`` seconds.

    A report that fails (Redis unreachable) is logged once and never raised: routing goes on, and the
    next report writes the whole book again. Safe to share between threads."""

    def __init__(self, view: ViewClient, router: str | None = None, lease: float = DEFAULT_LEASE) -> None:
        if lease <= 0:
            raise ValueError(f"lease must be positive, got {lease}")
        self.view, self.router, self.lease = view, router or router_name(), lease
        self.book: dict[str, Load] = {}
        """Replica -> this router's requests in flight there and their prompt tokens."""
        self._lock = threading.Lock()
        self._failing = False
        self._stale = False

    def started(self, replica: str, tokens: int = 0) -> None:
        """A request with ``tokens`` prompt tokens was routed to ``replica``."""
        self._add(replica, 1, tokens)

    def finished(self, replica: str, tokens: int = 0) -> None:
        """A request :meth:`started` on ``replica`` with ``tokens`` completed (or failed)."""
        self._add(replica, -1, -tokens)

    @contextmanager
    def request(self, replica: str, tokens: int = 0) -> Iterator[None]:
        """:meth:`started` on entry, :meth:`finished` on exit, whatever the exit."""
        self.started(replica, tokens)
        try:
            yield
        finally:
            self.finished(replica, tokens)

    def renew(self) -> None:
        """Renew the lease (and write the whole book again)."""
        with self._lock:
            self._send(dict(self.book))

    def _add(self, replica: str, requests: int, tokens: int) -> None:
        with self._lock:
            old = self.book.get(replica, Load())
            self.book[replica] = Load(max(0, old.requests + requests), max(0, old.tokens + tokens))
            # after a failed report, the whole book: Redis may have lost or missed any part of it
            self._send(dict(self.book) if self._stale else {replica: self.book[replica]})

    def _send(self, loads: dict[str, Load]) -> None:
        try:
            self.view.report(self.router, loads, self.lease)
        except Exception as e:  # the router routes on whatever Redis does
            self._stale = True
            if not self._failing:
                log.warning("router %s: load not reported (%s: %s); reporting again with the next request",
                            self.router, type(e).__name__, e)
                self._failing = True
            return
        self._stale = False
        if self._failing:
            log.info("router %s: load reported again", self.router)
            self._failing = False
