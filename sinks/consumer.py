"""The sink: consume consolidated BlockEvents from Kafka and apply them to the residency view.

Loop (``SinkConsumer.step``): poll a batch from every block topic (regex subscription, so new tier
topics ``kvbus.blocks.<ownership>`` are picked up), decode and check each record (failures go to
the dead-letter topic), apply the batch to the store (FCALLs, pipelined; positions are stored with
the change, so redelivery is harmless), flush dead letters, then commit the offsets to Kafka.

Where the sink resumes is the view's business, the way Kafka Connect sinks keep their offsets in
their target: each batch's last FCALL stores the batch's Kafka offsets in the view (``P off``),
atomically with its changes, and the sink seeks to those offsets when it gets partitions and after
any Redis failure. So a view that rolled back (Redis killed with AOF ``everysec``, failover to a
lagging replica) is replayed forward from exactly where it stands, and a view that is gone is
rebuilt from the latest snapshot in Kafka (sinks/rebuild.py, sinks/snapshot.py) and replayed from
the snapshot's offsets. Every apply names the view's id: an apply to a view that was lost or
rebuilt meanwhile is refused and the sink resynchronises. Offsets committed to Kafka only serve
lag monitoring. Every ``expire_every`` seconds, when caught up, holders silent for ``stale_after``
seconds are expired; "silent" is measured by the records' arrival (their Kafka timestamps,
:func:`arrival_time`), not by the engines' clocks.
"""
from __future__ import annotations

import logging
import re
import threading
import time
from dataclasses import replace
from typing import Any

import redis
from confluent_kafka import (
    OFFSET_BEGINNING,
    TIMESTAMP_NOT_AVAILABLE,
    Consumer,
    KafkaError,
    KafkaException,
    Producer,
    TopicPartition,
)
from confluent_kafka.admin import AdminClient, OffsetSpec
from confluent_kafka.schema_registry.error import SchemaRegistryError

from kvbus.runtime.backoff import Backoff
from kvbus.runtime.kafka_clients import DeliveryErrors, consumer_conf as kafka_consumer_conf, producer_conf
from kvbus.runtime.security import describe_kafka_error
from kvbus.runtime.settings import Settings
from kvbus.schemas.codec import FastSerde
from kvbus.schemas.events import BlockEvent, dead_letter
from kvbus.schemas.serde import registry_client
from kvbus.schemas.topics import Topics
from kvbus.sinks.config import SinkConfig
from kvbus.sinks.layout_gate import LayoutGate, in_position_order
from kvbus.sinks.metrics import SinkMetrics
from kvbus.sinks.rebuild import READY, ensure_view, mark_ready_if_caught_up
from kvbus.sinks.snapshot import SnapshotReader
from kvbus.sinks.validate import event_problem, packed_problem, problem
from kvbus.sinks.view.redis_memory import NO_EVICTION, POLICY_SETTING, EvictionWatch, RedisFull, memory_policy
from kvbus.sinks.view.store import ResidencyStore, ViewChanged

log = logging.getLogger("kvbus.sinks")

STAGE = "sink"
RETRY_FIRST = 0.25
"""Seconds of the first pause before a batch is read again after a transient failure (registry or
Redis down); the pauses double while the failure lasts, jittered (kvbus.runtime.backoff)."""
RETRY_CAP = 2.0
"""Seconds no such pause exceeds: a sink resumes within about this long once the service is back."""
REDIS_DOWN = (redis.ConnectionError, redis.TimeoutError, redis.exceptions.ClusterError,
              redis.exceptions.ClusterDownError, redis.exceptions.TryAgainError)
