"""How a lookup orders holders whose answers are equal.

Answers are ranked by score (descending), then matched blocks (descending): holders equal on both
are **tied** (:func:`kvbus.schemas.lookup.tie_key`), e.g. every replica that holds a shared system
prompt, or every replica for a prompt nobody holds beyond it. ``kvbus lookup --json`` prints tied
holders by display name (:data:`BY_NAME`), which makes its output reproducible; a router that
takes the first answer that way sends every such prompt to the same replica. A tie-break decides
the order within each run of tied holders instead:

* :class:`Shuffle` (the client's default): a random order, from a seeded generator if you want
  it reproducible;
* :class:`ByLoad`: least loaded first, by a callback the router supplies (its queue lengths, its
  in-flight requests), equal loads in a :class:`Shuffle` order;
* :data:`BY_NAME`: display name ascending.

A tie-break never moves a holder past one with a different (score, matched).
"""
from __future__ import annotations

import random
from typing import Callable, Protocol, Sequence

from kvbus.schemas.lookup import HolderMatch, rank_key, tie_key


class TieBreak(Protocol):
    """Orders one run of tied holders (given in display-name order); returns them reordered."""

    def order(self, tied: list[HolderMatch]) -> list[HolderMatch]: ...


class ByName:
    """Tied holders by display name ascending (the order of ``kvbus lookup --json``)."""

    def order(self, tied: list[HolderMatch]) -> list[HolderMatch]:
        return tied

    def __repr__(self) -> str:
        return "BY_NAME"


BY_NAME = ByName()
"""Display name ascending: reproducible, and the same replica first for every tied prompt."""


class Shuffle:
    """Tied holders in a random order. ``seed``: seeds the generator (any value ``random.Random``
    takes: the same seed gives the same sequence of orders); None: seeded from the OS."""

    def __init__(self, seed: int | str | bytes | None = None):
        self.rng = random.Random(seed)

    def order(self, tied: list[HolderMatch]) -> list[HolderMatch]:
        out = list(tied)
        self.rng.shuffle(out)
        return out

    def __repr__(self) -> str:
        return "Shuffle()"


class ByLoad:
    """Tied holders least loaded first. ``load``: a holder's load, any number where less is better
    (called once per tied holder, with its match: ``replica``, ``dp_rank``, ``name``); ``then``:
    orders holders of equal load (default: a :class:`Shuffle` seeded from the OS)."""

    def __init__(self, load: Callable[[HolderMatch], float], then: TieBreak | None = None):
        self.load = load
        self.then = then if then is not None else Shuffle()

    def order(self, tied: list[HolderMatch]) -> list[HolderMatch]:
        return sorted(self.then.order(tied), key=self.load)  # stable: equal loads keep ``then``'s order

    def __repr__(self) -> str:
        return f"ByLoad({self.load!r}, then={self.then!r})"


TieBreakLike = TieBreak | Callable[[HolderMatch], float]
"""What a ``tie_break`` argument takes: a :class:`TieBreak`, or a load callback (:class:`ByLoad`)."""


def as_tie_break(value: TieBreakLike) -> TieBreak:
    """``value`` as a :class:`TieBreak`: an object with ``order`` as is, a plain callable as the load
    of :class:`ByLoad`. TypeError otherwise."""
    if hasattr(value, "order"):
        return value  # type: ignore[return-value]
    if callable(value):
        return ByLoad(value)
    raise TypeError(f"tie_break must be a TieBreak (BY_NAME, Shuffle, ByLoad) or a load callback, not {value!r}")


def rank(matches: Sequence[HolderMatch], tie_break: TieBreak = BY_NAME) -> list[HolderMatch]:
    """``matches`` best first (:func:`kvbus.schemas.lookup.rank_key`), each run of tied holders
    ordered by ``tie_break``."""
    ordered = sorted(matches, key=rank_key)
    if tie_break is BY_NAME:
        return ordered
    out: list[HolderMatch] = []
    i = 0
    while i < len(ordered):
        j = i + 1
        key = tie_key(ordered[i])
        while j < len(ordered) and tie_key(ordered[j]) == key:
            j += 1
        out += ordered[i:j] if j - i == 1 else tie_break.order(ordered[i:j])
        i = j
    return out
