"""Whether a stage is busy: the one rule by which the bridge's loop (``producers/bridge_group.Batching``)
and the worker's fetches (``streams/faust_adapter.FetchPacing``) decide to wait for more under load.

A rate (things a second) is measured over spans of a few tenths of a second; it makes the stage busy
once it reaches the threshold, and idle again only below half of it, so that a load near the
threshold does not flip the stage at every span.
"""
from __future__ import annotations

import time
from typing import Callable, Optional


class BusyRate:
    """Counts things and says, at the end of each span of ``every`` seconds, their rate and whether it
    calls for busy. ``busy``: things a second that make a stage busy (0: never). ``clock``: monotonic
    seconds (default ``time.monotonic``, looked up at each call). :attr:`is_busy` is what the owner
    acts on; it sets it once it acted (a stage may not be able to act yet)."""

    def __init__(self, busy: float, every: float, clock: Optional[Callable[[], float]] = None) -> None:
        self.busy = busy
        self.every = every
        self.clock = clock
        self.is_busy = False
        """Whether the stage waits for more now."""
        self._counted = 0
        self._since = self._now()
        """When the current span began (the first at construction)."""

    def _now(self) -> float:
        return self.clock() if self.clock is not None else time.monotonic()

    def count(self, n: int) -> Optional[tuple[float, bool]]:
        """Add ``n``; at the end of a span, (its rate per second, whether that rate calls for busy), else None."""
        now = self._now()
        self._counted += n
        span = now - self._since
        if span < self.every:
            return None
        rate = self._counted / span
        self._counted, self._since = 0, now
        return rate, self.busy > 0 and rate >= (self.busy / 2 if self.is_busy else self.busy)
