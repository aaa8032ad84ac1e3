"""Consolidation of tensor-parallel worker reports: the streams stage's logic, without Faust.

Each tensor-parallel worker of an engine replica reports the same KV-cache events through its
own bridge (``EventBatch.worker_rank`` of ``EventBatch.workers``). vLLM's in-process
``KVEventAggregator`` keeps a ``Counter`` of identical events and keeps an event once its count
equals the number of workers. kvbus does the same across processes, where reports arrive at
different times, twice, or never. This module is that rule over plain state:

* :class:`Aggregator` holds a ``dict`` of :class:`HolderState` (one per ``(replica, dp_rank)``),
  passed in, and turns decoded batches into :class:`Output` records (``apply``), expires what
  was not completed in time (``expire``), and tells what changed for the durable store
  (``flush``/``load``). The Faust agent in :mod:`kvbus.streams.agents` is a thin shell around it.

Rules (see docs/streams.md for the reasoning):

1. **Identity** (:func:`identity`) is vLLM's ``__hash__``: every field of ``BlockStored`` except
   ``lora_name`` (any newer field included), every field of ``BlockRemoved``; scoped by
   ``(replica, dp_rank)`` and by the reported worker count.
2. **Completion**: an aggregate completes the moment the *distinct* ranks that reported it
   reach ``workers``; it is emitted at once with the position ``(epoch, seq, index)`` and the
   event of the rank-0 report. A rank that reports an identity again while its report is still
   pending counts once for that aggregate; the later report opens the next aggregate of that
   identity (the k-th report of a rank pairs with the k-th report of the others).
3. **Redelivery**: an event whose position ``(epoch, seq, index)`` is not above the last one
   applied from that worker rank is a duplicate and ignored: a redelivered batch entirely, a
   redelivered part of a split batch too (the parts of one batch share its ``(epoch, seq)``;
   event ``i`` of a record has index ``first_index + i``), so parts behave as the whole batch.
4. **Expiry**: an aggregate not completed ``window`` seconds (processing time) after its first
   report becomes an :class:`~kvbus.schemas.events.Incomplete`.
5. **Order**: consolidated positions only grow per holder; a completion that would go back
   (workers disagreeing on order) is reported as Incomplete instead and counted.
6. **AllBlocksCleared** is aggregated like any event (each worker reports it); once complete it
   is emitted to the framework topic only, and every pending aggregate that a worker reported
   *before* its own AllBlocksCleared is provably incomplete and expires immediately.
7. **Reset** markers are per worker (each bridge has its own). The first Reset of an incident
   is forwarded at once (framework topic + every tier topic the holder used) and drops all pending
   aggregates; Resets of the other ranks within ``window`` after it belong to the same incident:
   they are not forwarded again and drop only the pending aggregates holding that rank's (old)
   reports. A forwarded Reset takes rank 0's position when rank 0 sent it, otherwise
   ``(epoch0, seq0, AFTER_BATCH)`` after rank 0's last batch, so positions still only grow. (If that
   batch was split and its later parts arrive after the Reset, rank 0's reports in them are
   dropped as the Reset would have dropped them pending: :meth:`Aggregator._void_before_reset`.)
8. ``workers == 1`` passes straight through: no aggregation state, no dedup (consumers drop
   redeliveries by position).
9. **Model**: every output BlockEvent carries ``EventBatch.model`` of a batch that reported it:
   a passed-through event and a forwarded Reset their own batch's, a consolidated event that of
   its lowest-rank report (like the event itself). The model is not part of the identity.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Optional, Union

import msgspec

from kvbus.schemas.codec import encode_event
from kvbus.schemas.events import (
    AllBlocksCleared,
    BlockEvent,
    BlockEvents,
    BlockRemoved,
    BlockStored,
    Event,
    EventBatch,
    Incomplete,
    Reset,
    holder_key,
)
from kvbus.schemas.topics import Topics
from kvbus.streams.raw_event import RawEvent

Position = tuple[int, int, int]
"""(epoch, seq, index) of a report; see docs/architecture.md, "Positions and resets"."""

DEFAULT_WINDOW = 5.0
"""Seconds an aggregate may stay incomplete before it expires."""

_ENCODER = msgspec.msgpack.Encoder()

AFTER_BATCH = 2**31 - 1
"""Index of a Reset forwarded on behalf of a rank other than 0: ``(epoch0, seq0, AFTER_BATCH)``
sorts after every event of rank 0's batch ``seq0`` and before the first event of its next batch
(Avro int maximum; positions stay non-negative, as consumers require)."""

AnyEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared, Reset, RawEvent]
"""An event as decoded (struct) or as scanned (:class:`RawEvent`)."""


def identity(event: AnyEvent, workers: int = 1) -> bytes:
    """16-byte identity of an event as vLLM's ``__hash__`` defines it, salted by the worker count.

    The hash of the event's canonical Avro encoding with ``lora_name`` set to null: for
    ``BlockStored`` every field but ``lora_name`` (newer fields are in the encoding too), for
    ``BlockRemoved`` and ``AllBlocksCleared`` every field. Events that differ only in
    ``lora_name`` share an identity; a :class:`RawEvent` has its struct's identity.
    """
    t = type(event)
    if t is RawEvent:
        data = event.canon if event.canon is not None else event.avro
    else:
        if t is BlockStored and event.lora_name is not None:
            event = msgspec.structs.replace(event, lora_name=None)
        data = encode_event(event)
    return hashlib.blake2b(data, digest_size=16, salt=workers.to_bytes(2, "big")).digest()


class Aggregate(msgspec.Struct, array_like=True):
    """The reports of one occurrence of one event identity, until every worker reported it."""

    ident: bytes
    """:func:`identity` of the event."""
    workers: int
    """Worker count the reports carried."""
    event: AnyEvent
    """The event as reported by the lowest rank so far (its ``lora_name`` is the one emitted)."""
    ts: float
    """Engine time of the batch of that lowest-rank report."""
    low: int
    """Lowest rank that reported so far."""
    reports: dict[int, tuple[int, int, int]]
    """Worker rank -> position of its report."""
    first: tuple[int, int, int]
    """Position of the first report (named in Incomplete)."""
    created: float
    """Processing time (epoch seconds) of the first report; expiry counts from here."""
    partition: int = -1
    """Raw partition of the holder (lets a store entry be placed without its meta)."""
    model: str | None = None
    """``EventBatch.model`` of the batch of the lowest-rank report (the consolidated event's model)."""


class HolderMeta(msgspec.Struct, array_like=True, omit_defaults=True):
    """Per-(replica, dp_rank) bookkeeping other than the pending aggregates."""

    replica: str
    dp_rank: int
    partition: int
    """Kafka partition the holder's raw records come from (its state lives there too)."""
    hwm: dict[int, tuple[int, ...]] = {}
    """Worker rank -> ``(epoch, seq, end)`` of the last record applied, ``end`` being the index after
    its last event: events at positions below are redeliveries. A state written before split batches
    existed holds ``(epoch, seq)``, meaning the whole batch (:func:`applied_before`)."""
    last: Optional[tuple[int, int, int]] = None
    """Position of the last consolidated event or forwarded Reset."""
    tiers: list[str] = []
    """Ownership values (secondary tiers) the holder has published to, in first-seen order."""
    era_ranks: list[int] = []
    """Ranks whose Reset belongs to the current reset incident."""
    era_started: Optional[float] = None
    """Processing time the current reset incident began; None before any Reset."""


@dataclass
class HolderState:
    """Working state of one holder: what :class:`Aggregator` reads and changes."""

    meta: HolderMeta
    pending: dict[bytes, list[Aggregate]] = field(default_factory=dict)
    """identity -> open aggregates of that identity, oldest first (usually one)."""
    dirty: set[bytes] = field(default_factory=set)
    """Identities whose pending list changed since the last :meth:`Aggregator.flush`."""
    persisted: set[bytes] = field(default_factory=set)
    """Identities that have an entry in the durable store."""
    meta_dirty: bool = False
    """``meta`` changed since the last flush."""

    def pending_count(self) -> int:
        """Number of open aggregates."""
        return sum(len(v) for v in self.pending.values())


@dataclass(slots=True)
class Output:
    """A record to produce: value is a BlockEvent (consolidated or Reset) or an Incomplete; a BlockEvents
    once packed (:mod:`kvbus.streams.packing`)."""

    topic: str
    key: bytes
    partition: int
    value: Union[BlockEvent, BlockEvents, Incomplete]
    kind: str
    """consolidated, passthrough, reset, incomplete (window), cleared (obsoleted by
    AllBlocksCleared) or disordered (completed out of order)."""


@dataclass
class Stats:
    """Counters the shell exports as metrics (monotonic)."""

    reports: int = 0
    """Events applied (each worker's report of one event counts once)."""
    duplicates: int = 0
    """Events in redelivered batches, ignored."""
    consolidated: int = 0
    """Consolidated events emitted (workers > 1)."""
    passthrough: int = 0
    """Events of single-worker replicas passed through."""
    resets: int = 0
    """Reset markers forwarded (per holder, not per topic)."""
    resets_coalesced: int = 0
    """Reset markers absorbed into an incident already forwarded."""
    incomplete: int = 0
    """Aggregates expired by the window."""
    cleared: int = 0
    """Aggregates found incomplete when AllBlocksCleared completed."""
    disordered: int = 0
    """Completions that would have moved the position back."""
    dropped_by_reset: int = 0
    """Pending aggregates dropped by a Reset."""


def check(batch: EventBatch, key: Optional[bytes] = None) -> Optional[str]:
    """Why ``batch`` violates an invariant of the raw topic, or None if it is acceptable.

    ``key`` is the Kafka record key, which must be ``holder_key(replica, dp_rank)`` when present.
    """
    if not batch.replica or "\x00" in batch.replica:
        return "invalid replica: empty or contains NUL"
    if batch.dp_rank < 0:
        return f"invalid dp_rank {batch.dp_rank} < 0"
    if batch.workers < 1:
        return f"invalid workers {batch.workers} < 1"
    if batch.workers > 65535:
        return f"invalid workers {batch.workers} > 65535"
    if not 0 <= batch.worker_rank < batch.workers:
        return f"invalid worker_rank {batch.worker_rank} not in [0, workers={batch.workers})"
    if batch.seq < -1:
        return f"invalid seq {batch.seq} < -1"
    if batch.epoch < 0:
        return f"invalid epoch {batch.epoch} < 0"
    if batch.first_index < 0:
        return f"invalid first_index {batch.first_index} < 0"
    if key is not None:
        expected = holder_key(batch.replica, batch.dp_rank).encode()
        if key != expected:
            return f"record key {key!r} is not holder_key {expected!r}"
    return None


_WHOLE_BATCH = 1 << 62
"""``end`` of a high-water mark written as ``(epoch, seq)``: every event of that batch was applied."""


def _end(hwm: tuple[int, ...]) -> int:
    """Index after the last event a high-water mark covers in its (epoch, seq)."""
    return hwm[2] if len(hwm) > 2 else _WHOLE_BATCH


def applied_before(hwm: Optional[tuple[int, ...]], batch: EventBatch) -> int:
    """How many leading events of ``batch`` (a whole batch or one part) a rank whose high-water
    mark is ``hwm`` (see :attr:`HolderMeta.hwm`) already applied: 0 for a new batch or part, all
    of them for a redelivery; a part that overlaps what was applied (re-split differently by a
    restarted producer) skips exactly the overlap."""
    n = len(batch.events)
    if hwm is None:
        return 0
    es, seen = (batch.epoch, batch.seq), (hwm[0], hwm[1])
    if es != seen:
        return n if es < seen else 0
    return min(n, max(0, _end(hwm) - batch.first_index))


def high_water(hwm: Optional[tuple[int, ...]], batch: EventBatch) -> tuple[int, int, int]:
    """The rank's high-water mark after applying (what is new in) ``batch``."""
    end = batch.first_index + len(batch.events)
    if hwm is not None and (hwm[0], hwm[1]) == (batch.epoch, batch.seq):
        end = max(end, _end(hwm))
    return (batch.epoch, batch.seq, end)


class Aggregator:
    """Applies batches to the holder states in ``holders`` and appends outputs to a list.

    ``holders`` is owned by the caller (one process's share of the holders); ``window`` is the
    expiry in seconds; ``topics`` names output topics.
    """

    def __init__(
        self,
        topics: Topics,
        window: float = DEFAULT_WINDOW,
        holders: Optional[dict[str, HolderState]] = None,
        stats: Optional[Stats] = None,
    ):
        self.topics = topics
        self.window = window
        self.holders: dict[str, HolderState] = {} if holders is None else holders
        self.stats = stats or Stats()
        self._tier_topics: dict[Optional[str], str] = {None: topics.blocks}

    # -- input ----------------------------------------------------------------

    def apply(self, batch: EventBatch, partition: int, now: float, out: list[Output]) -> None:
        """Apply one worker's batch (or one part of a split batch) read from raw ``partition`` at
        processing time ``now``."""
        if batch.workers == 1:
            self._pass_through(batch, partition, out)
            return
        key = holder_key(batch.replica, batch.dp_rank)
        st = self._state(key, batch, partition)
        meta = st.meta
        rank = batch.worker_rank
        seen = meta.hwm.get(rank)
        skip = applied_before(seen, batch)
        events = batch.events
        if skip == len(events):  # a redelivery (or an empty record: nothing to apply either)
            self.stats.duplicates += skip
            return
        if skip:
            self.stats.duplicates += skip
            events = events[skip:]
        meta.hwm[rank] = high_water(seen, batch)
        meta.partition = partition
        st.meta_dirty = True
        epoch, seq, ts, workers, model = batch.epoch, batch.seq, batch.ts, batch.workers, batch.model
        kbytes = key.encode()
        self.stats.reports += len(events)
        first = batch.first_index + skip
        if rank == 0 and meta.last is not None and (epoch, seq, first) <= meta.last:
            events, first = self._void_before_reset(meta.last, epoch, seq, events, first)
        for index, event in enumerate(events, first):
            if type(event) is Reset:
                self._reset(st, kbytes, rank, (epoch, seq, index), ts, event, now, out, model)
            else:
                self._report(st, kbytes, rank, workers, (epoch, seq, index), ts, event, now, out, model)

    def _void_before_reset(self, last: Position, epoch: int, seq: int, events: list,
                           first: int) -> tuple[list, int]:
        """Rank 0's reports positioned at or before ``last`` (the events left, their first index).

        Rank 0 reports in order, so this only happens when a Reset of another rank was forwarded
        between two parts of rank 0's split batch, positioned after that batch (rule 7). Had the
        batch been one record, its reports would have preceded the Reset, which drops every pending
        aggregate: these reports are dropped likewise (they must not pair with the other ranks'
        reports of the new run)."""
        drop = len(events) if (epoch, seq) < last[:2] else min(len(events), last[2] + 1 - first)
        self.stats.dropped_by_reset += drop
        return events[drop:], first + drop

    def _state(self, key: str, batch: EventBatch, partition: int) -> HolderState:
        st = self.holders.get(key)
        if st is None:
            st = HolderState(HolderMeta(batch.replica, batch.dp_rank, partition))
            st.meta_dirty = True
            self.holders[key] = st
        return st

    def _topic_for(self, ownership: Optional[str]) -> str:
        topic = self._tier_topics.get(ownership)
        if topic is None:
            topic = self._tier_topics[ownership] = self.topics.for_ownership(ownership)
        return topic

    def _note_tier(self, st: HolderState, ownership: str) -> None:
        if ownership not in st.meta.tiers:
            st.meta.tiers.append(ownership)
            st.meta_dirty = True

    def _pass_through(self, batch: EventBatch, partition: int, out: list[Output]) -> None:
        key = holder_key(batch.replica, batch.dp_rank)
        kbytes = key.encode()
        replica, dp_rank, epoch, seq, ts = batch.replica, batch.dp_rank, batch.epoch, batch.seq, batch.ts
        model = batch.model
        self.stats.reports += len(batch.events)
        for index, event in enumerate(batch.events, batch.first_index):
            value = BlockEvent(replica=replica, epoch=epoch, seq=seq, index=index, ts=ts,
                               event=event, dp_rank=dp_rank, model=model)
            t = type(event)
            if t is Reset:
                st = self.holders.get(key)
                self._fan_out_reset(st, kbytes, partition, value, out)
                continue
            ownership = None if t is AllBlocksCleared else event.ownership
            if ownership is not None:
                self._note_tier(self._state(key, batch, partition), ownership)
            out.append(Output(self._topic_for(ownership), kbytes, partition, value, "passthrough"))
            self.stats.passthrough += 1

    def _report(self, st: HolderState, kbytes: bytes, rank: int, workers: int, pos: Position,
                ts: float, event: Event, now: float, out: list[Output], model: str | None = None) -> None:
        ident = identity(event, workers)
        pending = st.pending
        aggs = pending.get(ident)
        st.dirty.add(ident)
        if aggs is None:
            pending[ident] = [Aggregate(ident, workers, event, ts, rank, {rank: pos}, pos, now,
                                        st.meta.partition, model)]
            return
        for i, agg in enumerate(aggs):
            if rank not in agg.reports:
                break
        else:
            aggs.append(Aggregate(ident, workers, event, ts, rank, {rank: pos}, pos, now,
                                  st.meta.partition, model))
            return
        agg.reports[rank] = pos
        if rank < agg.low:
            agg.low, agg.event, agg.ts, agg.model = rank, event, ts, model
        if len(agg.reports) < workers:
            return
        del aggs[i]
        if not aggs:
            del pending[ident]
        self._complete(st, kbytes, agg, out)

    def _complete(self, st: HolderState, kbytes: bytes, agg: Aggregate, out: list[Output]) -> None:
        meta = st.meta
        pos = agg.reports[0]
        if meta.last is not None and pos <= meta.last:
            self.stats.disordered += 1
            out.append(self._incomplete(meta, kbytes, agg, "disordered"))
            return
        meta.last = pos
        st.meta_dirty = True
        event = agg.event
        t = type(event)
        value = BlockEvent(replica=meta.replica, epoch=pos[0], seq=pos[1], index=pos[2],
                           ts=agg.ts, event=event, dp_rank=meta.dp_rank, model=agg.model)
        if t is AllBlocksCleared:
            out.append(Output(self.topics.blocks, kbytes, meta.partition, value, "consolidated"))
            self.stats.consolidated += 1
            self._clear_before(st, kbytes, agg, out)
            return
        ownership = event.ownership
        if ownership is not None:
            self._note_tier(st, ownership)
        out.append(Output(self._topic_for(ownership), kbytes, meta.partition, value, "consolidated"))
        self.stats.consolidated += 1

    def _clear_before(self, st: HolderState, kbytes: bytes, clear: Aggregate,
                      out: list[Output]) -> None:
        """Expire aggregates some worker reported before its own AllBlocksCleared: the workers
        missing from them have already passed that point, so they will never report them."""
        at = clear.reports
        for ident in list(st.pending):
            aggs = st.pending[ident]
            keep = []
            for agg in aggs:
                if any(p < at[r] for r, p in agg.reports.items() if r in at):
                    self.stats.cleared += 1
                    out.append(self._incomplete(st.meta, kbytes, agg, "cleared"))
                else:
                    keep.append(agg)
            if len(keep) != len(aggs):
                st.dirty.add(ident)
                if keep:
                    st.pending[ident] = keep
                else:
                    del st.pending[ident]

    def _reset(self, st: HolderState, kbytes: bytes, rank: int, pos: Position, ts: float,
               event: Reset, now: float, out: list[Output], model: str | None = None) -> None:
        meta = st.meta
        if (
            meta.era_started is not None
            and rank not in meta.era_ranks
            and now - meta.era_started <= self.window
        ):
            # Same incident as the Reset already forwarded: this rank's old reports are void.
            meta.era_ranks.append(rank)
            st.meta_dirty = True
            self.stats.resets_coalesced += 1
            self._drop(st, lambda agg: rank in agg.reports)
            return
        if rank == 0:
            at = pos
        else:
            h0 = meta.hwm.get(0)
            at = (h0[0], h0[1], AFTER_BATCH) if h0 is not None else (0, -1, 0)
        self._drop(st, lambda agg: True)
        meta.era_ranks = [rank]
        meta.era_started = now
        st.meta_dirty = True
        if meta.last is not None and at <= meta.last:
            # Nothing was consolidated since the last forwarded Reset, which sits at this very
            # position: consumers already dropped this holder's residency there.
            self.stats.resets_coalesced += 1
            return
        meta.last = at
        value = BlockEvent(replica=meta.replica, epoch=at[0], seq=at[1], index=at[2], ts=ts,
                           event=event, dp_rank=meta.dp_rank, model=model)
        self._fan_out_reset(st, kbytes, meta.partition, value, out)

    def _fan_out_reset(self, st: Optional[HolderState], kbytes: bytes, partition: int,
                       value: BlockEvent, out: list[Output]) -> None:
        self.stats.resets += 1
        out.append(Output(self.topics.blocks, kbytes, partition, value, "reset"))
        if st is not None:
            for tier in st.meta.tiers:
                out.append(Output(self._topic_for(tier), kbytes, partition, value, "reset"))

    def _drop(self, st: HolderState, which) -> None:
        for ident in list(st.pending):
            aggs = st.pending[ident]
            keep = [a for a in aggs if not which(a)]
            if len(keep) != len(aggs):
                self.stats.dropped_by_reset += len(aggs) - len(keep)
                st.dirty.add(ident)
                if keep:
                    st.pending[ident] = keep
                else:
                    del st.pending[ident]

    # -- expiry ---------------------------------------------------------------

    def expire(self, now: float, out: list[Output]) -> None:
        """Turn every aggregate first reported more than ``window`` seconds before ``now``
        into an Incomplete output."""
        deadline = now - self.window
        for key, st in self.holders.items():
            if not st.pending:
                continue
            kbytes = None
            for ident in list(st.pending):
                aggs = st.pending[ident]
                if aggs[0].created > deadline:
                    continue
                keep = [a for a in aggs if a.created > deadline]
                kbytes = kbytes or key.encode()
                for agg in aggs:
                    if agg.created <= deadline:
                        self.stats.incomplete += 1
                        out.append(self._incomplete(st.meta, kbytes, agg, "incomplete"))
                st.dirty.add(ident)
                if keep:
                    st.pending[ident] = keep
                else:
                    del st.pending[ident]

    def _incomplete(self, meta: HolderMeta, kbytes: bytes, agg: Aggregate, kind: str) -> Output:
        reported = sorted(agg.reports)
        missing = [r for r in range(agg.workers) if r not in agg.reports]
        first = agg.first
        value = Incomplete(replica=meta.replica, epoch=first[0], seq=first[1], index=first[2],
                           workers=agg.workers, reported=reported, missing=missing,
                           event=agg.event, dp_rank=meta.dp_rank)
        return Output(self.topics.incomplete, kbytes, meta.partition, value, kind)

    def pending_count(self) -> int:
        """Open aggregates over all holders."""
        return sum(st.pending_count() for st in self.holders.values())

    # -- durable state --------------------------------------------------------

    def flush(self, keys: Optional[Iterable[str]] = None) -> Iterator[tuple[int, bytes, Optional[bytes]]]:
        """Changes since the last flush as ``(partition, store_key, value-or-None)``, for the
        holders ``keys`` (default: all). Aggregate entries come first, each holder's meta
        last, so a store that kept a prefix of them still has a usable state.
        """
        for key in self.holders if keys is None else keys:
            st = self.holders.get(key)
            if st is None:
                continue
            part = st.meta.partition
            if st.dirty:
                for ident in st.dirty:
                    aggs = st.pending.get(ident)
                    if aggs:
                        st.persisted.add(ident)
                        yield part, aggregate_key(key, ident), encode_aggregates(aggs)
                    elif ident in st.persisted:
                        st.persisted.discard(ident)
                        yield part, aggregate_key(key, ident), None
                st.dirty.clear()
            if st.meta_dirty:
                st.meta_dirty = False
                yield part, meta_key(key), encode_meta(st.meta)


# -- store layout -------------------------------------------------------------

_SEP = b"\x00"
_META_DECODER = msgspec.msgpack.Decoder(HolderMeta)
_AGGS_DECODER = msgspec.msgpack.Decoder(list[Aggregate])


def meta_key(holder: str) -> bytes:
    """Store key of a holder's meta: ``<holder>\\0``."""
    return holder.encode() + _SEP


def is_meta_key(key: bytes) -> bool:
    """Whether a store key is a holder's meta (:func:`meta_key`) rather than an aggregate entry
    (holder names never contain NUL: :func:`check`)."""
    return key.find(_SEP) == len(key) - 1


def aggregate_key(holder: str, ident: bytes) -> bytes:
    """Store key of a holder's open aggregates of one identity: ``<holder>\\0<identity>``."""
    return holder.encode() + _SEP + ident


def encode_meta(meta: HolderMeta) -> bytes:
    """msgpack of a HolderMeta."""
    return _ENCODER.encode(meta)


def encode_aggregates(aggs: list[Aggregate]) -> bytes:
    """msgpack of the open aggregates of one identity."""
    return _ENCODER.encode(aggs)


def load(items: Iterable[tuple[bytes, bytes]], partitions: Optional[set[int]] = None
         ) -> dict[str, HolderState]:
    """Rebuild holder states from store ``(key, value)`` items, keeping holders whose meta
    says they live in ``partitions`` (all when None). Aggregates whose meta is missing (a crash
    between the two writes of a new holder) get a meta rebuilt from their key, so they are
    replayed over and deleted as usual.
    """
    metas: dict[str, HolderMeta] = {}
    aggs: dict[str, dict[bytes, list[Aggregate]]] = {}
    for key, value in items:
        if value is None:
            continue
        holder, _, ident = bytes(key).partition(_SEP)
        name = holder.decode()
        if ident:
            aggs.setdefault(name, {})[ident] = _AGGS_DECODER.decode(value)
        else:
            metas[name] = _META_DECODER.decode(value)
    for name, entries in aggs.items():
        if name not in metas:
            replica, _, dp = name.rpartition("#")
            part = next(iter(entries.values()))[0].partition
            metas[name] = HolderMeta(replica, int(dp or 0), part)
    states: dict[str, HolderState] = {}
    for name, meta in metas.items():
        if partitions is not None and meta.partition not in partitions:
            continue
        pending = aggs.get(name, {})
        states[name] = HolderState(meta, pending=pending, persisted=set(pending))
    return states