"""Redis (or a Redis Cluster master) is unreachable, failing over or migrating a slot: wait and
resume from the view's offsets; never a reason to dead-letter or to stop."""
REDIS_WAIT = (*REDIS_DOWN, RedisFull, redis.exceptions.OutOfMemoryError)
"""Redis down, or full (OOM at ``maxmemory``): what a sink waits out where it reads or writes the
view's bookkeeping (where to resume, readiness, staleness), rather than stopping."""
FULL_LOG_EVERY = 60.0
"""Seconds between two ERROR lines about a full Redis (the first is logged at once), also when Redis
at its ``maxmemory`` takes a write now and then refuses the next (each refusal after an accepted
write is a new incident for the metric and readiness, not for the log)."""
SYNC_TIMEOUT = 120.0
"""Seconds a sink given partitions waits for Redis to find where to resume before it gives up."""
LAG_EVERY = 1.0
"""Seconds between two updates of the partition lag gauge."""
VIEW_CHECK_EVERY = 1.0
"""Seconds between checks that the view is where the sink left it, and whether a rebuilt view has
caught up (then it is marked ready)."""


def arrival_time(msg: Any) -> float:
    """When a record reached kvbus, in epoch seconds: its Kafka timestamp (CreateTime, set by the
    streams worker that produced it, or LogAppendTime if the topic says so), else the sink's clock.

    The view measures staleness with it rather than with the engine's ``ts``: an engine whose clock
    is off (or a replayed trace from another day) must neither be expired while it publishes nor be
    kept alive after it stops; and a record re-read after a restart keeps the time it first arrived."""
    kind, ms = msg.timestamp()
    return ms / 1000.0 if kind != TIMESTAMP_NOT_AVAILABLE and ms > 0 else time.time()


class TransientError(Exception):
    """A dependency is unavailable: the batch is read again later, nothing is dead-lettered."""


def is_transient(e: BaseException) -> bool:
    """Whether ``e`` says a service is unreachable or failing, rather than that the input is bad."""
    if isinstance(e, SchemaRegistryError):
        return e.http_status_code >= 500 or e.http_status_code <= 0
    if isinstance(e, (*REDIS_DOWN, ConnectionError, TimeoutError)):
        return True
    return any(c.__name__ in ("TransportError", "TimeoutException") for c in type(e).__mro__)


