"""What the Faust agent and timer call: decode, aggregate, publish, persist, ack.

One :class:`Runtime` per worker process. It owns the process's share of aggregation state
(:class:`kvbus.streams.aggregation.Aggregator` over plain dicts), the output producer, the codec and
the metrics. Each batch of raw records (and each expiry sweep) goes through:

1. decode and check each record (bad ones become DeadLetters) and apply it to the state;
2. produce every output and dead letter, and snapshot the state changes it made
   (serialised table entries: changed aggregates first, then each holder's meta);
3. once Kafka has acknowledged *every* record of the batch (and of all earlier batches):
   write the snapshot to the Faust table (changelog), then ack the batch's raw records.

Step 3 runs in a completion task, so the next batch is decoded while this one is delivered
(at most ``MAX_INFLIGHT`` batches wait); batches delivered by the same time are completed
together, their state changes merged (the last value of each key: fewer table writes). Faust only
commits acked offsets and flushes its producer (the changelog) before committing. Hence: a table
entry never describes a record whose outputs could still be lost, and a committed record's state is
in the changelog. After a crash the new owner restores the table and replays from the committed
offset; what the state already contains is recognised by the per-worker (epoch, seq, index)
high-water marks, and everything else is applied again and re-emitted with its original position.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import defaultdict, deque
from typing import Any, Iterable, Optional, Sequence

from confluent_kafka import KafkaError, KafkaException, Producer
from confluent_kafka.admin import AdminClient

from kvbus.runtime.backoff import Backoff
from kvbus.runtime.collector import tune_gc
from kvbus.runtime.kafka_clients import DeliveryErrors, GroupOffsets, RateLimitedLog, ensure_topics, producer_conf
from kvbus.runtime.probes import Readiness
from kvbus.runtime.settings import Settings
from kvbus.schemas.events import DeadLetter, dead_letter, holder_key
from kvbus.schemas.serde import registry_client
from kvbus.schemas.topics import record_spec
from kvbus.streams.aggregation import Aggregator, Output, check, is_meta_key, load
from kvbus.streams.faust_adapter import AssignmentChanged, ChangelogPartition, forget_gaps, release, rewind
from kvbus.streams.metrics import StreamsMetrics
from kvbus.streams.offset_guard import Admission, OffsetGuard
from kvbus.streams.options import StreamsOptions
from kvbus.streams.packing import Packer
from kvbus.streams.record_values import Codec

log = logging.getLogger("kvbus.streams")

PROCESS = Admission.PROCESS
"""The guard's verdict on a record in order (a module global: compared once per record in the hot loop)."""

MAX_INFLIGHT = 32
"""Batches whose outputs may be awaiting delivery while the next one is processed (batches are
small at low load: a few milliseconds of records each, so a delivery round trip spans several)."""

PERSIST_EVERY = 0.02
"""Seconds delivered batches may wait to be completed together: their state changes are merged
(the last value of each key) into one set of table writes, then their raw records are acked.
Outputs are not delayed (they were produced and acknowledged already); offsets are committed
every second anyway, so this only bounds how many table writes a burst of small batches costs."""

POLL_EVERY = 0.01
"""Seconds between two looks at the output producer's delivery reports while batches are in flight
(a drain waits :data:`POLL_DRAINING`). Only completion waits on them (table writes and acks, which
offsets committed every second follow): outputs reach Kafka without it, so looking less often makes
no event later; each look is a wake-up of the event loop, at 1 ms a thousand a second under load."""
POLL_DRAINING = 0.001
"""Seconds between two looks while a rebalance waits for the batches in flight."""

RETRY_FIRST = 0.2
"""Seconds before output records Kafka refused are produced again (doubling, jittered: kvbus.runtime.backoff)."""
RETRY_CAP = 5.0
"""Seconds no pause between two such tries exceeds."""

OFFSETS_TIMEOUT = 10.0
"""Seconds a look-up of log offsets for table recovery may take before it fails (Faust's own
look-up is then asked instead)."""

