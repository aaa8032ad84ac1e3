"""What the Faust agent and timer call: decode, aggregate, publish, persist.

One :class:`Runtime` per worker process. It owns the process's share of aggregation state
(:class:`streams.aggregation.Aggregator` over plain dicts), the output producer, the codec
and the metrics, and writes state changes to the Faust table after the outputs they imply
are delivered. Order inside one batch (this is what makes a crash safe, see docs/streams.md):

1. decode and check each raw record (bad ones become DeadLetters) and apply it;
2. produce every output and wait until Kafka acknowledged all of them;
3. write the changed aggregates, then each holder's meta, to the table (changelog);
4. return, so the batch is acked; Faust commits offsets only after flushing its producer,
   i.e. after the table writes of step 3 are durable.

A state entry therefore never describes a record whose outputs could still be lost, and a
committed record's state is always in the changelog.
"""
from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections import defaultdict
from typing import Any, Iterable, Optional, Sequence

from confluent_kafka import KafkaException, Producer
from confluent_kafka.admin import AdminClient, NewTopic

from schemas.events import DeadLetter, holder_key
from schemas.serde import registry_client
from schemas.settings import Settings
from streams.aggregation import Aggregator, Output, check, load
from streams.codec import Codec
from streams.metrics import StreamsMetrics
from streams.options import StreamsOptions

log = logging.getLogger("kvbus.streams")


class _PartitionEvent:
    """Stand-in for the 'current event' Faust tables read the changelog partition from.

    Table writes normally go to the partition of the event being processed; state changes of
    a whole batch (or of an expiry sweep) are written per holder, so each write is made under
    a stand-in naming that holder's raw partition.
    """

    __slots__ = ("message", "__weakref__")

    class _Message:
        __slots__ = ("topic", "partition")

        def __init__(self, topic: str, partition: int):
            self.topic = topic
            self.partition = partition

    def __init__(self, topic: str, partition: int):
        self.message = self._Message(topic, partition)


