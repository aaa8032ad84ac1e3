"""tests.waiting.eventually: returns the first truthy value, and a wait that gives up names what it
waited for and what it saw last."""
from __future__ import annotations

import pytest

from tests.waiting import Waiting, eventually


def test_returns_the_first_truthy_value_and_steps_between_polls() -> None:
    seen: list[int] = []
    assert eventually(lambda: len(seen) >= 3 and seen, 5, step=lambda: seen.append(1)) == [1, 1, 1]


def test_gives_up_naming_the_wait_and_what_it_saw() -> None:
    def lag_is_zero() -> Waiting:
        """both hops' lag is 0"""
        return Waiting(lag=3)

    with pytest.raises(AssertionError, match=r"not reached in 0.05s: lag_is_zero \(both hops' lag is 0\); "
                                             r"last value: Waiting\(lag=3\)"):
        eventually(lag_is_zero, 0.05, interval=0.01)
    with pytest.raises(AssertionError, match="the sink to expire old#0; last value: False"):
        eventually(lambda: False, 0.05, what="the sink to expire old#0", interval=0.01)


def test_a_dead_process_fails_the_wait_at_once() -> None:
    def alive() -> None:
        raise AssertionError("worker exited with 1")

    with pytest.raises(AssertionError, match="worker exited"):
        eventually(lambda: False, 60, alive=alive)
