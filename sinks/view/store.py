"""The residency view's writer and recovery interfaces (:class:`ViewWriter`, :class:`ViewRecovery`; a
backend implements both: :class:`ResidencyStore`) and the values they return.

The view answers, per block hash, which holders ((replica, dp_rank)) hold it on which tier, and per
holder which blocks it holds. Two implementations share one contract test suite
(``tests/test_sink_store_contract.py``): :class:`kvbus.sinks.view.redis_store.RedisStore` (the real one) and
:class:`tests.memory_store.InMemoryStore` (a plain-Python model: the tests' oracle).

Semantics every implementation follows (docs/sinks-layout.md):

* events of one holder read from one topic carry growing positions ``(epoch, seq, index)``; an event
  whose position is not above the stored one for (holder, topic), or whose epoch is below the
  holder's reset floor, is skipped (redelivery); the position is stored with the change;
* BlockStored adds (holder, tier) to each hash; on a ref-counted tier (:mod:`kvbus.sinks.view.refcounts`) a repeated
  store increments a count, otherwise it changes nothing; BlockRemoved undoes one store;
* AllBlocksCleared drops the holder's tiers that came from the same topic (kvbus.blocks: the
  framework's own cache); a Reset marker drops those too, plus tiers from other topics whose applied
  epoch is older than the marker's, and makes older epochs stale on every topic;
* holders not seen (event or heartbeat) for ``max_age`` are expired: dropped and listed as stale;
* a holder's model is the one its latest applied event named (``BlockEvent.model``; None: unknown,
  also after it expired or was dropped, until its next event); a lookup naming a model answers only
  holders of that model, never those of another model or of an unknown one.

Recovery (sinks/consumer.py, sinks/rebuild.py, sinks/snapshot.py; docs/sinks-layout.md, "Recovery"), the
same protocol on every store:

* a view has an id (:meth:`ViewRecovery.view_id`; None: lost or never created) and stores, with the
  applies, the next Kafka offset of each block-topic partition (:meth:`ViewRecovery.offsets`);
* a sink keeps a :data:`Checkpoint` (what it believes the view stores for its partitions; opaque: each
  store has its own form) and passes it to every apply, which fails with :class:`ViewChanged`, writing
  nothing, when the view is not the one the sink knows;
* a view may be split into shards (a Redis Cluster view); a store of one shard answers ``shards`` of
  one, shard 0. Methods taking ``shards=`` act on those shards only (None: all of them), which is how a
  view whose shards lost their data while others kept it (:meth:`ViewRecovery.lost_shards`) is
  rebuilt in those shards alone.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

from kvbus.schemas import view_keys
from kvbus.schemas.events import BlockEvent
from kvbus.schemas.lookup import split_holder  # noqa: F401  (the lookup protocol's)

if TYPE_CHECKING:
    from kvbus.sinks.view.reader import ViewReader

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


Offsets = Mapping[tuple[str, int], int]
"""(topic, partition) -> Kafka offset (the next one to apply)."""

Checkpoint = Any
"""What a sink believes the view stores for its partitions, in the store's own form (opaque to the
sink: made by :meth:`ResidencyStore.checkpoint`, moved on by :meth:`ResidencyStore.advance`, passed to
:meth:`ResidencyStore.apply` as ``expected``)."""


class ViewChanged(RuntimeError):
    """The view the sink was applying to is gone or was rebuilt (Redis restarted empty, FLUSHALL,
    another sink rebuilt it, another sink moved a partition on): nothing of the batch was written;
    resynchronise first."""


@dataclass(frozen=True)
class LostShards:
    """Shards of a view that lost it while every other shard kept the same view id."""

    view_id: str
    """The id the other shards keep (the rebuilt shards take it again)."""
    shards: list[int]
    """The shards without a view, to be wiped and rebuilt."""


@dataclass
class HolderDump:
    """One holder's whole state, as :meth:`ResidencyStore.dump_holder` reads it and
    :meth:`ResidencyStore.restore_holder` writes it (a snapshot record: sinks/snapshot.py)."""

    seen: float | None = None
    """Staleness clock (P seen), epoch s; None if expired."""
    floor: float | None = None
    """Reset floor epoch; None if none."""
    positions: list[tuple[str, int, int, int]] = field(default_factory=list)
    """(topic, epoch, seq, index) applied per topic."""
    tiers: list[tuple[str, bool, str, bytes, bytes]] = field(default_factory=list)
    """(descriptor, ref-counted, origin topic, raws held, raws once more per extra count) per tier."""
    model: str | None = None
    """The model the view records for the holder; None if unknown."""
    groups: list[tuple[int, str]] = field(default_factory=list)
    """(KV cache group, its spec ``"<kind>,<window>,<block_size max>,<block_size min>"``) per group its
    events named (kvbus.lua, "KV cache groups of a holder"); empty for engines that name none."""


class ViewWriter(abc.ABC):
    """Writes the view: what the sink's consumer loop calls for each batch and every few seconds. See
    the module docstring for the semantics."""

    prefix: str = ""
    """The view's name: its Redis key prefix (snapshot records and locks are named after it)."""

    @abc.abstractmethod
    def apply(self, records: Iterable[tuple[str, BlockEvent]], *, view_id: str | None = None,
              offsets: Offsets | None = None, expected: Checkpoint | None = None) -> ApplyResult:
        """Apply ``(topic, event)`` records exactly once (events of one holder and topic in order).

        ``view_id``: fail with :class:`ViewChanged`, writing nothing, unless the view's id is this one.
        ``offsets``: stored atomically with the batch (:meth:`ViewRecovery.offsets`). ``expected``: a
        :data:`Checkpoint` of the partitions of ``offsets`` (a partition it lacks is expected absent);
        fail with :class:`ViewChanged` unless the view still stores what it says. Events the store
        refuses (e.g. tier table full) are returned in ``failed``; the rest is applied."""

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
    def servers(self) -> list[tuple[str, Any]]:
        """(name, ``redis.Redis`` client) of every server the view is written to (memory policy,
        evictions); none for a view in process memory."""

    @abc.abstractmethod
    def reader(self) -> "ViewReader":
        """A reader of the view this store writes, on the store's own connections (the sink's gauges:
        its size and stale holders)."""


