"""Several engine streams in one bridge process: one loop, one poller, one Kafka producer.

A node-level bridge serves every engine stream of its node (``kvbus bridge --streams FILE``); a
sidecar serves one (``--endpoint``), through the same loop. Each stream keeps its own
:class:`~kvbus.producers.bridge.Bridge`: its replica key, sequencer, epoch, start-up recovery and
replay-gap handling are exactly those of a bridge of its own. What the streams share is what
costs per process and per wake-up: the sockets are polled together, the producer (one
connection, one queue, so one produce request carries every stream's records) is served once per
pass, and the metrics are one set, summed over the streams.

**Adaptive batching** (:class:`Batching`): while the streams are busy (many engine batches a
second), or after a pass that read many at once, the loop pauses a little before reading again, so
that under load each pass reads (and the producer queues) more batches at once: the process wakes
up less often and Kafka gets fewer, larger produce requests (librdkafka sends one per partition
whose records are ready, so the pause is what batches them: the producer's own linger stays short).
Idle or light, it goes straight back to waiting on the sockets, so that a lone batch is produced as
soon as it arrives. Batches grow with load: the pause is fixed, the batches that arrive during it are not.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import zmq

from kvbus.producers.bridge import Bridge, Sink
from kvbus.producers.metrics import BridgeMetrics
from kvbus.runtime.load_rate import BusyRate

log = logging.getLogger("kvbus.producers.bridge")

DEFAULT_BATCH_WAIT = 0.002
"""Seconds :class:`Batching` pauses after a large pass."""
DEFAULT_BUSY_WAIT = 0.01
"""Seconds :class:`Batching` pauses after every pass while busy. With 8 engine streams at 15,000
events/s (~700 engine batches/s) a pass then reads ~7 batches, and Kafka gets at most ~100 produce
requests a second per partition (docs/performance.md)."""
DEFAULT_BATCH_LARGE = 8
"""Engine batches read in one pass that make it large."""
DEFAULT_BATCH_BUSY = 400.0
"""Engine batches a second (over the last :data:`RATE_EVERY` s) from which the loop counts as busy
and pauses after every pass; it counts as idle again below half of it. The pipeline benchmark's
node-level bridge reads ~260 batches/s at 2,000 events/s (no pause: freshness first) and ~700 at 15,000."""
RATE_EVERY = 0.5
"""Seconds over which :class:`Batching` measures the rate of engine batches."""


@dataclass
class Batching:
    """When the loop waits for more engine batches before reading again.

    ``wait``: seconds paused after a pass that read at least ``large`` engine batches (0: never).
    ``busy``: engine batches a second from which the loop counts as busy (0: never); while busy, it
    pauses ``busy_wait`` seconds after every pass. A pass that is neither large nor busy never
    pauses, so the pause costs freshness only when the batches come so fast that they would share a
    pass anyway (the rule: :class:`kvbus.runtime.load_rate.BusyRate`). ``clock``: seconds, monotonic
    (tests pass their own)."""

    wait: float = DEFAULT_BATCH_WAIT
    large: int = DEFAULT_BATCH_LARGE
    busy: float = DEFAULT_BATCH_BUSY
    busy_wait: float = DEFAULT_BUSY_WAIT
    clock: Optional[Callable[[], float]] = None
    load: BusyRate = field(init=False)
    """The rate of engine batches over the last :data:`RATE_EVERY` s, and whether every pass pauses now."""

    def __post_init__(self) -> None:
        self.load = BusyRate(self.busy, RATE_EVERY, self.clock)

    @property
    def is_busy(self) -> bool:
        """Whether every pass pauses now."""
        return self.load.is_busy

    def pause(self, read: int) -> float:
        """Seconds to pause after a pass that read ``read`` engine batches."""
        span = self.load.count(read)
        if span is not None and span[1] != self.load.is_busy:
            rate, self.load.is_busy = span
            log.info("%.0f engine batches/s: the loop %s", rate, f"pauses {self.busy_wait * 1000:.0f} ms after "
                     "every pass" if self.load.is_busy else "reads as batches arrive")
        if self.load.is_busy and self.busy_wait > 0:
            return self.busy_wait
        return self.wait if self.wait > 0 and read >= self.large else 0.0


class BridgeGroup:
    """Runs ``bridges`` (built with the shared ``sink``, ``metrics`` and ``poller``) in one loop."""

    def __init__(self, bridges: Sequence[Bridge], sink: Sink, metrics: BridgeMetrics, poller: zmq.Poller,
                 batching: Batching | None = None) -> None:
        if not bridges:
            raise ValueError("a bridge group needs at least one stream")
        self.bridges = list(bridges)
        self.sink = sink
        self.metrics = metrics
        self.poller = poller
        self.batching = batching if batching is not None else Batching()
        self.passes: Counter[int] = Counter()
        """Engine batches read in one pass -> passes that read so many (passes that read none are
        not counted): how batches grow with load."""
        self._stop = threading.Event()
        self._last_gauges = 0.0

    def open(self) -> None:
        """Connect every stream and issue its start-up replay."""
        for b in self.bridges:
            b.open()

    def stop(self) -> None:
        """Ask :meth:`run` to return (thread-safe)."""
        self._stop.set()

    def run(self, stop: Callable[[], bool] | None = None, poll_ms: int = 50) -> None:
        """Loop until :meth:`stop` (or ``stop()`` returns True)."""
        should_stop = stop or (lambda: False)
        while not self._stop.is_set() and not should_stop():
            self.step(poll_ms)

    def step(self, poll_ms: int = 50, max_live: int = 5000) -> int:
        """One pass: serve the producer, wait up to ``poll_ms`` for any stream's sockets, handle what
        each has, then pause as :attr:`batching` says; returns the engine batches read."""
        self.sink.service()
        for b in self.bridges:
            b.sync_poller()
        ready = dict(self.poller.poll(poll_ms))
        read = 0
        for b in self.bridges:  # also when no socket is ready: a stream's catch-up after shedding and
            read += b.handle(ready, max_live)  # its replay timeout are due whether or not batches arrive
        if read:
            self.passes[read] += 1
        now = time.monotonic()
        if now - self._last_gauges > 0.5:
            self._last_gauges = now
            for b in self.bridges:
                b.sync_metrics()
            self.metrics.held.set(sum(b.sequencer.held for b in self.bridges))
            self.sink.update_gauges()
        pause = self.batching.pause(read)
        if pause:
            self.sink.service()  # delivery reports of what is in flight, while the batches gather
            time.sleep(pause)
        return read

    def not_ready(self) -> str | None:
        """Why the group is not ready: the first stream that is not (its reason, naming its endpoint)."""
        for b in self.bridges:
            why = b.not_ready()
            if why:
                return why if len(self.bridges) == 1 else f"{b.cfg.replica} worker {b.cfg.worker_rank}: {why}"
        return None

    def close(self, flush_timeout: float = 30.0) -> int:
        """Flush the shared producer, then close every stream's sockets; returns records left undelivered."""
        left = self.sink.close(flush_timeout)
        for b in self.bridges:
            b.close_sockets()
        return left