class Runtime:
    """The streams stage inside one worker process."""

    def __init__(self, app: Any, settings: Settings, options: StreamsOptions, table: Any):
        self.app = app
        self.settings = settings
        self.options = options
        self.table = table
        self.topics = settings.topics
        self.aggregator = Aggregator(settings.topics, options.window)
        self.metrics = StreamsMetrics()
        self.lock = asyncio.Lock()
        self.ready = False
        """False between a revocation and the end of the next recovery."""
        self.next_offset: dict[int, int] = {}
        """Raw partition -> offset after the last record processed (for lag)."""
        self._codec: Optional[Codec] = None
        self._producer: Optional[Producer] = None
        self._admin: Optional[AdminClient] = None
        self._partitions: dict[str, int] = {}
        self._failed: list[tuple[str, bytes, bytes, int, Any]] = []
        self._contexts: dict[int, _PartitionEvent] = {}

    # -- lifecycle ------------------------------------------------------------

    def start(self) -> None:
        """Connect the producer, the registry and the metrics endpoint (idempotent)."""
        if self._producer is not None:
            return
        s = self.settings
        self._codec = Codec(registry_client(s.registry_url))
        self._producer = Producer({
            "bootstrap.servers": s.bootstrap,
            "enable.idempotence": True,  # acks=all, ordered retries, no duplicates from retries
            "linger.ms": 5,
            "compression.type": "lz4",
            "queue.buffering.max.messages": 1_000_000,
            "client.id": f"{self.options.app_id}-outputs",
        })
        self._admin = AdminClient({"bootstrap.servers": s.bootstrap})
        md = self._admin.list_topics(timeout=30)
        for name, t in md.topics.items():
            if t.error is None:
                self._partitions[name] = len(t.partitions)
        for name in (self.topics.blocks, self.topics.incomplete, self.topics.dlq):
            self._ensure_topic(name)
        raw_n = self._partitions.get(self.topics.raw)
        for name in (self.topics.blocks, self.topics.incomplete):
            if raw_n and self._partitions.get(name, 0) < raw_n:
                log.error("topic %s has %s partitions, fewer than %s of %s: outputs there are "
                          "partitioned by key instead of by raw partition",
                          name, self._partitions.get(name), raw_n, self.topics.raw)
        self.metrics.serve(self.options.metrics_port)
        log.info("streams runtime started: window=%.1fs raw=%s blocks=%s metrics_port=%s",
                 self.options.window, self.topics.raw, self.topics.blocks, self.options.metrics_port)

    def stop(self) -> None:
        """Deliver what is queued."""
        if self._producer is not None:
            self._producer.flush(30)

    # -- the agent ------------------------------------------------------------

    async def process(self, events: Sequence[Any]) -> None:
        """Process one batch of raw Faust events (see module doc for the order of steps)."""
        self.start()
        t0 = time.perf_counter()
        async with self.lock:
            assignment = self.app.consumer.assignment()
            out: list[Output] = []
            dead: list[DeadLetter] = []
            touched: set[str] = set()
            now = time.time()
            agg, codec = self.aggregator, self._codec
            for event in events:
                msg = event.message
                if msg.tp not in assignment:
                    continue  # revoked while buffered: the new owner replays it
                self.next_offset[msg.partition] = msg.offset + 1
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
            if out or dead:
                await self._publish(out, dead)
            self._persist(touched)
            self.metrics.sync(agg.stats)
        self.metrics.batch_seconds.observe(time.perf_counter() - t0)

    def _dead_letter(self, msg: Any, kind: str, error: Any) -> DeadLetter:
        reason = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        source = f"{msg.topic}[{msg.partition}]@{msg.offset}"
        log.warning("dead letter %s: %s", source, reason)
        self.metrics.dead_letters.labels(kind).inc()
        value = msg.value if isinstance(msg.value, (bytes, bytearray)) else b""
        return DeadLetter(stage="streams", source=source, reason=f"{kind}: {reason}",
                          payload=[bytes(value)], ts=time.time())

    # -- the timer ------------------------------------------------------------

    async def sweep(self) -> None:
        """Expire partial aggregates older than the window; refresh gauges."""
        if not self.ready:
            return
        self.start()
        async with self.lock:
            out: list[Output] = []
            self.aggregator.expire(time.time(), out)
            if out:
                await self._publish(out, [])
            self._persist(None)
            self.metrics.sync(self.aggregator.stats)
        self.metrics.pending.set(self.aggregator.pending_count())
        self.metrics.holders.set(len(self.aggregator.holders))
        self._update_lag()

    def _update_lag(self) -> None:
        consumer = self.app.consumer
        for tp in consumer.assignment():
            if tp.topic != self.topics.raw:
                continue
            try:
                high = consumer.highwater(tp)
            except Exception:
                continue
            pos = self.next_offset.get(tp.partition)
            if high is not None and pos is not None:
                self.metrics.lag.labels(str(tp.partition)).set(max(0, high - pos))

    # -- rebalancing ----------------------------------------------------------

    async def rebuild(self) -> None:
        """After table recovery: rebuild the working state of the assigned raw partitions."""
        async with self.lock:
            actives = {tp.partition for tp in self.app.assignor.assigned_actives()
                       if tp.topic == self.topics.raw}
            states = load(self.table.items(), actives)
            self.aggregator.holders.clear()
            self.aggregator.holders.update(states)
            for p in list(self.next_offset):
                if p not in actives:
                    del self.next_offset[p]
            self.ready = True
            log.info("state rebuilt for raw partitions %s: %d holders, %d pending aggregates",
                     sorted(actives), len(states), self.aggregator.pending_count())

    def revoke(self, partitions: Iterable[int]) -> None:
        """Partitions were revoked: stop sweeping until the next recovery."""
        self.ready = False
        self.aggregator.drop_partitions(set(partitions))

    # -- publishing -----------------------------------------------------------

    async def _publish(self, out: list[Output], dead: list[DeadLetter]) -> None:
        """Produce outputs and dead letters; return once Kafka has acknowledged every one."""
        missing = {o.topic for o in out if o.topic not in self._partitions}
        if missing:
            await asyncio.get_running_loop().run_in_executor(None, self._ensure_topics, missing)
        produce = self._produce
        encode = self._codec.encode
        parts = self._partitions
        for o in out:
            n = parts.get(o.topic, 0)
            produce(o.topic, o.key, encode(o.value, o.topic), o.partition if o.partition < n else -1)
        for d in dead:
            produce(self.topics.dlq, d.source.encode(), encode(d, self.topics.dlq), -1)
        await asyncio.get_running_loop().run_in_executor(None, self._deliver)

    def _produce(self, topic: str, key: bytes, value: bytes, partition: int) -> None:
        while True:
            try:
                self._producer.produce(topic, value, key, partition=partition, on_delivery=self._on_delivery)
                return
            except BufferError:
                self._producer.poll(0.05)

    def _on_delivery(self, err: Any, msg: Any) -> None:
        if err is not None:
            self._failed.append((msg.topic(), msg.key(), msg.value(), msg.partition(), err))

    def _deliver(self) -> None:
        """Block until every queued record is delivered, re-producing failed ones (backing off)."""
        delay = 0.2
        while True:
            while self._producer.flush(5.0) > 0:
                log.warning("waiting for Kafka to acknowledge %d output records", len(self._producer))
            if not self._failed:
                return
            failed, self._failed = self._failed, []
            log.error("%d output records failed (%s); retrying in %.1fs", len(failed), failed[0][4], delay)
            time.sleep(delay)
            delay = min(delay * 2, 5.0)
            for topic, key, value, partition, _ in failed:
                self._produce(topic, key, value, partition)

    def _ensure_topics(self, names: Iterable[str]) -> None:
        for name in names:
            self._ensure_topic(name)

    def _ensure_topic(self, name: str) -> None:
        """Create ``name`` with the stage's partition count unless it exists."""
        if name in self._partitions:
            return
        fut = self._admin.create_topics(
            [NewTopic(name, self.settings.partitions, self.options.replication)], operation_timeout=30
        )[name]
        try:
            fut.result()
            log.info("created topic %s (%d partitions, replication %d)", name, self.settings.partitions,
                     self.options.replication)
        except KafkaException as exc:
            if "TOPIC_ALREADY_EXISTS" not in str(exc) and "already exists" not in str(exc):
                raise
        md = self._admin.list_topics(name, timeout=30).topics.get(name)
        self._partitions[name] = len(md.partitions) if md is not None and md.partitions else self.settings.partitions

    # -- durable state --------------------------------------------------------

    def _persist(self, holders: Optional[Iterable[str]]) -> None:
        """Write state changes of ``holders`` (all when None) to the table, per raw partition."""
        assignment = self.app.consumer.assignment()
        raw = self.topics.raw
        table = self.table
        by_partition: dict[int, list[tuple[bytes, Optional[bytes]]]] = defaultdict(list)
        for partition, key, value in self.aggregator.flush(holders):
            by_partition[partition].append((key, value))
        for partition, items in by_partition.items():
            if not any(tp.topic == raw and tp.partition == partition for tp in assignment):
                continue  # revoked: its new owner rebuilds from the changelog and replays
            token = _set_current_event(self._context(partition))
            try:
                for key, value in items:
                    if value is None:
                        table.pop(key, None)
                    else:
                        table[key] = value
            finally:
                _reset_current_event(token)

    def _context(self, partition: int) -> _PartitionEvent:
        ctx = self._contexts.get(partition)
        if ctx is None:
            ctx = self._contexts[partition] = _PartitionEvent(self.topics.raw, partition)
        return ctx


def _set_current_event(event: _PartitionEvent) -> Any:
    from faust.streams import _current_event

    return _current_event.set(weakref.ref(event))


def _reset_current_event(token: Any) -> None:
    from faust.streams import _current_event

    _current_event.reset(token)
