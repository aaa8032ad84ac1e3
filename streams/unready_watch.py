"""How long a worker has been unready, and when that is too long.

A worker is unready while its consumer group rebalances, while Faust recovers the state table from
its changelog, and until the runtime has rebuilt the state of its partitions. Each normally ends
within seconds (recovery reads a changelog of a few records per holder). Faust's recovery can
stall, though: after a worker paused past its session was fenced and rejoined, one changelog
partition never delivered its record and the recovery waited for it with no end, the worker
consuming nothing and its ``/healthz`` answering ok. So does a worker whose group join failed for
good (``InconsistentGroupProtocolError``: another kind of consumer in its group). :class:`UnreadyWatch`
turns either into an exit with an error once ``KVBUS_STREAMS_RECOVERY_TIMEOUT`` has passed, so that
the worker's supervisor (Kubernetes, systemd) starts it again and the new process recovers afresh.
A rebuild that fails with an error leaves the worker unready for good, so it exits at once
(:func:`exit_on_failure`) rather than after the timeout.

It runs on a thread of its own (:func:`start_watch`), not as a Faust timer: Faust starts an app's
timers only once the table recovery has completed, which is exactly what may never happen.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Awaitable, Callable, Optional

log = logging.getLogger("kvbus.streams")


class UnreadyWatch:
    """Times one unready spell of a worker; :meth:`check` says when it has lasted too long."""

    def __init__(self, limit: float) -> None:
        self.limit = limit
        """Seconds an unready spell may last; 0: for ever."""
        self.since: Optional[float] = None
        """When the current unready spell began (the clock :meth:`check` is given), None while ready."""

    def check(self, why: Optional[str], now: float) -> Optional[str]:
        """Note the worker's state at ``now``: ``why`` it is unready (None: ready, or idle with no
        partition, which is no spell). Returns what to log before exiting once the spell has lasted
        longer than :attr:`limit`, else None."""
        if why is None:
            self.since = None
            return None
        if self.since is None:
            self.since = now
        waited = now - self.since
        if not self.limit or waited <= self.limit:
            return None
        return (f"not ready for {waited:.1f} s ({why}), longer than KVBUS_STREAMS_RECOVERY_TIMEOUT="
                f"{self.limit:g}: exiting so that the worker is started again and recovers afresh")


def start_watch(watch: UnreadyWatch, why: Callable[[], Optional[str]], exit_with: Callable[[str], None],
                every: float) -> threading.Thread:
    """Look at ``why()`` (why the worker is unready, None if it is not; called off the event loop,
    so it must only read flags) every ``every`` seconds on a daemon thread; once ``watch`` says the
    spell is too long, log its verdict as an ERROR and call ``exit_with(verdict)`` (which ends the
    process), once."""
    def run() -> None:
        while True:
            time.sleep(every)
            verdict = watch.check(why(), time.monotonic())
            if verdict is not None:
                log.error("%s", verdict)
                exit_with(verdict)
                return
    thread = threading.Thread(target=run, name="unready-watch", daemon=True)
    thread.start()
    return thread


def exit_on_failure(what: str, step: Callable[[], Awaitable[None]], exit_with: Callable[[str], None]
                    ) -> Callable[[], Awaitable[None]]:
    """``step`` (a coroutine function that readies the worker, such as the rebuild after a table
    recovery) that, when it raises, logs the error and calls ``exit_with(verdict)`` on a thread of
    its own (``exit_with`` blocks until the process ends, and the event loop must go on to stop the
    app). Faust runs recovery callbacks as tasks whose errors nobody reads: without this, a failed
    rebuild left the worker unready and silent until its recovery timeout. ``what``: for the log."""
    async def guarded() -> None:
        try:
            await step()
        except Exception as exc:  # noqa: BLE001 - any error: the worker cannot become ready
            verdict = f"{what} failed ({type(exc).__name__}: {exc}): exiting so that the worker is started again"
            log.exception("%s", verdict)
            threading.Thread(target=exit_with, args=(verdict,), name="exit-on-failure", daemon=True).start()
    return guarded