TOPIC_GONE = frozenset({KafkaError._UNKNOWN_TOPIC, KafkaError._UNKNOWN_PARTITION})
"""Codes with which ``produce()`` refuses a record whose topic (or partition) the client no longer
knows: a topic being deleted and recreated. Produced again after a backoff, not a crash."""


def start_warm_up(runtime: "Runtime") -> threading.Thread:
    """Run :meth:`Runtime.warm_up` on a daemon thread of its own; the thread."""
    thread = threading.Thread(target=runtime.warm_up, name="kvbus-warm-up", daemon=True)
    thread.start()
    return thread


class _Batch:
    """Outputs of one processing step on their way to Kafka, and what to do once delivered."""

    __slots__ = ("events", "items", "remaining", "failed", "created")

    def __init__(self, events: Sequence[Any]):
        self.events = events
        """Faust events to ack once the batch is durable (empty for sweeps)."""
        self.items: list[tuple[int, bytes, Optional[bytes]]] = []
        """State changes: (raw partition, table key, value or None to delete)."""
        self.remaining = 0
        """Produced records not yet acknowledged by Kafka."""
        self.failed: list[tuple[str, bytes, bytes, int, Any]] = []
        self.created = time.perf_counter()

    def delivered(self, err: Any, msg: Any) -> None:
        """librdkafka delivery report (served by ``poll`` on the event-loop thread)."""
        if err is not None:
            self.failed.append((msg.topic(), msg.key(), msg.value(), msg.partition(), err))
        self.remaining -= 1

    def refused(self, topic: str, key: bytes, value: bytes, partition: int, err: Any) -> None:
        """A record ``produce()`` refused before queueing it (no delivery report follows): failed
        like a refused delivery, so it is produced again after a backoff. ``err`` is the KafkaError,
        e.g. ``_UNKNOWN_TOPIC`` while an operator deletes and recreates the topic."""
        self.failed.append((topic, key, value, partition, err))
        self.remaining -= 1