class ViewRecovery(abc.ABC):
    """Recovers the view: its id, the Kafka offsets stored with it and the sinks' checkpoints of them,
    its recorded status, the locks of a rebuild and a snapshot, and dumps of a holder (sinks/rebuild.py,
    sinks/snapshot.py). See the module docstring for the protocol."""

    @abc.abstractmethod
    def view_id(self) -> str | None:
        """The view's id, set when it is created or rebuilt; None: no view (never created, or lost),
        or (a sharded view) its shards do not all have the same one."""

    @abc.abstractmethod
    def set_view_id(self, view_id: str, shards: Iterable[int] | None = None) -> None:
        """Mark the view (or ``shards`` of it) as view ``view_id``: complete, ready to be applied to."""

    @abc.abstractmethod
    def drop_view_id(self, view_id: str, why: str) -> bool:
        """Forget the view's id where it is still ``view_id`` and mark the view ``rebuilding`` (phase
        ``why``), atomically per shard: the sinks rebuild it. False: it had another id already."""

    @abc.abstractmethod
    def offsets(self) -> dict[tuple[str, int], int]:
        """Where a sink resumes each partition: the offsets stored with the applies (a sharded view:
        the minimum over shards; a partition some shard lacks is left out)."""

    @abc.abstractmethod
    def set_offsets(self, offsets: Offsets, view_id: str | None = None, expected: Checkpoint | None = None,
                    shards: Iterable[int] | None = None) -> None:
        """Store offsets without events (a batch of dead letters only, a rebuilt view's replay start),
        in every shard or in ``shards``; :class:`ViewChanged` like :meth:`apply`."""

    @abc.abstractmethod
    def checkpoint(self, partitions: Iterable[tuple[str, int]]) -> Checkpoint:
        """What the view stores now for ``partitions`` (nothing: absent), as a :data:`Checkpoint`."""

    @abc.abstractmethod
    def advance(self, expected: Checkpoint, offsets: Offsets) -> Checkpoint:
        """``expected`` after a batch (or :meth:`set_offsets`) that stored ``offsets`` succeeded."""

    @abc.abstractmethod
    def holds(self, expected: Checkpoint) -> bool:
        """Whether the view still stores what ``expected`` says (False: rolled back, rebuilt, or
        another sink moved a partition on)."""

    @abc.abstractmethod
    def lost_shards(self) -> LostShards | None:
        """The shards that lost the view while all others kept one id; None when none did, when none
        kept it, or when the kept ids differ (the whole view is then rebuilt). A view of one shard
        is lost whole: always None."""

    @abc.abstractmethod
    def shard(self, replica: str, dp_rank: int) -> int:
        """The shard holding holder (replica, dp_rank) (0 on a view of one shard)."""

    @abc.abstractmethod
    def identity(self) -> tuple:
        """What changes when the servers of the view restart or are replaced (a snapshot read across
        such a change is abandoned)."""

    @abc.abstractmethod
    def status(self) -> dict[str, str]:
        """What a router should know before trusting an answer: ``state`` "ready", "rebuilding"
        (answers may miss blocks) or "missing" (no view, no rebuild started), ``since``, and what
        :meth:`set_status` wrote (``phase``, ``snapshot``, ``target``...). A view written without a
        sink (tests, benchmarks) has no recorded status and is ready."""

    @abc.abstractmethod
    def set_status(self, **fields: Any) -> None:
        """Replace the view's recorded status with ``fields`` (values as strings), in every shard."""

    @abc.abstractmethod
    def wipe(self, keep: Sequence[str] = view_keys.KEPT_BY_WIPE,
             shards: Iterable[int] | None = None) -> int:
        """Delete the view's contents (every shard, or ``shards``) but the keys named ``keep``; returns
        the keys (entries) deleted."""

    @abc.abstractmethod
    def try_lock(self, name: str, token: str, ttl_ms: int) -> bool:
        """Take the view's lock ``name`` (``lock``: rebuild, ``snaplock``: snapshot) for ``ttl_ms`` as
        ``token`` if no one holds it; whether it was taken."""

    @abc.abstractmethod
    def renew_lock(self, name: str, token: str, ttl_ms: int) -> bool:
        """Hold lock ``name`` for ``ttl_ms`` more if ``token`` still holds it; whether it did."""

    @abc.abstractmethod
    def unlock(self, name: str, token: str) -> None:
        """Free lock ``name`` if ``token`` holds it."""

    @abc.abstractmethod
    def holder_ids(self) -> dict[int, str]:
        """Holder key -> holder name ``"<replica>#<dp>"`` of every holder (keys for :meth:`dump_holder`)."""

    @abc.abstractmethod
    def dump_holder(self, key: int) -> HolderDump:
        """One holder's whole state, read atomically ."""

    @abc.abstractmethod
    def restore_holder(self, replica: str, dp_rank: int, state: HolderDump, max_hashes: int = 16384) -> int:
        """Write one holder from a dump (a snapshot record); returns the entries added."""


class ResidencyStore(ViewWriter, ViewRecovery):
    """A backend of the view: it writes the view and recovers it (:class:`kvbus.sinks.view.redis_store.RedisStore`,
    :class:`kvbus.sinks.view.sharded_store.ShardedRedisStore`). Everyone reads it through a
    :class:`~kvbus.sinks.view.reader.ViewReader`."""

