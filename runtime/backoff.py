"""How long a kvbus process waits before retrying what failed (a service down or recovering).

Every retry loop of the stages draws its pauses from a :class:`Backoff`: they double from ``first``
up to ``cap`` seconds, and each is drawn at random between half and all of that ("equal jitter"),
so hundreds of bridges restarted together against a recovering Kafka or registry spread their
retries out instead of retrying in lock step, and none retries faster than half the current step.

Hand-written on purpose: the loops that use it check for a stop request while they wait, run on
asyncio or rewind Kafka positions between tries; a retry library (tenacity, backoff) would have to
own each loop, for what is one formula here.
"""
from __future__ import annotations

import random
import time
from typing import Callable


class Backoff:
    """Pauses of one retry loop: :meth:`next` after each failure, :meth:`reset` after a success.
    The defaults (1 s doubling up to 30 s) are for a process waiting at start for a service."""

    def __init__(self, first: float = 1.0, cap: float = 30.0, rng: Callable[[], float] = random.random) -> None:
        self.first = first
        """Seconds of the first step (the first pause is between half of it and all of it)."""
        self.cap = cap
        """Seconds no step exceeds."""
        self._rng = rng
        self._failures = 0

    def next(self) -> float:
        """The pause before the next try, seconds: ``step / 2 + random() * step / 2`` with
        ``step = min(cap, first * 2 ** failures so far)``."""
        step = min(self.cap, self.first * 2 ** min(self._failures, 60))
        self._failures += 1
        return step / 2 + self._rng() * step / 2

    def reset(self) -> None:
        """The operation succeeded: the next failure starts from ``first`` again."""
        self._failures = 0



def sleep(seconds: float, stop: Callable[[], bool], tick: float = 0.1) -> bool:
    """Sleep ``seconds``, checking ``stop()`` every ``tick`` seconds; False if it asked to stop."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if stop():
            return False
        time.sleep(min(tick, max(0.0, deadline - time.monotonic())))
    return not stop()