class Runtime:
    """The streams stage inside one worker process."""

    def __init__(self, app: Any, settings: Settings, options: StreamsOptions, table: Any):
        self.app = app
        self.settings = settings
        self.options = options
        self.table = table
        self.topics = settings.topics
        self.aggregator = Aggregator(settings.topics, options.window)
        self._packer = Packer(settings.topics) if options.block_layout == "packed" else None
        """Lays the outputs out in block layout 2 (:mod:`kvbus.streams.packing`); None: layout 1."""
        self.metrics = StreamsMetrics()
        self.lock = asyncio.Lock()
        """Serialises changes of the aggregation state (agent, timer, rebuild)."""
        self.ready = False
        """False between a revocation and the end of the next recovery."""
        self.assigned: frozenset[int] = frozenset()
        """Raw partitions whose state was rebuilt at the last recovery (this worker's share)."""
        self.guard = OffsetGuard()
        """Each raw partition's records in offset order, none skipped (:mod:`kvbus.streams.offset_guard`)."""
        self._processing: set[int] = set()
        """Raw partitions with a record processed since the last rebuild."""
        self._codec: Optional[Codec] = None
        self._producer: Optional[Producer] = None
        self.errors = DeliveryErrors(settings.kafka(), log)
        """What Kafka refused of the output producer (client errors, output records produced again)."""
        self._retry_log = RateLimitedLog(5.0, log)
        """The retries of refused output records (every ~0.1-5 s while a topic is recreated)."""
        self._admin: Optional[AdminClient] = None
        self._group_offsets: Optional[GroupOffsets] = None
        self._partitions: dict[str, int] = {}
        self._contexts: dict[int, ChangelogPartition] = {}
        self._inflight: deque[_Batch] = deque()
        self._delivered: list[_Batch] = []
        """Batches whose outputs are all acknowledged, in order, not yet completed."""
        self._complete_at = 0.0
        """perf_counter time by which ``_delivered`` is to be completed."""
        self._draining = False
        """Complete delivered batches at once (a rebalance is waiting for them)."""
        self._wake = asyncio.Event()
        self._progress = asyncio.Event()
        self._completer: Optional[asyncio.Task] = None
        self._started = False
        self._start_lock = threading.Lock()
        self._offsets_lock = threading.Lock()
        self.metrics.serve(options.metrics_port, Readiness([self.not_ready]))  # from the start: /healthz answers

    # -- lifecycle ------------------------------------------------------------

    def warm_up(self) -> None:
        """What the first assignment would otherwise wait for, done while the worker joins its group:
        connect the output producer, the registry and the admin client (:meth:`start`), and look up
        the group coordinator of the reader of committed offsets (the first rewind). Runs on a thread of
        its own (:func:`start_warm_up`); a failure is logged, and the first rebuild tries again."""
        t0 = time.perf_counter()
        try:
            self.start()
            self._committed([0])
        except Exception as exc:  # the first rebuild does the same and raises what it meets
            log.warning("warming up the worker's Kafka clients failed (the first assignment connects them): %s", exc)
            return
        log.info("worker's Kafka clients connected in %.2f s", time.perf_counter() - t0)

    def start(self) -> None:
        """Connect the producer, the registry and the admin client (idempotent; thread-safe, so that
        :meth:`warm_up` may run it on a thread of its own while the event loop starts)."""
        if self._started:
            return
        with self._start_lock:
            if not self._started:
                self._start()
                self._started = True

    def _start(self) -> None:
        tune_gc()
        s = self.settings
        self._codec = Codec(registry_client(s))
        kafka = s.kafka()
        self._producer = Producer(producer_conf(kafka, {
            "linger.ms": 2, "queue.buffering.max.messages": 1_000_000, "client.id": f"{self.options.app_id}-outputs",
        }, error_cb=self.errors.error_cb))
        self._admin = AdminClient(kafka)
        md = self._admin.list_topics(timeout=30)
        for name, t in md.topics.items():
            if t.error is None:
                self._partitions[name] = len(t.partitions)
        blocks = self.topics.packed if self._packer is not None else self.topics.blocks
        for name in (blocks, self.topics.incomplete, self.topics.dlq):
            self._ensure_topic(name)
        raw_n = self._partitions.get(self.topics.raw)
        for name in (blocks, self.topics.incomplete):
            if raw_n and self._partitions.get(name, 0) < raw_n:
                log.error("topic %s has %s partitions, fewer than %s of %s: outputs there are "
                          "partitioned by key instead of by raw partition",
                          name, self._partitions.get(name), raw_n, self.topics.raw)
        log.info("streams runtime started: window=%.1fs raw=%s blocks=%s (layout %s) metrics_port=%s",
                 self.options.window, self.topics.raw, blocks, self.options.block_layout, self.options.metrics_port)

    def not_ready(self) -> str | None:
        """Why this worker is not ready (its ``/readyz``), None when it is: a rebalance is under way,
        the state table is recovering from its changelog, the state of the partitions assigned has
        not been rebuilt yet, or no raw partition is assigned to this worker (more workers than
        partitions). Called from the probe server's thread: it reads flags only."""
        why = self.recovering()
        if why is None and not self.assigned:
            return f"no partition of {self.topics.raw} is assigned to this worker"
        return why

    def recovering(self) -> str | None:
        """Why this worker is between a rebalance and the end of its recovery (the part of
        :meth:`not_ready` that must end), None when it is past it."""
        if getattr(self.app, "rebalancing", False):
            return "the consumer group is rebalancing"
        if getattr(self.app, "in_recovery", False):
            return "recovering the state table from its changelog"
        if not self.ready:
            return "waiting for partitions (the state of each assignment is rebuilt first)"
        return None

    def stop(self) -> None:
        """Best effort: deliver what is queued (un-acked batches are replayed after a restart)."""
        if self._producer is not None:
            self._producer.flush(10)
        if self._group_offsets is not None:
            self._group_offsets.close()
            self._group_offsets = None

    # -- the agent ------------------------------------------------------------

    async def process(self, events: Sequence[Any]) -> None:
        """Process one batch of raw Faust events; they are acked once durable (module doc).

        The caller holds each event (:func:`kvbus.streams.faust_adapter.hold`) so that Faust's own ack
        at the end of the batch does not make its offset committable early.
        """
        self.start()
        t0 = time.perf_counter()
        self._pace_fetches(len(events))
        async with self.lock:
            assignment = self.app.consumer.assignment()
            out: list[Output] = []
            dead: list[DeadLetter] = []
            touched: set[str] = set()
            now = time.time()
            agg, codec, admit = self.aggregator, self._codec, self.guard.admit
            held: list[Any] = []
            for event in events:
                msg = event.message
                if msg.tp not in assignment:
                    continue  # revoked while buffered: the new owner replays it
                verdict = admit(msg.partition, msg.offset)
                if verdict is not PROCESS and not self._admit_past_gap(msg, verdict):
                    held.append(event)
                    continue
                if msg.partition not in self._processing:
                    self._processing.add(msg.partition)
                    log.info("raw partition %s: first record processed at offset %s", msg.partition, msg.offset,
                             extra={"topic": msg.topic, "partition": msg.partition, "offset": msg.offset})
                value = msg.value
                try:
                    batch = codec.decode(value, msg.topic)
                except Exception as exc:
                    dead.append(self._dead_letter(msg, "decode", exc))
                    continue
                reason = check(batch, msg.key)
                if reason is not None:
                    dead.append(self._dead_letter(msg, "invariant", reason))
                    continue
                agg.apply(batch, msg.partition, now, out)
                touched.add(holder_key(batch.replica, batch.dp_rank))
            if held:  # never acked: no commit may cover the records skipped before them
                kept = {id(e) for e in held}
                events = [e for e in events if id(e) not in kept]
            await self._enqueue(_Batch(events), out, dead, touched)
            self.metrics.sync(agg.stats)
        self.metrics.batch_seconds.observe(time.perf_counter() - t0)
        while len(self._inflight) > MAX_INFLIGHT:
            self._progress.clear()
            await self._progress.wait()

    def _admit_past_gap(self, msg: Any, verdict: Admission) -> bool:
        """Act on the ``verdict`` of :meth:`OffsetGuard.admit` on ``msg`` other than PROCESS (a record
        past a gap in its partition's offsets), and say whether ``msg`` is processed now."""
        partition, offset = msg.partition, msg.offset
        if verdict is Admission.REREAD:
            expected = self.guard.next[partition]
            self.metrics.offset_gaps.labels("reread").inc()
            log.warning("raw partition %s: record at offset %s delivered while %s was expected: %s records "
                        "skipped by the consumer; reading the partition again from %s (its records past the "
                        "gap are held back until then)", partition, offset, expected, offset - expected, expected,
                        extra={"topic": msg.topic, "partition": partition, "offset": offset})
            forget_gaps(self.app.consumer, msg.tp)  # the jump is not records absent from the log
            asyncio.ensure_future(self._reread(msg.tp, expected))
            return False
        if verdict is Admission.GONE:
            self.metrics.offset_gaps.labels("gone").inc()
            log.warning("raw partition %s: read again, the log continues at offset %s: the records before it "
                        "that were skipped are no longer in the log (retention)", partition, offset,
                        extra={"topic": msg.topic, "partition": partition, "offset": offset})
            return True
        return False

    async def _reread(self, tp: Any, offset: int) -> None:
        """Seek ``tp`` back to ``offset`` (on the consumer's thread); a partition revoked meanwhile
        is left to its next owner."""
        try:
            await rewind(self.app.consumer, {tp: offset})
        except Exception as exc:
            log.warning("reading raw partition %s again from %s failed (%s: %s); its next owner starts from "
                        "the committed offset", tp.partition, offset, type(exc).__name__, exc)

    def _dead_letter(self, msg: Any, kind: str, error: Any) -> DeadLetter:
        reason = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        source = f"{msg.topic}[{msg.partition}]@{msg.offset}"
        log.warning("dead letter %s: %s", source, reason,
                    extra={"topic": msg.topic, "partition": msg.partition, "offset": msg.offset})
        self.metrics.dead_letters.labels(kind).inc()
        value = msg.value if isinstance(msg.value, (bytes, bytearray)) else b""
        # the payload is cut to DLQ_PAYLOAD_BYTES: a ~1 MB raw value would make a DeadLetter larger than
        # a record may be, produce() would raise and the worker crash on every replay
        return dead_letter("streams", source, f"{kind}: {reason}", [value], time.time())

    # -- the timer ------------------------------------------------------------

    async def sweep(self) -> None:
        """Serve the idle clients' queues; expire partial aggregates older than the window; refresh gauges."""
        self._serve_clients()
        self._pace_fetches(0)
        if not self.ready:
            return
        self.start()
        async with self.lock:
            out: list[Output] = []
            self.aggregator.expire(time.time(), out)
            await self._enqueue(_Batch(()), out, [], None)
            self.metrics.sync(self.aggregator.stats)
        self.metrics.pending.set(self.aggregator.pending_count())
        self.metrics.holders.set(len(self.aggregator.holders))
        self._update_lag()

    def _pace_fetches(self, records: int) -> None:
        """Fetches that follow the load (:class:`kvbus.streams.faust_adapter.FetchPacing`; another transport's
        consumer: nothing)."""
        pace = getattr(self.app.consumer, "pace_fetches", None)
        if pace is not None:
            pace(records)

    def _serve_clients(self) -> None:
        """Serve the queues of the Kafka clients that nothing else polls all the time: the admin
        client, the offsets reader, and the output producer (polled by the completion loop only while
        batches are in flight). librdkafka queues their log lines and errors (at every broker fault)
        until they are polled, for the worker's whole life otherwise. The offsets reader is skipped
        while a rebuild reads through it (it is served at the next sweep)."""
        for client in (self._admin, self._producer):
            if client is not None:
                client.poll(0)
        if self._group_offsets is not None and self._offsets_lock.acquire(blocking=False):
            try:
                self._group_offsets.serve()
            finally:
                self._offsets_lock.release()

    def _update_lag(self) -> None:
        consumer = self.app.consumer
        for tp in consumer.assignment():
            if tp.topic != self.topics.raw:
                continue
            try:
                high = consumer.highwater(tp)
            except Exception:
                continue
            pos = self.guard.next.get(tp.partition)
            if high is not None and pos is not None:
                self.metrics.lag.labels(str(tp.partition)).set(max(0, high - pos))

    # -- rebalancing ----------------------------------------------------------

    async def rebuild(self) -> None:
        """After table recovery: rebuild the working state of the assigned raw partitions and
        rewind them to their committed offsets (see :meth:`_rewind`). A partition revoked while it
        is rebuilt (a broker or a worker paused, a member joining) leaves the worker unready: the
        rebalance that took it away ends in a recovery of its own, and so in the next rebuild."""
        t0 = time.perf_counter()
        async with self.lock:
            await self._drain()
            t_drained = time.perf_counter()
            tps = [tp for tp in self.app.assignor.assigned_actives() if tp.topic == self.topics.raw]
            actives = {tp.partition for tp in tps}
            try:
                await self._rewind(tps)
            except AssignmentChanged as exc:
                self.ready = False
                log.warning("raw partitions were revoked while the state was rebuilt (%s): the next "
                            "rebalance's recovery rebuilds it", exc)
                return
            t_rewound = time.perf_counter()
            states = load(self.table.items(), actives)
            self.aggregator.holders.clear()
            self.aggregator.holders.update(states)
            self._processing.clear()
            self.assigned = frozenset(actives)
            self.ready = True
            log.info("state rebuilt for raw partitions %s: %d holders, %d pending aggregates in %.2f s "
                     "(drain %.2f s, rewind %.2f s)", sorted(actives), len(states), self.aggregator.pending_count(),
                     time.perf_counter() - t0, t_drained - t0, t_rewound - t_drained,
                     extra={"partitions": sorted(actives)})

    async def _rewind(self, tps: list[Any]) -> None:
        """Seek each raw partition to its committed offset, or to its beginning if it has none;
        the offset guard expects each partition's records from there.

        Faust drops records fetched while a rebalance is in progress (stale generation or flow
        paused) and then relies on aiokafka's ``seek_to_committed``, which does nothing for a
        partition without a committed offset (or with offset 0): the dropped records would
        never be read again. Seen here when two workers of a new group start together.

        The seeks run on the consumer's own thread (:func:`kvbus.streams.faust_adapter.rewind`: seeking
        from the event loop's thread while changelog recovery is fetching killed the consumer thread
        after a SIGKILL handover on a loaded machine).
        """
        if not tps:
            return
        self.start()
        committed = await asyncio.get_running_loop().run_in_executor(
            None, self._committed, [tp.partition for tp in tps])
        # offset 0 for a partition without a committed offset: past a log start above 0 (retention),
        # the consumer resets to the earliest offset (auto_offset_reset), without a lookup here
        offsets = {tp: committed.get(tp.partition) or 0 for tp in tps}
        await rewind(self.app.consumer, offsets)
        # the guard expects a partition's records from its committed offset; one without any takes
        # whatever record comes first (the log's start)
        self.guard.rewound({tp.partition: committed[tp.partition] for tp in tps
                            if committed.get(tp.partition) is not None})
        log.info("raw partitions rewound to committed offsets %s", {tp.partition: committed.get(tp.partition)
                                                                      for tp in tps})

    def _committed(self, partitions: list[int]) -> dict[int, Optional[int]]:
        """Raw partition -> the group's committed offset there (None: none), read as
        :class:`~kvbus.runtime.kafka_clients.GroupOffsets` says (never through the admin client)."""
        with self._offsets_lock:  # the warm-up thread and the rebuild's executor thread
            offsets = self._offsets_reader().committed([(self.topics.raw, p) for p in partitions])
        return {partition: offset for (_topic, partition), offset in offsets.items()}

    def log_offsets(self, partitions: list[Any]) -> dict[Any, tuple[int, int]]:
        """Each topic partition's (earliest offset, high watermark), asked of Kafka now through the
        runtime's own consumer: what table recovery looks up (:func:`kvbus.streams.faust_adapter.look_up_offsets_with`).
        Raises KafkaException when Kafka cannot say within :data:`OFFSETS_TIMEOUT` s."""
        with self._offsets_lock:  # executor threads of recoveries and rebuilds
            marks = self._offsets_reader().watermarks([(tp.topic, tp.partition) for tp in partitions],
                                                      timeout=OFFSETS_TIMEOUT)
        return {tp: marks[(tp.topic, tp.partition)] for tp in partitions}

    def _offsets_reader(self) -> GroupOffsets:
        """The consumer of the worker's group that reads offsets (created at first use; callers hold
        ``_offsets_lock``)."""
        if self._group_offsets is None:
            self._group_offsets = GroupOffsets(self.settings.kafka(), self.options.app_id)
        return self._group_offsets

    def revoke(self, partitions: Iterable[int]) -> None:
        """Partitions were revoked: stop sweeping until the next recovery. Logs, per revoked raw
        partition, the offset of the next record to process (after the last one processed, or where
        it was rewound to), to compare with the committed offset the next owner starts from."""
        self.ready = False
        revoked = sorted(partitions)
        if revoked:
            log.info("raw partitions revoked, next offsets to process %s",
                     {p: self.guard.next.get(p) for p in revoked}, extra={"partitions": revoked})

    # -- publishing -----------------------------------------------------------

    async def _enqueue(self, batch: _Batch, out: list[Output], dead: list[DeadLetter],
                       holders: Optional[set[str]]) -> None:
        """Produce a batch's records, snapshot its state changes, and queue it for completion."""
        if self._packer is not None:
            out = self._packer.pack(out)
        missing = {o.topic for o in out if o.topic not in self._partitions}
        if missing:
            await asyncio.get_running_loop().run_in_executor(None, self._ensure_topics, missing)
        encode = self._codec.encode
        parts = self._partitions
        produce = self._produce
        cb = batch.delivered
        # counted before producing: a poll() inside _produce may serve this batch's reports already
        batch.remaining = len(out) + len(dead)
        for o in out:
            n = parts.get(o.topic, 0)
            produce(o.topic, o.key, encode(o.value, o.topic), o.partition if o.partition < n else -1, batch, cb)
        dlq = self.topics.dlq
        for d in dead:
            produce(dlq, d.source.encode(), encode(d, dlq), -1, batch, cb)
        batch.items = list(self.aggregator.flush(holders))
        if not batch.items and not batch.events and not batch.remaining:
            return
        self._inflight.append(batch)
        if self._completer is None or self._completer.done():
            self._completer = asyncio.ensure_future(self._complete_loop())
        self._wake.set()

    def _produce(self, topic: str, key: bytes, value: bytes, partition: int, batch: _Batch, cb: Any) -> None:
        """Queue one record of ``batch`` (counted in its ``remaining`` already; ``cb``: its
        ``delivered``, bound once per batch by the caller, not once per record). A full queue is
        waited out; a record the client refuses outright (a topic deleted under the worker) is
        :meth:`_Batch.refused`, and produced again by the completion loop; any other refusal raises."""
        while True:
            try:
                self._producer.produce(topic, value, key, partition=partition, on_delivery=cb)
                return
            except BufferError:
                self._producer.poll(0.05)
            except KafkaException as exc:
                if exc.args[0].code() not in TOPIC_GONE:
                    raise
                batch.refused(topic, key, value, partition, exc.args[0])
                return

    async def _complete_loop(self) -> None:
        """Serve delivery reports; complete batches in order once all their records are in Kafka.

        Anything unexpected here (a table write failing) crashes the worker: its un-acked
        records are then replayed by whoever owns the partitions next.
        """
        try:
            await self._complete_batches()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("completing output batches failed; stopping the worker")
            await self.app.crash(exc)

    async def _complete_batches(self) -> None:
        backoff = Backoff(first=RETRY_FIRST, cap=RETRY_CAP)
        producer = self._producer
        while True:
            producer.poll(0)
            done = self._delivered_batches()
            if done:
                backoff.reset()
                if not self._delivered:
                    self._complete_at = time.perf_counter() + PERSIST_EVERY
                self._delivered.extend(done)
                self._progress.set()  # fewer batches in flight: the agent may go on
            if self._delivered and (self._draining or time.perf_counter() >= self._complete_at):
                self._complete(self._delivered)
                self._delivered = []
            head = self._inflight[0] if self._inflight else None
            if head is not None and head.remaining <= 0 and head.failed:
                failed, head.failed = head.failed, []
                for topic, _, _, _, err in failed:
                    self.errors.refused(err, topic)
                pause = backoff.next()
                self._retry_log(logging.WARNING, "%d output records refused (%s): produced again in %.1fs",
                                len(failed), self.errors.take()[-1], pause)
                await asyncio.sleep(pause)
                head.remaining += len(failed)
                cb = head.delivered
                for topic, key, value, partition, _ in failed:
                    self._produce(topic, key, value, partition, head, cb)
                continue
            if self._inflight:
                await asyncio.sleep(POLL_DRAINING if self._draining else POLL_EVERY)
            elif self._delivered:
                self._wake.clear()
                await self._wait_wake(self._complete_at - time.perf_counter())
            else:
                self._wake.clear()
                await self._wake.wait()

    async def _wait_wake(self, timeout: float) -> None:
        """Until the next batch is queued (or a drain starts), at most ``timeout`` seconds."""
        try:
            await asyncio.wait_for(self._wake.wait(), max(0.0, timeout))
        except asyncio.TimeoutError:
            pass

    def _complete(self, batches: list[_Batch]) -> None:
        """Write the merged state changes of delivered batches, then ack their raw records."""
        self._persist(merge_changes(batches))
        for b in batches:
            release(b.events)  # the reference the agent took: the final ack, offset committable
        self._progress.set()

    def _delivered_batches(self) -> list[_Batch]:
        """Take the leading in-flight batches whose records Kafka all acknowledged (in order,
        up to the first one still waiting or with failed records)."""
        done = []
        inflight = self._inflight
        while inflight and inflight[0].remaining <= 0 and not inflight[0].failed:
            done.append(inflight.popleft())
        return done

    async def _drain(self) -> None:
        """Wait until every queued batch is complete (delivered, state written, acked)."""
        self._draining = True
        try:
            while self._inflight or self._delivered:
                self._progress.clear()
                self._wake.set()
                await self._progress.wait()
        finally:
            self._draining = False

    def _ensure_topics(self, names: Iterable[str]) -> None:
        for name in names:
            self._ensure_topic(name)

    def _ensure_topic(self, name: str) -> None:
        """Create ``name`` as a record topic of the stage's partition count and replication unless it exists."""
        if name in self._partitions:
            return
        ensure_topics(self._admin, [record_spec(name, self.settings.partitions, self.options.replication)])
        md = self._admin.list_topics(name, timeout=30).topics.get(name)
        self._partitions[name] = len(md.partitions) if md is not None and md.partitions else self.settings.partitions

    # -- durable state --------------------------------------------------------

    def _persist(self, items: list[tuple[int, bytes, Optional[bytes]]]) -> None:
        """Write state changes to the table, each under its holder's raw partition."""
        if not items:
            return
        raw = self.topics.raw
        assigned = {tp.partition for tp in self.app.consumer.assignment() if tp.topic == raw}
        table = self.table
        by_partition: dict[int, list[tuple[bytes, Optional[bytes]]]] = defaultdict(list)
        for partition, key, value in items:
            by_partition[partition].append((key, value))
        for partition, entries in by_partition.items():
            if partition not in assigned:
                continue  # revoked: its new owner rebuilds from the changelog and replays
            with self._context(partition):
                for key, value in entries:
                    if value is not None:
                        table[key] = value
                    elif key in table:  # a merged batch may delete what it never wrote
                        del table[key]

    def _context(self, partition: int) -> ChangelogPartition:
        """Table writes under it go to the changelog partition of raw partition ``partition``."""
        ctx = self._contexts.get(partition)
        if ctx is None:
            ctx = self._contexts[partition] = ChangelogPartition(self.topics.raw, partition)
        return ctx


def merge_changes(batches: Sequence[_Batch]) -> list[tuple[int, bytes, Optional[bytes]]]:
    """The state changes of consecutive batches as one snapshot: the last value of each key, every
    aggregate entry before every holder meta (the order each batch's own changes have)."""
    aggregates: dict[bytes, tuple[int, Optional[bytes]]] = {}
    metas: dict[bytes, tuple[int, Optional[bytes]]] = {}
    for b in batches:
        for partition, key, value in b.items:
            (metas if is_meta_key(key) else aggregates)[key] = (partition, value)
    return [(p, k, v) for k, (p, v) in aggregates.items()] + [(p, k, v) for k, (p, v) in metas.items()]

