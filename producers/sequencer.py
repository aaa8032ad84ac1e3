"""Sequence tracking of one engine publisher stream: gaps, replay fill, restarts, epochs.

Pure logic, no I/O: the bridge feeds it what it receives (live batches, replayed
batches, the end of a replay) and gets back what to produce, in order, plus when
to ask the engine for a replay. Items are opaque to the sequencer.

One engine publisher (one vLLM/SGLang scheduler = one (replica, dp_rank)) has one
sequence counter: ``seq`` starts at 0 when the publisher process starts and grows
by 1 per batch (``shared/docs/kv-events-protocol.md`` §1). Rules:

* ``seq == last + 1``: in order, produce it.
* ``seq > last + 1``: gap. With a replay endpoint, ask a replay from ``last + 1``,
  hold live batches until the replay ends, produce the replayed batches in order
  (dropping those already produced), then the held ones. What the replay could not
  fill becomes a ``Reset(gap-unrecoverable, missing_from, missing_to)`` marker in a
  NEW epoch, after which the stream continues in that epoch.
* ``seq <= last`` on the live stream: the engine restarted (its counter went back):
  ``Reset(engine-restart)`` in a new epoch; if the first batch of the new run is
  not seq 0 and a replay endpoint exists, replay from 0 first.
* First batch ever (no history recovered from Kafka): a new epoch; with a replay
  endpoint the batches the engine buffered before we connected are replayed from
  0 (ZMQ slow joiner). If the first batch produced is not seq 0 the engine's past
  is unknown: ``Reset(bridge-start)`` precedes it. A start-up replay that goes
  unanswered while live batches arrive is asked once more (the request may have
  timed out just as the engine came up; its live batches show it is up now).

A reset marker has seq = -1 in its new epoch and comes before every batch of that
epoch, so positions ``(epoch, seq, index)`` only grow.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Union

REASON_ENGINE_RESTART = "engine-restart"
REASON_GAP = "gap-unrecoverable"
REASON_BRIDGE_START = "bridge-start"

#: Most live batches held while a replay is pending; beyond, the replay is abandoned.
DEFAULT_MAX_HELD = 50_000


@dataclass(frozen=True)
class Emit:
    """Produce ``item`` (an engine batch) at position (epoch, seq)."""

    epoch: int
    seq: int
    item: Any
    replayed: bool = False
    """True when it came from a replay rather than the live stream."""


@dataclass(frozen=True)
class ResetMarker:
    """Produce a Reset marker batch (seq -1) opening ``epoch``."""

    epoch: int
    reason: str
    """engine-restart, gap-unrecoverable or bridge-start."""
    missing_from: int | None = None
    missing_to: int | None = None


Output = Union[Emit, ResetMarker]


@dataclass(frozen=True)
class Actions:
    """What the caller must do after feeding the sequencer."""

    out: list[Output] = field(default_factory=list)
    """Records to produce, in this order."""
    replay_from: int | None = None
    """When set: send a replay request starting at this seq, then feed replies
    with :meth:`Sequencer.on_replayed` and finish with :meth:`Sequencer.on_replay_end`."""


@dataclass
class SequencerStats:
    """Counters; the bridge exports them as metrics."""

    gaps: int = 0
    """Live gaps detected (seq > last + 1)."""
    replays: int = 0
    """Replay requests issued."""
    replays_incomplete: int = 0
    """Replays that ended by timeout (no end marker)."""
    recovered: int = 0
    """Batches produced from a replay."""
    duplicates: int = 0
    """Replayed batches dropped because they were already produced."""
    resets: int = 0
    """Reset markers produced (all reasons)."""
    restarts: int = 0
    """Engine restarts detected."""
    lost: int = 0
    """Sequence numbers declared lost in gap resets."""


def ms_clock() -> int:
    """Milliseconds since the Unix epoch (epoch ids)."""
    return int(time.time() * 1000)


class Sequencer:
    """Tracks one publisher stream. Not thread-safe; one per (replica, dp_rank, worker).

    ``replay``: whether a replay endpoint exists. ``epoch``/``last_seq`` resume a
    stream recovered from Kafka (``last_seq`` None: the epoch is open but its next
    seq is unknown, e.g. the last record was a bridge-start marker; -1: expect 0).
    ``is_last(item)``: on resume, tells whether the engine's batch ``last_seq`` is the one
    produced before (the start-up replay then begins at ``last_seq``); False means the
    engine restarted meanwhile and its new run already reached that seq.
    ``fingerprint(item)``: identity of a batch's content (default ``hash``), used to tell
    a late live copy of a replayed batch from a new run's batch of the same seq.
    """

    def __init__(
        self,
        *,
        replay: bool,
        epoch: int | None = None,
        last_seq: int | None = None,
        clock: Callable[[], int] = ms_clock,
        max_held: int = DEFAULT_MAX_HELD,
        is_last: Callable[[Any], bool] | None = None,
        fingerprint: Callable[[Any], Any] = hash,
    ) -> None:
        self.replay = replay
        self.epoch = epoch
        """Current epoch; None before the first batch."""
        self.last = last_seq if epoch is not None else None
        """Last seq produced in the current epoch (-1: a reset opened it); None: unknown."""
        self._clock = clock
        self._max_held = max_held
        self._fresh_reason: str | None = None
        """Reset reason to emit before the first batch of a fresh epoch (None: none)."""
        self._fresh = epoch is None
        """No batch produced yet and the engine's position is unknown."""
        self._pending: int | None = None
        """Start seq of the replay in flight."""
        self._replayed: dict[int, Any] = {}
        self._replay_seen: dict[int, Any] = {}
        """Fingerprint of every seq the replay in flight delivered (to spot live duplicates)."""
        self._late: dict[int, Any] = {}
        """Fingerprints of the last finished replay: the live copy of a replayed batch can
        arrive after the replay ended (two sockets); it is a duplicate, not a restart."""
        self._late_max = -1
        self._fingerprint = fingerprint
        self._held: list[tuple[int, Any]] = []
        self._is_last = is_last
        self._verify_seq: int | None = None
        """Seq whose replayed copy must match the batch produced before the restart."""
        self._restart_on_end = False
        """The resume check failed: the engine restarted; handled when the replay ends."""
        self._fresh_reasked = False
        """The start's replay went unanswered while live batches arrived and was asked again (once)."""
        self.stats = SequencerStats()

    # -- state ------------------------------------------------------------
    @property
    def replay_pending(self) -> bool:
        """A replay request is in flight (live batches are being held)."""
        return self._pending is not None

    @property
    def held(self) -> int:
        """Live batches held until the pending replay ends."""
        return len(self._held)

    def _new_epoch(self) -> int:
        now = self._clock()
        self.epoch = now if self.epoch is None or now > self.epoch else self.epoch + 1
        return self.epoch

    def _reset(self, reason: str, missing_from: int | None = None, missing_to: int | None = None) -> ResetMarker:
        self.stats.resets += 1
        if missing_from is not None and missing_to is not None:
            self.stats.lost += missing_to - missing_from + 1
        marker = ResetMarker(self._new_epoch(), reason, missing_from, missing_to)
        self.last = -1
        self._late = {}  # fingerprints of the old epoch mean nothing in the new one
        return marker

    def _open_epoch(self) -> None:
        """First sight of the stream without history: a new epoch whose past is unknown."""
        self._new_epoch()
        self.last = None
        self._fresh = True
        self._fresh_reason = REASON_BRIDGE_START

    def _request(self, start: int) -> int:
        self._pending = start
        self._replay_seen = {}
        self.stats.replays += 1
        return start

    # -- start ------------------------------------------------------------
    def start(self) -> Actions:
        """Call once before any live batch: asks a proactive replay when one can help
        (resume from the recovered seq, or the slow-joiner fill from 0)."""
        if not self.replay:
            return Actions()
        if self.epoch is None:
            self._open_epoch()
            return Actions(replay_from=self._request(0))
        if self.last is not None:
            if self._is_last is not None and self.last >= 0:
                self._verify_seq = self.last
                return Actions(replay_from=self._request(self.last))
            return Actions(replay_from=self._request(self.last + 1))
        return Actions()

    def catch_up(self) -> Actions:
        """Ask the engine for every batch after the last one produced, e.g. once live batches
        were shed: if the engine has gone quiet, no later batch would reveal the gap.
        Nothing happens without a replay endpoint, while a replay is in flight, or while the
        position is unknown. The replay's batches are produced in order; an empty answer
        changes nothing; what the engine no longer holds becomes a gap reset as usual."""
        if not self.replay or self._pending is not None or self.epoch is None or self.last is None or self._fresh:
            return Actions()
        return Actions(replay_from=self._request(self.last + 1))

    # -- live ---------------------------------------------------------------
    def on_live(self, seq: int, item: Any) -> Actions:
        """A batch arrived on the live stream."""
        if self._pending is not None:
            self._held.append((seq, item))
            if len(self._held) > self._max_held:
                return self.on_replay_end(complete=False)
            return Actions()
        if self._late and self._late_duplicate(seq, item):
            return Actions()
        out: list[Output] = []
        replay_from = self._feed(seq, item, out, allow_replay=True)
        return Actions(out, replay_from)

    def _late_duplicate(self, seq: int, item: Any) -> bool:
        """A live batch the last replay already delivered (same seq, same content)."""
        late = self._late
        if not late:
            return False
        fp = late.get(seq)
        if fp is None:
            if seq > self._late_max:
                self._late = {}  # live is past the replayed range: no more late copies
            return False
        if self.last is None or seq > self.last or fp != self._fingerprint(item):
            return False
        self.stats.duplicates += 1
        return True

    def _feed(self, seq: int, item: Any, out: list[Output], allow_replay: bool,
              covered: int | None = None) -> int | None:
        """Sequence one live batch; returns a replay start when one was requested
        (the batch is then held). ``allow_replay`` False: a gap may only be replayed
        if it starts after ``covered``, the newest seq a finished replay delivered
        (the engine published it after answering, so asking again can work)."""
        if self._fresh or self.epoch is None:
            return self._feed_fresh(seq, item, out, allow_replay)
        last = self.last
        if last is None:  # epoch open, position unknown: accept as the next one
            self._emit(seq, item, out)
            return None
        if seq == last + 1:
            self._emit(seq, item, out)
            return None
        if seq > last + 1:
            self.stats.gaps += 1
            if self.replay and (allow_replay or (covered is not None and last + 1 > covered)):
                self._held.append((seq, item))
                return self._request(last + 1)
            out.append(self._reset(REASON_GAP, last + 1, seq - 1))
            self._emit(seq, item, out)
            return None
        # seq <= last: the publisher's counter went back -> engine restart
        self.stats.restarts += 1
        out.append(self._reset(REASON_ENGINE_RESTART))
        self._fresh = True
        self._fresh_reason = None  # the restart marker is already out
        return self._feed_fresh(seq, item, out, allow_replay=True)

    def _feed_fresh(self, seq: int, item: Any, out: list[Output], allow_replay: bool) -> int | None:
        """First batch of a stream whose position is unknown."""
        if self.epoch is None:
            self._open_epoch()
        if seq > 0 and self.replay and allow_replay:
            self._held.append((seq, item))
            return self._request(0)
        if seq > 0 and self._fresh_reason is not None:
            out.append(self._reset(self._fresh_reason))
        self._fresh = False
        self._fresh_reason = None
        self._emit(seq, item, out)
        return None

    def _emit(self, seq: int, item: Any, out: list[Output], replayed: bool = False) -> None:
        assert self.epoch is not None
        out.append(Emit(self.epoch, seq, item, replayed))
        self.last = seq
        if replayed:
            self.stats.recovered += 1

    # -- replay -------------------------------------------------------------
    def on_replayed(self, seq: int, item: Any) -> Actions:
        """One replayed batch arrived (in the engine's order). Produced right away
        when it is the next expected one, else kept until the replay ends."""
        if self._pending is None:
            return Actions()  # late reply of an abandoned replay
        if seq < self._pending or self._restart_on_end:
            return Actions()  # not what we asked for / a new run we will replay from 0
        if self._verify_seq is not None:
            verify, self._verify_seq = self._verify_seq, None
            if seq == verify:
                if self._is_last is not None and not self._is_last(item):
                    self._restart_on_end = True
                return Actions()
        self._replay_seen[seq] = self._fingerprint(item)
        if self._fresh:
            self._replayed[seq] = item  # decide the reset once we know the first seq
            return Actions()
        if self.last is not None and seq <= self.last:
            self.stats.duplicates += 1
            return Actions()
        if self.last is not None and seq == self.last + 1 and not self._replayed:
            out: list[Output] = []
            self._emit(seq, item, out, replayed=True)
            return Actions(out)
        self._replayed[seq] = item
        return Actions()

    def on_replay_end(self, complete: bool = True) -> Actions:
        """The replay ended: end marker (``complete``) or timeout/abandon (not complete).
        Produces what the replay recovered, the reset for what it could not, then the
        batches held meanwhile."""
        if self._pending is None:
            return Actions()
        if not complete:
            self.stats.replays_incomplete += 1
        self._pending = None
        self._verify_seq = None
        if self._restart_on_end:
            # the engine restarted while we were away: new epoch, then its new run from 0
            self._restart_on_end = False
            self._replayed = {}
            self.stats.restarts += 1
            marker = self._reset(REASON_ENGINE_RESTART)
            self._fresh = True
            self._fresh_reason = None
            return Actions([marker], replay_from=self._request(0))
        out: list[Output] = []
        replayed = sorted(self._replayed.items())
        self._replayed = {}
        held, self._held = self._held, []
        for seq, item in replayed:
            self._place(seq, item, out, replayed=True)
        replay_from: int | None = None
        replayed_seqs, self._replay_seen = self._replay_seen, {}
        covered = max(replayed_seqs) if complete and replayed_seqs else None
        self._late = replayed_seqs
        self._late_max = covered if covered is not None else max(replayed_seqs, default=-1)
        # the start's replay, asked before anything was known of the engine, went unanswered while
        # live batches came: the engine is up now (it may have come up as the request timed out),
        # so the slow joiner's first batches are asked for once more before the past is declared unknown
        reask = self._fresh and not complete and not replayed_seqs and bool(held) and not self._fresh_reasked
        self._fresh_reasked = self._fresh_reasked or reask
        for seq, item in held:
            if replay_from is not None:
                self._held.append((seq, item))
                continue
            if self._late_duplicate(seq, item):
                continue
            # a gap the finished replay covered cannot be filled by asking again (a
            # later one can); a restart detected here may still replay the new run from 0
            replay_from = self._feed(seq, item, out, allow_replay=reask, covered=covered)
        return Actions(out, replay_from)

    def _place(self, seq: int, item: Any, out: list[Output], replayed: bool) -> None:
        """Put one recovered batch in order after a replay (gaps become resets)."""
        if self._fresh:
            if seq > 0 and self._fresh_reason is not None:
                out.append(self._reset(self._fresh_reason))
            self._fresh = False
            self._fresh_reason = None
            self._emit(seq, item, out, replayed)
            return
        last = self.last
        if last is not None and seq <= last:
            self.stats.duplicates += 1
            return
        if last is not None and seq > last + 1:
            out.append(self._reset(REASON_GAP, last + 1, seq - 1))
        self._emit(seq, item, out, replayed)


def outputs_seqs(outputs: Iterable[Output]) -> list[int]:
    """Seq of each output (-1 for markers); handy in tests and logs."""
    return [o.seq if isinstance(o, Emit) else -1 for o in outputs]
