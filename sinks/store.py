"""The residency view's interface (``ResidencyStore``) and the values it returns.

The view answers, per block hash, which holders ((replica, dp_rank)) hold it on which tier, and per
holder which blocks it holds. Two implementations share one contract test suite
(``tests/test_sink_store_contract.py``): :class:`kvbus.sinks.redis_store.RedisStore` (the real one) and
:class:`tests.memory_store.InMemoryStore` (a plain-Python model: the tests' oracle).

Semantics every implementation follows (docs/sinks-layout.md):

* events of one holder read from one topic carry growing positions ``(epoch, seq, index)``; an event
  whose position is not above the stored one for (holder, topic), or whose epoch is below the
  holder's reset floor, is skipped (redelivery); the position is stored with the change;
* BlockStored adds (holder, tier) to each hash; on a ref-counted tier (:mod:`kvbus.sinks.refcounts`) a repeated
  store increments a count, otherwise it changes nothing; BlockRemoved undoes one store;
* AllBlocksCleared drops the holder's tiers that came from the same topic (kvbus.blocks: the
  framework's own cache); a Reset marker drops those too, plus tiers from other topics whose applied
  epoch is older than the marker's, and makes older epochs stale on every topic;
* holders not seen (event or heartbeat) for ``max_age`` are expired: dropped and listed as stale;
* a holder's model is the one its latest applied event named (``BlockEvent.model``; None: unknown,
  also after it expired or was dropped, until its next event); a lookup naming a model answers only
  holders of that model, never those of another model or of an unknown one.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

from kvbus.schemas.events import BlockEvent
from kvbus.schemas.lookup import HolderMatch, display_names, split_holder  # noqa: F401  (the lookup protocol's)
from kvbus.schemas.tiers import Weights

Snapshot = dict[str, dict[str, dict[bytes, int]]]
"""``{holder name "<replica>#<dp>": {tier label: {8-byte hash: count}}}`` (count > 1 only on ref-counted tiers)."""


@dataclass
class ApplyResult:
    """What one apply call did."""

    applied: int = 0
    """Events applied (new positions)."""
    skipped: int = 0
    """Events skipped as already applied (redelivered, or older than a reset)."""
    entries_delta: int = 0
    """Change in the number of (holder, block, tier) entries."""
    resets: int = 0
    """Reset markers applied."""
    clears: int = 0
    """AllBlocksCleared applied."""
    failed: list[tuple[str, BlockEvent, str]] = field(default_factory=list)
    """(topic, event, reason) the store refused (e.g. tier table full): for the dead-letter topic."""

    def add(self, other: "ApplyResult") -> "ApplyResult":
        """Accumulate ``other`` into this result; returns self."""
        self.applied += other.applied
        self.skipped += other.skipped
        self.entries_delta += other.entries_delta
        self.resets += other.resets
        self.clears += other.clears
        self.failed.extend(other.failed)
        return self


class ResidencyStore(abc.ABC):
    """Where the residency view lives. See the module docstring for the semantics."""

    @abc.abstractmethod
    def apply(self, records: Iterable[tuple[str, BlockEvent]]) -> ApplyResult:
        """Apply ``(topic, event)`` records exactly once (events of one holder and topic in order)."""

    @abc.abstractmethod
    def lookup(
        self,
        chain: Sequence[bytes],
        *,
        weights: Weights | None = None,
        candidates: Sequence[str] | None = None,
        model: str | None = None,
    ) -> dict[str, HolderMatch]:
        """Per holder (display name) holding block 0 of ``chain``: its match. ``candidates``: replica
        names or ``<replica>#<dp>`` names to restrict the answer to. ``model``: only holders whose model
        is this one (see the module docstring); None: every holder."""

    @abc.abstractmethod
    def heartbeat(self, replica: str, dp_rank: int, ts: float) -> None:
        """Record that the holder was alive at ``ts`` without an event."""

    @abc.abstractmethod
    def expire_stale(self, max_age: float, now: float) -> list[str]:
        """Expire holders not seen since ``now - max_age``; returns their names."""

    @abc.abstractmethod
    def drop_holder(self, replica: str, dp_rank: int, now: float) -> int:
        """Forget a (dead) holder now; returns the entries dropped."""

    @abc.abstractmethod
    def stale(self) -> dict[str, float]:
        """Holders expired and not heard from since: name -> when expired."""

    @abc.abstractmethod
    def positions(self) -> dict[tuple[str, str], tuple[int, int, int]]:
        """Applied position per (holder name, topic)."""

    @abc.abstractmethod
    def models(self) -> dict[str, str]:
        """Holder name ``"<replica>#<dp>"`` -> its model, for the holders whose model is known."""

    @abc.abstractmethod
    def snapshot(self) -> Snapshot:
        """The whole view (tests, debugging)."""

    @abc.abstractmethod
    def summary(self) -> dict[str, dict[str, int]]:
        """``{holder display name: {tier label: blocks}}``."""

    @abc.abstractmethod
    def size(self, exact: bool = True) -> dict[str, int]:
        """``{"entries": (holder, block, tier) entries, "blocks": distinct hashes, "holders": live holders}``.
        ``exact=False`` allows ``blocks`` to count a hash once per shard of a sharded view (cheap: what
        a sink's gauges read every few seconds); a single view is always exact."""


def summary_from_counts(counts: Mapping[str, Mapping[str, int]]) -> dict[str, dict[str, int]]:
    """Turn ``{holder name: {label: n}}`` into display names, dropping empty holders."""
    names = display_names(counts)
    return {names[h]: dict(sorted(t.items())) for h, t in sorted(counts.items()) if any(t.values())}