class SinkConsumer:
    """Kafka -> residency view.

    ``settings``: where Kafka and the registry are; ``store``: the view; ``config``: how the sink
    runs (:class:`kvbus.sinks.config.SinkConfig`: group, staleness, batch, commits, session timeout);
    ``topics``: topic names (default ``settings.topics``); ``metrics``: its Prometheus metrics;
    ``consumer_conf``: extra librdkafka consumer settings.
    """

    def __init__(
        self,
        settings: Settings,
        store: ResidencyStore,
        config: SinkConfig = SinkConfig(),
        *,
        topics: Topics | None = None,
        metrics: SinkMetrics | None = None,
        consumer_conf: dict[str, Any] | None = None,
    ):
        self.settings = settings
        self.store = store
        self.config = config
        self.topics = topics or settings.topics
        self.stale_after = config.stale_after
        self.expire_every = config.expire_every
        self.batch = config.batch
        self.poll_timeout = config.poll_timeout
        self.commit_every = config.commit_every
        self._last_commit = 0.0
        self._uncommitted = False
        self._positions: dict[tuple[str, int], int] = {}
        """Per assigned partition, the offset after the last record the view holds: what the group's
        commit says. Set from the view's offsets on assignment and resync, moved by every batch
        applied. Committed explicitly, never from librdkafka's offset store, which an assignment
        empties: a sink reassigned at the view's offsets with nothing new to read would otherwise
        leave the group's committed offset behind for good (a lag it does not have)."""
        self.metrics = metrics or SinkMetrics()
        registry = registry_client(settings)
        # Avro decoding generated from the .avsc files for records of the current schema (figures:
        # docs/benchmarks.md, sink decode); other schema versions decode through RecordSerde
        self.serde = FastSerde(registry, "BlockEvent", auto_register=False)
        self.packed_serde = FastSerde(registry, "BlockEvents", auto_register=False)
        self.dlq_serde = FastSerde(registry, "DeadLetter")
        kafka = settings.kafka()
        self.errors = DeliveryErrors(kafka, log)
        """What Kafka refused: the consumer's and the producer's client errors, dead letters refused."""
        # a stored offset outside the log is the sink's to decide (:meth:`_out_of_range`), never
        # librdkafka's silent jump to the start: it means the topic was recreated or truncated,
        # or retention deleted records the view never applied
        # heartbeats every tenth of the session (librdkafka's default is 3 s): when the group
        # coordinator's broker dies, the coordinator moves once the controller fences that broker;
        # librdkafka counts the session from the last heartbeat answered and, past it, leaves and
        # rejoins under a new member id, which makes the coordinator wait out the old member (a
        # rebalance of ~20 s seen on broker kills). Frequent heartbeats reach the new coordinator
        # sooner after the move, within the session
        role = {"session.timeout.ms": int(config.session_timeout * 1000),
                "heartbeat.interval.ms": max(100, int(config.session_timeout * 100)),
                "topic.metadata.refresh.interval.ms": 5000,
                "auto.offset.reset": "error",
                **({"group.instance.id": config.instance_id} if config.instance_id else {}), **(consumer_conf or {})}
        self.consumer = Consumer(kafka_consumer_conf(kafka, config.group, role, error_cb=self.errors.error_cb,
                                                     on_commit=self._on_commit))
        self.producer = Producer(producer_conf(kafka, error_cb=self.errors.error_cb))
        self.reader = SnapshotReader(replace(settings, topics=self.topics), store.prefix)
        self.view_id: str | None = None
        self._resync = False
        self._view_checked = 0.0
        self._lag_at = float("-inf")
        self._expected: Any = {}
        """What this sink last read or wrote of the view's offsets for its partitions, in the
        store's form (:data:`kvbus.sinks.view.store.Checkpoint`, made by ``store.checkpoint``)."""
        self.gate = LayoutGate(self.consumer, self.topics, lambda: self._positions)
        """Orders a holder's events across the two block layouts (:mod:`kvbus.sinks.layout_gate`)."""
        self.consumer.subscribe([self.topics.blocks_pattern()], on_assign=self._on_assign)
        self._last_expire = 0.0
        self._caught_up = False
        self._backoff = Backoff(RETRY_FIRST, RETRY_CAP)
        """Pauses after transient failures (reset by a batch handled)."""
        self.assigned = False
        """Whether the consumer group has given this sink its partitions (possibly none) yet."""
        self.lag = 0
        """Block-topic records not yet read on this sink's partitions, summed, as of the last second."""
        self.full_since: float | None = None
        """When Redis began refusing the view's writes for lack of memory (epoch s); None: it accepts them."""
        self._full_refused = 0
        self._full_logged = float("-inf")
        self._evictions = EvictionWatch(store.servers)
        self._gauges_view = store.reader()  # the view's size and stale holders, read as any reader does
        log.info("sink subscribed to %s as group %s", self.topics.blocks_pattern(), config.group)

    # -- one batch ------------------------------------------------------------

    # -- where to resume: the view's offsets ------------------------------------

    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        """Start the partitions given to this sink at the view's stored offsets (the start of the
        partition for one the view has none of), rebuilding the view first if it is gone."""
        deadline = time.monotonic() + SYNC_TIMEOUT
        backoff = Backoff(RETRY_FIRST, RETRY_CAP)
        while True:
            try:
                off = self._sync_view()
                break
            except REDIS_WAIT as e:
                if time.monotonic() > deadline:
                    raise
                pause = backoff.next()
                log.warning("Redis unavailable (%s): waiting to know where to resume (again in %.1f s)", e, pause)
                time.sleep(pause)
        self._expected = self.store.checkpoint((tp.topic, tp.partition) for tp in partitions)
        for tp in partitions:
            tp.offset = off.get((tp.topic, tp.partition), OFFSET_BEGINNING)
        consumer.assign(partitions)
        self._hold_positions(off, partitions)
        self.gate.forget()
        self.metrics.lag.clear()  # partitions given to another sink are not this sink's lag any more
        self.lag, self.assigned = 0, True
        log.info("assigned %s", ", ".join(f"{tp.topic}[{tp.partition}]@{tp.offset}" for tp in partitions),
                 extra={"partitions": [f"{tp.topic}[{tp.partition}]" for tp in partitions]})

    def _hold_positions(self, off: dict[tuple[str, int], int], partitions: list[TopicPartition]) -> None:
        """The view's offsets ``off`` become the positions to commit for ``partitions`` (the
        assignment); committed at the next chance."""
        self._positions = {(tp.topic, tp.partition): off[(tp.topic, tp.partition)]
                           for tp in partitions if (tp.topic, tp.partition) in off}
        self._uncommitted = bool(self._positions)

    def _sync_view(self) -> dict[tuple[str, int], int]:
        """Make sure there is a view (rebuild it if it is gone, or if Redis evicted keys of it since
        the last sync: a resync after a refused write can come before the periodic check sees
        them); its id and stored offsets. Evictions are counted from here on."""
        if self._evicted():  # said, counted and the view dropped: ensure_view rebuilds it
            self._resync = False
        self._evictions.reset()
        self.view_id = ensure_view(self.store, self.reader, self._end_offsets, self.metrics)
        return self.store.offsets()

    def _end_offsets(self) -> dict[tuple[str, int], int]:
        """End offset of every partition of the block topics now (what a rebuilt view must reach).
        Asked through an admin client in one ListOffsets request: the consumer's own connections
        would queue the request behind its long-polling fetches (~0.5 s per partition)."""
        admin = AdminClient(self.settings.kafka())
        rx = re.compile(self.topics.blocks_pattern())
        parts = [TopicPartition(name, p) for name, t in admin.list_topics(timeout=10).topics.items()
                 if rx.match(name) for p in t.partitions]
        if not parts:
            return {}
        futures = admin.list_offsets({tp: OffsetSpec.latest() for tp in parts}, request_timeout=10)
        return {(tp.topic, tp.partition): f.result().offset for tp, f in futures.items()}

    def _resync_now(self) -> None:
        """Seek every assigned partition to the view's stored offset (after a Redis failure, or when
        the view was rebuilt): what the view lost is read again, nothing it has is applied twice."""
        off = self._sync_view()
        self._expected = self.store.checkpoint((tp.topic, tp.partition) for tp in self.consumer.assignment())
        for tp in self.consumer.assignment():
            target = TopicPartition(tp.topic, tp.partition, off.get((tp.topic, tp.partition), OFFSET_BEGINNING))
            try:
                self.consumer.seek(target)
            except KafkaException:  # not fetching yet: (re)assigning sets the start offset
                self.consumer.assign([
                    TopicPartition(t.topic, t.partition, off.get((t.topic, t.partition), OFFSET_BEGINNING))
                    for t in self.consumer.assignment()])
                break
        self._hold_positions(off, self.consumer.assignment())
        self.gate.forget()
        self._resync = False
        self.metrics.resyncs.inc()
        log.warning("resynchronised with view %s: reading again from its stored offsets", self.view_id)

    def step(self) -> int:
        """Poll one batch, apply it, commit; returns the number of records read.

        If the registry is unavailable, the batch is rewound (read again after a pause: ``RETRY_FIRST``
        doubling up to ``RETRY_CAP`` while the failure lasts).
        After a Redis failure, or when the view was rebuilt meanwhile, every partition is read again
        from the view's stored offsets (:meth:`_resync_now`) once Redis answers.
        """
        if self._resync:
            try:
                self._resync_now()
            except REDIS_WAIT as e:
                pause = self._backoff.next()
                log.warning("Redis unavailable (%s): resync retried in %.1f s", e, pause)
                time.sleep(pause)
                return 0
        msgs = self._poll()
        self.producer.poll(0)  # the dead-letter producer's log lines and errors: queued until served
        if not msgs:
            self._commit()  # quiet: what was applied is committed now
        self._update_lag()
        try:
            n = self._handle(msgs)
        except ViewChanged as e:
            log.warning("%s", e)
            self._resync = True
            return 0
        except RedisFull as e:
            self._refused_for_memory(e)
            self._rewind(msgs)  # nothing after the refused call ran: read the batch again
            time.sleep(self._backoff.next())
            return 0
        except TransientError as e:
            pause = self._backoff.next()
            log.warning("%s: batch of %d records will be read again in %.1f s", e, len(msgs), pause)
            if isinstance(e.__cause__, redis.RedisError):
                self._resync = True  # the view may have rolled back: resume from its own offsets
            else:
                self._rewind(msgs)
            time.sleep(pause)
            return 0
        self._backoff.reset()
        return n

    def _refused_for_memory(self, e: RedisFull) -> None:
        """Redis refused a batch for lack of memory: stop applying (the batch is read again), set
        ``kvbus_sink_redis_full``, and log an ERROR at once, then once per ``FULL_LOG_EVERY`` s."""
        if self.full_since is None:
            self.full_since, self._full_refused = time.time(), 0
            self.metrics.redis_full.set(1)
        self._full_refused += 1
        self.metrics.redis_full_refusals.inc()
        now = time.monotonic()
        if now - self._full_logged >= FULL_LOG_EVERY:
            self._full_logged = now
            log.error("%s (%d batches refused in %.0f s)", e, self._full_refused, time.time() - self.full_since)

    def _writes_accepted(self) -> None:
        """Redis took a write of the view: if it was full, say so and clear ``kvbus_sink_redis_full``."""
        if self.full_since is not None:
            log.warning("Redis accepts the view's writes again after %.1f s full (%d batches refused): applying "
                        "from where the sink stopped", time.time() - self.full_since, self._full_refused)
            self.full_since = None  # the ERROR's rate limit carries over: Redis may be refusing again at once
            self.metrics.redis_full.set(0)

    def _update_lag(self) -> None:
        """``kvbus_sink_partition_lag`` of every assigned partition, at most once a second: the high
        watermark of the last fetch minus the position, both known locally (no request)."""
        now = time.monotonic()
        if now - self._lag_at < LAG_EVERY:
            return
        self._lag_at = now
        total = 0
        try:
            for tp in self.consumer.position(self.consumer.assignment()):
                _, high = self.consumer.get_watermark_offsets(tp, cached=True)
                if high >= 0 and tp.offset >= 0:
                    self.metrics.lag.labels(tp.topic, str(tp.partition)).set(max(0, high - tp.offset))
                    total += max(0, high - tp.offset)
        except KafkaException:  # assignment changing meanwhile: next second
            return
        self.lag = total

    def not_ready(self, view: ResidencyStore) -> str | None:
        """Why this sink is not ready (its ``/readyz``), None when it is: it has no partitions from
        its group yet, the view (read through ``view``, a store of the probe's own) is not ``ready``
        (missing, or rebuilding: ``P status``), or its partitions lag more than ``config.ready_lag``
        records. Called from the probe server's thread."""
        if not self.assigned:
            return f"waiting for partitions from consumer group {self.config.group}"
        full = self.full_since
        if full is not None:
            return (f"Redis is full: it refuses the view's writes (OOM at maxmemory) since {time.time() - full:.0f} s; "
                    "applying stopped until it has memory (raise maxmemory)")
        try:
            status = view.status()
        except REDIS_DOWN as e:
            return f"Redis unavailable ({e})"
        if status["state"] != READY:
            phase = f", {status['phase']}" if status.get("phase") else ""
            return f"the view is {status['state']}{phase} (P status under {view.prefix!r})"
        if self.lag > self.config.ready_lag:
            return f"{self.lag} records behind on its partitions (ready within {self.config.ready_lag})"
        return None

    def _poll(self) -> list:
        """Records ready now, up to ``batch``; waits up to ``poll_timeout`` only when none are.

        ``consume(n, timeout)`` waits until it has ``n`` records or the timeout passed, so a
        quiet stream would sit out the whole timeout before applying one record: wait for the
        first record with ``poll``, then take what librdkafka has already fetched without waiting.
        """
        first = self.consumer.poll(self.poll_timeout)
        if first is None:
            return []
        return [first, *self.consumer.consume(num_messages=self.batch - 1, timeout=0)] if self.batch > 1 else [first]

    def _rewind(self, msgs: list) -> None:
        first: dict[tuple[str, int], int] = {}
        for m in msgs:
            if m.error() is None:
                key = (m.topic(), m.partition())
                first[key] = min(first.get(key, m.offset()), m.offset())
        for (topic, partition), offset in first.items():
            self.consumer.seek(TopicPartition(topic, partition, offset))

    def _handle(self, msgs: list) -> int:
        held = self.gate.held(msgs)
        if held:  # the other block layout first: these are read again later
            waiting = [m for m in msgs if m.error() is None and (m.topic(), m.partition()) in held]
            self._rewind(waiting)
            msgs = [m for m in msgs if m.error() is not None or (m.topic(), m.partition()) not in held]
        records: list[tuple[str, BlockEvent]] = []
        """(track, event): the events to apply, each under its track's name (:meth:`Topics.track`)."""
        sources: list[tuple[Any, str]] = []
        dead = 0
        topics = self.topics
        for msg in msgs:
            err = msg.error()
            if err is not None:
                if err.fatal():
                    raise KafkaException(err)
                if err.code() == KafkaError._AUTO_OFFSET_RESET:
                    self._out_of_range(msg.topic(), msg.partition(), err)
                elif err.code() != KafkaError._PARTITION_EOF:
                    log.warning("consumer error: %s", describe_kafka_error(err, self.settings.security.kafka))
                continue
            topic = msg.topic()
            source = f"{topic}[{msg.partition()}]@{msg.offset()}"
            packed = topics.is_packed(topic)
            try:
                value = (self.packed_serde if packed else self.serde).loads(msg.value(), topic)
            except Exception as e:  # undecodable: anything the deserializer raises
                if is_transient(e):
                    raise TransientError(f"schema registry unavailable ({type(e).__name__}: {e})") from e
                self._dead(msg, source, f"decode: {type(e).__name__}: {e}", "decode")
                dead += 1
                continue
            if packed:
                why = packed_problem(msg.key(), value)
                if why is not None:
                    self._dead(msg, source, why, "invalid")
                    dead += 1
                    continue
                events = value.unpacked()
            else:
                events = [value]
            track = self.gate.track_of(topic)
            arrival = arrival_time(msg)  # the view's clock (staleness); Kafka keeps the engine's ts
            for ev in events:  # a packed record's holder is checked above, once
                why = event_problem(topic, ev, topics) if packed else problem(topic, msg.key(), ev, topics)
                if why is not None:
                    self._dead(msg, f"{source}#{ev.index}" if packed else source, why, "invalid")
                    dead += 1
                    continue
                ev.ts = arrival
                records.append((track, ev))
                sources.append((msg, source))
        self.metrics.records.inc(len(msgs))
        offsets = {}
        for msg in msgs:
            if msg.error() is None:
                offsets[(msg.topic(), msg.partition())] = msg.offset() + 1
        if records and self.gate.switching and self.gate.both_layouts(msgs):
            records, sources = in_position_order(records, sources)
        if records:
            t0 = time.perf_counter()
            try:
                res = self.store.apply(records, view_id=self.view_id, offsets=offsets, expected=self._expected)
            except REDIS_DOWN as e:
                raise TransientError(f"Redis unavailable ({e})") from e
            self._writes_accepted()
            self._expected = self.store.advance(self._expected, offsets)
            self.metrics.apply_seconds.observe(time.perf_counter() - t0)
            self.metrics.observe(res)
            for topic, ev, reason in res.failed:
                msg, source = next((m, s) for (m, s), (t, e) in zip(sources, records) if e is ev)
                self._dead(msg, source, f"store: {reason}", "store")
                dead += 1
        if dead:
            self._flush_dead()
        if offsets and not records:  # only dead letters: the view's offsets move on all the same
            try:
                self.store.set_offsets(offsets, self.view_id, self._expected)
            except REDIS_DOWN as e:
                raise TransientError(f"Redis unavailable ({e})") from e
            self._writes_accepted()
            self._expected = self.store.advance(self._expected, offsets)
        if msgs:
            self._positions.update(offsets)
            self._uncommitted = True
            if time.monotonic() - self._last_commit >= self.commit_every:
                self._commit()
        self._caught_up = len(msgs) < self.batch
        self._maybe_expire()
        self._check_view()
        return len(msgs)

    def _check_view(self) -> None:
        """Every ``VIEW_CHECK_EVERY`` s, also while no records come: resync if the view is not where
        this sink left it (lost, rebuilt, rolled back by a Redis restart), and mark a rebuilt view
        ready once it caught up."""
        now = time.monotonic()
        if now - self._view_checked < VIEW_CHECK_EVERY:
            return
        self._view_checked = now
        try:
            # evictions first: an evicted key may be the view's id or offsets, which would otherwise
            # look like a view lost or rolled back, and the eviction would go unsaid and uncounted
            if self._evicted():
                return
            if self.store.view_id() != self.view_id or not self.store.holds(self._expected):
                log.warning("the view is not where this sink left it (lost, rebuilt or rolled back): resync")
                self._resync = True
                return
            ready = mark_ready_if_caught_up(self.store, self.metrics)
        except REDIS_DOWN:
            self._resync = True
            return
        except (RedisFull, redis.exceptions.OutOfMemoryError):
            return  # marking the view ready is a write: once Redis has memory again
        self.metrics.rebuilding.set(0 if ready else 1)

    def _evicted(self) -> bool:
        """Whether Redis evicted keys since the view was (re)built (``INFO stats`` ``evicted_keys``,
        :class:`kvbus.sinks.view.redis_memory.EvictionWatch`): then some of the view is gone, silently, so
        the view is dropped (not ready) and rebuilt like a lost one, and the sink resyncs."""
        evicted = self._evictions.evicted()
        if not evicted:
            return False
        self.metrics.evicted_keys.inc(sum(evicted.values()))
        policies = {name: memory_policy(r)[0] for name, r in self.store.servers() if name in evicted}
        log.error("Redis evicted keys (%s): the view misses what they held and is rebuilt from the latest snapshot. "
                  "Set %s %s (now %s), and give Redis memory enough for the view",
                  ", ".join(f"{n} at {name}" for name, n in evicted.items()), POLICY_SETTING, NO_EVICTION,
                  ", ".join(f"{p or 'unreadable'} at {name}" for name, p in policies.items()))
        self._drop_view("keys evicted")
        return True

    def _drop_view(self, why: str) -> None:
        """Drop the view's id (it is ``rebuilding`` for routers at once, phase ``why``) and resync:
        the resync finds no view and rebuilds it (sinks/rebuild.py), or waits for the sink that does."""
        if self.view_id is not None:
            self.store.drop_view_id(self.view_id, why)
        self._resync = True

    def _out_of_range(self, topic: str, partition: int, err: KafkaError) -> None:
        """librdkafka found this partition's position outside its log (``auto.offset.reset`` is
        ``error``). If the view's stored offset lies past the log's end, the log is not the one the
        view was built from (the topic was deleted and recreated, or an unclean leader election
        truncated it): the view is dropped and rebuilt from the latest snapshot, partitions whose
        snapshot offset also lies past their end from their start (sinks/rebuild.py). If it lies
        before the log's start, retention deleted records the view never applied: said loudly, and
        the partition is read on from its start. Otherwise the sink resyncs to the stored offset."""
        tp = TopicPartition(topic, partition)
        try:
            low, high = self.consumer.get_watermark_offsets(tp, timeout=10, cached=False)
            stored = self.store.offsets().get((topic, partition))
        except (KafkaException, *REDIS_DOWN) as e:
            log.warning("%s[%d] is out of range (%s) and its log's bounds are unknown now (%s): resync", topic,
                        partition, err.str(), e)
            self._resync = True
            return
        if stored is not None and stored > high:
            log.error("%s[%d]: the view stores offset %d but the partition's log ends at %d (the topic was deleted "
                      "and recreated, or its log truncated): rebuilding the view from the latest snapshot", topic,
                      partition, stored, high)
            self._drop_view(f"{topic}[{partition}] log replaced")
            self.metrics.log_replaced.inc()
        elif stored is not None and stored < low:
            log.error("%s[%d]: records %d to %d were deleted (retention) before the view applied them: the view "
                      "misses them; reading on from %d. The block topics must retain records longer than a sink may "
                      "be stopped", topic, partition, stored, low - 1, low)
            self.consumer.seek(TopicPartition(topic, partition, low))
        else:
            self._resync = True

    def _on_commit(self, err: Any, partitions: list) -> None:
        """librdkafka's answer to an asynchronous commit (called from ``poll``, this thread): a commit
        refused (e.g. while the group still rebalances after a join) is sent again at the next chance,
        so a quiet sink does not keep reporting a lag it does not have."""
        failed = err is not None or any(p.error is not None for p in partitions or ())
        if failed:
            log.debug("offset commit refused (%s): committed again at the next batch or idle poll", err)
            self._uncommitted = True

    def _commit(self) -> None:
        """Commit the positions after the records handled so far (asynchronously), if any are new."""
        if self._uncommitted and self._positions:
            self.consumer.commit(offsets=self._commit_offsets(), asynchronous=True)
            self._last_commit = time.monotonic()
        self._uncommitted = False

    def _commit_offsets(self) -> list[TopicPartition]:
        return [TopicPartition(topic, partition, offset) for (topic, partition), offset in self._positions.items()]

    def _dead(self, msg: Any, source: str, reason: str, kind: str) -> None:
        log.warning("dead letter %s: %s", source, reason,
                    extra={"topic": msg.topic(), "partition": msg.partition(), "offset": msg.offset()})
        # the payload is cut (dead_letter): a record near the topic's size limit made a DeadLetter
        # the producer refused, which stopped the sink on that record at every restart
        letter = dead_letter(STAGE, source, reason, [msg.value() or b""], time.time())
        self.producer.produce(self.topics.dlq, key=source.encode(), value=self.dlq_serde.dumps(letter, self.topics.dlq),
                              on_delivery=self.errors.on_delivery)
        self.metrics.dead_letters.labels(kind).inc()

    def _flush_dead(self) -> None:
        """Dead letters must be durable before the offsets of their records are committed."""
        self.errors.raise_if_undelivered("dead letters", self.producer.flush(30))

    def _maybe_expire(self) -> None:
        now = time.time()
        if now - self._last_expire < self.expire_every or not self._caught_up:
            return
        self._last_expire = now
        try:
            if self.stale_after > 0:
                expired = self.store.expire_stale(self.stale_after, now)
                if expired:
                    log.info("expired %d stale holders: %s", len(expired), ", ".join(expired[:10]))
                    self.metrics.expired.inc(len(expired))
            # not exact: a sharded view's exact block count reads every block table (O(view))
            self.metrics.set_view(self._gauges_view.size(exact=False), len(self._gauges_view.stale()))
        except REDIS_DOWN as e:
            log.warning("staleness check skipped: Redis unavailable (%s)", e)
        except (RedisFull, redis.exceptions.OutOfMemoryError):
            pass  # expiring writes too: once Redis has memory again (the apply path says it is full)

    # -- loop -----------------------------------------------------------------

    def run(self, stop: threading.Event | None = None) -> None:
        """Run until ``stop`` is set; then commit and close."""
        stop = stop or threading.Event()
        try:
            while not stop.is_set():
                self.step()
        finally:
            self.close()

    def close(self) -> None:
        """Commit what was applied and leave the group."""
        try:
            self.producer.flush(10)
            if self._positions:
                self.consumer.commit(offsets=self._commit_offsets(), asynchronous=False)
        except KafkaException as e:  # explicit offsets: never "nothing to commit"
            log.warning("final commit failed: %s", e)
        finally:
            self.consumer.close()
            log.info("sink stopped")
