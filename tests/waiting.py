"""Waiting in tests for something that happens eventually, and failing in a way that says what was
awaited and what was seen: every test's polling goes through :func:`eventually`."""
from __future__ import annotations

import time
from typing import Callable


class Waiting:
    """What a check of :func:`eventually` saw while its condition does not hold yet: falsy, and shown
    in the message when ``eventually`` gives up (``Waiting(lag=3, flow=[10, 9, 9])``)."""

    def __init__(self, **seen: object) -> None:
        self.seen = seen

    def __bool__(self) -> bool:
        return False

    def __repr__(self) -> str:
        return "Waiting(" + ", ".join(f"{k}={v!r}" for k, v in self.seen.items()) + ")"


def eventually(check: Callable[[], object], timeout: float, *, what: str | None = None,
               step: Callable[[], object] | None = None, interval: float = 0.2,
               alive: Callable[[], None] | None = None) -> object:
    """Poll ``check()`` until it returns a truthy value, which is returned. Between polls ``step()``
    runs (e.g. a consumer's step, instead of sleeping), else it sleeps ``interval`` s; ``alive()``
    runs before each poll and raises if a process the wait depends on died. After ``timeout`` s it
    fails naming what it waited for (``what``, else the check's name and the first line of its
    docstring) and the check's last value (return a :class:`Waiting` to say more than None or False)."""
    deadline = time.monotonic() + timeout
    last: object = None
    while True:
        if alive is not None:
            alive()
        last = check()
        if last:
            return last
        if time.monotonic() >= deadline:
            break
        if step is not None:
            step()
        else:
            time.sleep(interval)
    if what is None:
        doc = (check.__doc__ or "").strip().splitlines()
        what = getattr(check, "__name__", repr(check)) + (f" ({doc[0]})" if doc else "")
    raise AssertionError(f"not reached in {timeout}s: {what}; last value: {last!r}")
