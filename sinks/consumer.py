"""The sink: consume consolidated BlockEvents from Kafka and apply them to the residency view.

Loop (``SinkConsumer.step``): poll a batch from every block topic (regex subscription, so new tier
topics ``kvbus.blocks.<ownership>`` are picked up), decode and check each record (failures go to
the dead-letter topic), apply the batch to the store (one FCALL per holder, pipelined; positions are
stored with the change, so redelivery is harmless), flush dead letters, then commit the offsets
(every ``commit_every`` seconds while records keep coming, at once when the stream goes quiet).
Offsets are only a resume hint: a sink killed anywhere re-reads at most about ``commit_every``
seconds of records, which the stored positions turn into duplicates. Every ``expire_every``
seconds, when caught up, holders silent for ``stale_after`` seconds are expired; "silent" is
measured by the records' arrival (their Kafka timestamps, :func:`arrival_time`), not by the
engines' clocks.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any

import redis
from confluent_kafka import TIMESTAMP_NOT_AVAILABLE, Consumer, KafkaError, KafkaException, Producer, TopicPartition
from confluent_kafka.schema_registry.error import SchemaRegistryError

from schemas.events import BlockEvent, DeadLetter
from schemas.fast_codec import FastSerde
from schemas.serde import registry_client
from schemas.settings import Settings
from schemas.topics import Topics

from sinks.metrics import SinkMetrics
from sinks.store import ResidencyStore
from sinks.validate import problem

log = logging.getLogger("kvbus.sinks")

STAGE = "sink"
RETRY_PAUSE = 1.0
"""Seconds to wait before re-reading a batch after a transient failure (registry or Redis down)."""


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
    if isinstance(e, (redis.ConnectionError, redis.TimeoutError, ConnectionError, TimeoutError)):
        return True
    return any(c.__name__ in ("TransportError", "TimeoutException") for c in type(e).__mro__)


class SinkConsumer:
    """Kafka -> residency view.

    ``settings``: where Kafka and the registry are; ``store``: the view; ``topics``: topic names
    (default ``settings.topics``); ``group``: consumer group; ``stale_after``: seconds without events
    or heartbeat after which a holder is expired (0 = never); ``batch``: records per poll;
    ``commit_every``: seconds between offset commits while records keep coming (they are committed
    at once when the stream goes quiet). Offsets are only a resume hint, so committing after every
    small batch would buy nothing but an OffsetCommit request per batch (a write to Kafka's
    ``__consumer_offsets``): a sink restarted after a crash re-reads at most about this long.
    """

    def __init__(
        self,
        settings: Settings,
        store: ResidencyStore,
        *,
        topics: Topics | None = None,
        group: str = "kvbus-sink",
        stale_after: float = 300.0,
        expire_every: float = 5.0,
        batch: int = 2000,
        poll_timeout: float = 0.5,
        commit_every: float = 0.5,
        metrics: SinkMetrics | None = None,
        consumer_conf: dict[str, Any] | None = None,
    ):
        self.settings = settings
        self.store = store
        self.topics = topics or settings.topics
        self.stale_after = stale_after
        self.expire_every = expire_every
        self.batch = batch
        self.poll_timeout = poll_timeout
        self.commit_every = commit_every
        self._last_commit = 0.0
        self._uncommitted = False
        self.metrics = metrics or SinkMetrics()
        registry = registry_client(settings.registry_url)
        # hand-written Avro decoding for records of the current schema (~4-12 µs instead of ~60);
        # other schema versions decode through RecordSerde
        self.serde = FastSerde(registry, "BlockEvent", auto_register=False)
        self.dlq_serde = FastSerde(registry, "DeadLetter")
        conf = {
            "bootstrap.servers": settings.bootstrap,
            "group.id": group,
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
            "topic.metadata.refresh.interval.ms": 5000,
            "enable.partition.eof": False,
        }
        conf.update(consumer_conf or {})
        self.consumer = Consumer(conf)
        self.producer = Producer({"bootstrap.servers": settings.bootstrap, "enable.idempotence": True,
                                  "acks": "all", "linger.ms": 5})
        self.consumer.subscribe([self.topics.blocks_pattern()])
        self._last_expire = 0.0
        self._caught_up = False
        self._dlq_errors: list[str] = []
        log.info("sink subscribed to %s as group %s", self.topics.blocks_pattern(), group)

    # -- one batch ------------------------------------------------------------

    def step(self) -> int:
        """Poll one batch, apply it, commit; returns the number of records read.

        If the registry or Redis is unavailable, the batch is rewound (read again after
        ``RETRY_PAUSE``); what was applied of it is skipped then by the stored positions.
        """
        msgs = self._poll()
        if not msgs:
            self._commit()  # quiet: what was applied is committed now
        try:
            return self._handle(msgs)
        except TransientError as e:
            log.warning("%s: batch of %d records will be read again", e, len(msgs))
            self._rewind(msgs)
            time.sleep(RETRY_PAUSE)
            return 0

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
        records: list[tuple[str, BlockEvent]] = []
        sources: list[tuple[Any, str]] = []
        dead = 0
        for msg in msgs:
            err = msg.error()
            if err is not None:
                if err.fatal():
                    raise KafkaException(err)
                if err.code() != KafkaError._PARTITION_EOF:
                    log.warning("consumer error: %s", err)
                continue
            source = f"{msg.topic()}[{msg.partition()}]@{msg.offset()}"
            try:
                ev = self.serde.loads(msg.value(), msg.topic())
            except Exception as e:  # undecodable: anything the deserializer raises
                if is_transient(e):
                    raise TransientError(f"schema registry unavailable ({type(e).__name__}: {e})") from e
                self._dead(msg, source, f"decode: {type(e).__name__}: {e}", "decode")
                dead += 1
                continue
            why = problem(msg.topic(), msg.key(), ev, self.topics)
            if why is not None:
                self._dead(msg, source, why, "invalid")
                dead += 1
                continue
            ev.ts = arrival_time(msg)  # the view's clock (staleness); Kafka keeps the engine's ts
            records.append((msg.topic(), ev))
            sources.append((msg, source))
        self.metrics.records.inc(len(msgs))
        if records:
            t0 = time.perf_counter()
            try:
                res = self.store.apply(records)
            except (redis.ConnectionError, redis.TimeoutError) as e:
                raise TransientError(f"Redis unavailable ({e})") from e
            self.metrics.apply_seconds.observe(time.perf_counter() - t0)
            self.metrics.observe(res)
            for topic, ev, reason in res.failed:
                msg, source = next((m, s) for (m, s), (t, e) in zip(sources, records) if e is ev)
                self._dead(msg, source, f"store: {reason}", "store")
                dead += 1
        if dead:
            self._flush_dead()
        if msgs:
            self._uncommitted = True
            if time.monotonic() - self._last_commit >= self.commit_every:
                self._commit()
        self._caught_up = len(msgs) < self.batch
        self._maybe_expire()
        return len(msgs)

    def _commit(self) -> None:
        """Commit the positions after the records handled so far (asynchronously), if any are new."""
        if self._uncommitted:
            self.consumer.commit(asynchronous=True)
            self._uncommitted = False
            self._last_commit = time.monotonic()

    def _dead(self, msg: Any, source: str, reason: str, kind: str) -> None:
        log.warning("dead letter %s: %s", source, reason)
        letter = DeadLetter(stage=STAGE, source=source, reason=reason, payload=[msg.value() or b""], ts=time.time())
        self.producer.produce(self.topics.dlq, key=source.encode(), value=self.dlq_serde.dumps(letter, self.topics.dlq),
                              on_delivery=self._on_dlq_delivery)
        self.metrics.dead_letters.labels(kind).inc()

    def _on_dlq_delivery(self, err: Any, msg: Any) -> None:
        if err is not None:
            self._dlq_errors.append(str(err))

    def _flush_dead(self) -> None:
        """Dead letters must be durable before the offsets of their records are committed."""
        remaining = self.producer.flush(30)
        if remaining or self._dlq_errors:
            errors, self._dlq_errors = self._dlq_errors, []
            raise RuntimeError(f"dead-letter topic unavailable ({remaining} undelivered, errors: {errors[:3]})")

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
            self.metrics.set_view(self.store.size(), len(self.store.stale()))
        except (redis.ConnectionError, redis.TimeoutError) as e:
            log.warning("staleness check skipped: Redis unavailable (%s)", e)

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
            self.consumer.commit(asynchronous=False)
        except KafkaException as e:
            if e.args[0].code() != KafkaError._NO_OFFSET:
                log.warning("final commit failed: %s", e)
        finally:
            self.consumer.close()
            log.info("sink stopped")
