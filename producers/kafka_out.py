"""Kafka side of the bridge: an idempotent confluent-kafka producer, a bounded backlog,
and the dead-letter topic.

Delivery contract: every record handed to :meth:`KafkaSink.produce_batch` is kept
until Kafka acknowledges it (``message.timeout.ms=0``: librdkafka never expires it)
or the bridge exits. Memory is bounded twice:

1. librdkafka's own queue (``queue.buffering.max.messages`` / ``.kbytes``);
2. when that is full (Kafka down or slow), an explicit FIFO backlog in the bridge,
   bounded by ``max_backlog`` records / ``max_backlog_bytes``.

When the backlog reaches its bound, :meth:`KafkaSink.accepting` turns False and the
bridge stops accepting *live* batches (it keeps draining ZMQ so the engine is never
slowed, but drops what it reads, counting ``shed_batches``); it resumes once the
backlog is down to half. Dropped live batches are not lost silently: the next
accepted batch shows a sequence gap, which the bridge fills from the engine's
replay buffer, or announces with a ``Reset(gap-unrecoverable)`` marker.

A batch whose value exceeds ``max_record_bytes`` is produced as several records (parts, in
order, consecutive ``first_index``); an event too large for any record is dead-lettered
(:mod:`producers.split`).
"""
from __future__ import annotations

import functools
import logging
import time
from collections import deque
from typing import Any, Callable

import msgspec
from confluent_kafka import KafkaError, KafkaException, Producer

from producers.metrics import BridgeMetrics
from producers.split import DEFAULT_MAX_RECORD_BYTES, BatchRef, Splitter, record_limit
from schemas.events import DeadLetter, EventBatch, holder_key
from schemas.fast_encode import event as encode_event

log = logging.getLogger("kvbus.producers.kafka")

DEFAULT_PRODUCER_CONF: dict[str, Any] = {
    "enable.idempotence": True,
    "acks": "all",
    # a record waits at most this long for others to share its request: the view's freshness
    # budget is tens of ms end to end; under load librdkafka batches while requests are in flight
    "linger.ms": 5,
    "compression.type": "lz4",
    "batch.size": 1_000_000,
    "batch.num.messages": 10_000,
    # same key -> partition mapping as the Java client and aiokafka (murmur2)
    "partitioner": "murmur2_random",
    "queue.buffering.max.messages": 100_000,
    "queue.buffering.max.kbytes": 131_072,
    # never expire a queued record: while Kafka is down we hold it (bounded queue)
    "message.timeout.ms": 0,
    "log.connection.close": False,
}
"""Producer settings of the bridge and the publisher; override per key."""

DEFAULT_MAX_BACKLOG = 100_000
"""Records the bridge holds beyond librdkafka's queue."""
DEFAULT_MAX_BACKLOG_BYTES = 256 * 1024 * 1024
"""Bytes the bridge holds beyond librdkafka's queue."""


def producer_conf(bootstrap: str, overrides: dict[str, Any] | None = None, **callbacks: Any) -> dict[str, Any]:
    """The bridge's producer configuration for ``bootstrap``."""
    conf = dict(DEFAULT_PRODUCER_CONF)
    conf["bootstrap.servers"] = bootstrap
    conf.update(overrides or {})
    conf.update(callbacks)
    return conf


class _RateLimitedLog:
    """Log a recurring condition at most once per ``every`` seconds, with a count."""

    def __init__(self, every: float = 5.0) -> None:
        self.every = every
        self._last = 0.0
        self._suppressed = 0

    def __call__(self, level: int, msg: str, *args: Any) -> None:
        now = time.monotonic()
        if now - self._last >= self.every:
            suffix = f" (+{self._suppressed} similar)" if self._suppressed else ""
            log.log(level, msg + suffix, *args)
            self._last = now
            self._suppressed = 0
        else:
            self._suppressed += 1


class KafkaSink:
    """Produces EventBatch records to the raw topic and DeadLetters to the DLQ topic.

    ``serialize_batch(batch) -> bytes`` and ``serialize_dead_letter(dl) -> bytes``
    give the Confluent-wire-format values (built once by the caller from the registry).
    Call :meth:`service` on every loop pass (delivery callbacks, backlog drain).
    ``max_record_bytes``: largest value produced as one record; larger batches are split.
    """

    def __init__(
        self,
        producer: Producer,
        raw_topic: str,
        dlq_topic: str,
        serialize_batch: Callable[[EventBatch], bytes],
        serialize_dead_letter: Callable[[DeadLetter], bytes],
        metrics: BridgeMetrics,
        *,
        max_backlog: int = DEFAULT_MAX_BACKLOG,
        max_backlog_bytes: int = DEFAULT_MAX_BACKLOG_BYTES,
        max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
    ) -> None:
        self.producer = producer
        self.raw_topic = raw_topic
        self.dlq_topic = dlq_topic
        self._ser = serialize_batch
        self._ser_dl = serialize_dead_letter
        self.metrics = metrics
        self.max_backlog = max_backlog
        self.max_backlog_bytes = max_backlog_bytes
        self._backlog: deque[tuple[str, bytes, bytes, int]] = deque()
        self._backlog_bytes = 0
        self._shedding = False
        self.delivery_failures = 0
        """Records Kafka refused for good (delivery callback error)."""
        self._err_log = _RateLimitedLog()
        self._ack_cb = {}  # events-in-record -> bound delivery callback (few distinct sizes)
        self.splitter = Splitter(max_record_bytes, metrics, "bridge")

    @classmethod
    def build(
        cls,
        bootstrap: str,
        raw_topic: str,
        dlq_topic: str,
        serialize_batch: Callable[[EventBatch], bytes],
        serialize_dead_letter: Callable[[DeadLetter], bytes],
        metrics: BridgeMetrics,
        conf_overrides: dict[str, Any] | None = None,
        *,
        max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
        **kw: Any,
    ) -> "KafkaSink":
        """A sink with its own producer configured by :func:`producer_conf`; ``max_record_bytes``
        is lowered to what the producer's ``message.max.bytes`` takes (:func:`record_limit`)."""
        err_log = _RateLimitedLog()

        def on_error(err: KafkaError) -> None:
            err_log(logging.WARNING, "kafka: %s", err)

        conf = producer_conf(bootstrap, conf_overrides, error_cb=on_error)
        limit = record_limit(max_record_bytes, conf)
        return cls(Producer(conf), raw_topic, dlq_topic, serialize_batch, serialize_dead_letter, metrics,
                   max_record_bytes=limit, **kw)

    # -- produce --------------------------------------------------------------
    def produce_batch(self, batch: EventBatch) -> None:
        """Queue one EventBatch, keyed ``<replica>#<dp_rank>``: as one record, or as several
        (in order) when its value exceeds the record limit (:mod:`producers.split`)."""
        value = self._ser(batch)
        key = holder_key(batch.replica, batch.dp_rank).encode()
        if self.splitter.fits(len(value)):
            self._send(self.raw_topic, key, value, len(batch.events))
        else:
            self._produce_split(batch, key, len(value))

    def _produce_split(self, batch: EventBatch, key: bytes, value_size: int) -> None:
        """Queue ``batch`` as parts under the record limit, each written by the batch serializer;
        events that fit no record are dead-lettered."""

        def produce_part(start: int, end: int) -> None:
            part = msgspec.structs.replace(batch, events=batch.events[start:end],
                                           first_index=batch.first_index + start)
            self._send(self.raw_topic, key, self._ser(part), end - start)

        ref = BatchRef(batch.replica, batch.dp_rank, batch.worker_rank, batch.epoch, batch.seq)
        fixed = len(self._ser(msgspec.structs.replace(batch, events=[])))
        self.splitter.split(ref, value_size, [encode_event(e) for e in batch.events], fixed, produce_part,
                            self.produce_dead_letter, batch.first_index)

    def produce_dead_letter(self, dl: DeadLetter) -> None:
        """Queue one DeadLetter, keyed by its source."""
        self._send(self.dlq_topic, dl.source.encode(), self._ser_dl(dl), -1)

    def _callback(self, events: int) -> Callable[[KafkaError | None, Any], None]:
        cb = self._ack_cb.get(events)
        if cb is None:
            cb = functools.partial(self._delivered, events)
            if len(self._ack_cb) < 4096:
                self._ack_cb[events] = cb
        return cb

    def _send(self, topic: str, key: bytes, value: bytes, events: int) -> None:
        if events >= 0:
            self.metrics.batches_out.inc()
            self.metrics.events_out.inc(events)
        if self._backlog:
            self._hold(topic, key, value, events)
            return
        try:
            self.producer.produce(topic, value, key, on_delivery=self._callback(events))
        except BufferError:
            self._hold(topic, key, value, events)
        except KafkaException as exc:  # e.g. record larger than message.max.bytes
            self._refused(exc.args[0] if exc.args else exc, topic)

    def _hold(self, topic: str, key: bytes, value: bytes, events: int) -> None:
        self._backlog.append((topic, key, value, events))
        self._backlog_bytes += len(value) + len(key)
        if not self._shedding and (len(self._backlog) >= self.max_backlog or self._backlog_bytes >= self.max_backlog_bytes):
            self._shedding = True
            log.warning("backlog full (%d records, %d bytes): shedding live batches until Kafka catches up",
                        len(self._backlog), self._backlog_bytes)

    def _refused(self, err: Any, topic: str) -> None:
        self.delivery_failures += 1
        self.metrics.delivery_errors.inc()
        self._err_log(logging.ERROR, "record to %s refused: %s", topic, err)

    def _delivered(self, events: int, err: KafkaError | None, msg: Any) -> None:
        if err is not None:
            self._refused(err, msg.topic() if msg is not None else "?")
            return
        if events >= 0:
            self.metrics.batches_acked.inc()
            self.metrics.events_acked.inc(events)
        lat = msg.latency()
        if lat is not None:
            self.metrics.delivery_latency.observe(lat)

    # -- loop ---------------------------------------------------------------------
    def service(self) -> None:
        """Serve delivery callbacks and move backlog records into librdkafka's queue."""
        self.producer.poll(0)
        backlog = self._backlog
        while backlog:
            topic, key, value, events = backlog[0]
            try:
                self.producer.produce(topic, value, key, on_delivery=self._callback(events))
            except BufferError:
                break
            except KafkaException as exc:
                self._refused(exc.args[0] if exc.args else exc, topic)
            backlog.popleft()
            self._backlog_bytes -= len(value) + len(key)
        if self._shedding and len(backlog) <= self.max_backlog // 2 and self._backlog_bytes <= self.max_backlog_bytes // 2:
            self._shedding = False
            log.warning("backlog down to %d records: accepting live batches again", len(backlog))

    def accepting(self) -> bool:
        """False while the backlog is full: the bridge sheds live batches."""
        return not self._shedding

    def update_gauges(self) -> None:
        """Refresh queue/backlog gauges."""
        self.metrics.queue_depth.set(len(self.producer))
        self.metrics.backlog.set(len(self._backlog))
        self.metrics.backlog_bytes.set(self._backlog_bytes)

    @property
    def backlog(self) -> int:
        """Records held beyond librdkafka's queue."""
        return len(self._backlog)

    @property
    def in_flight(self) -> int:
        """Records not yet acknowledged (librdkafka queue + backlog)."""
        return len(self.producer) + len(self._backlog)

    def close(self, timeout: float = 30.0) -> int:
        """Deliver what is queued within ``timeout`` seconds; returns records left undelivered."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.in_flight:
            self.service()
            self.producer.flush(min(0.5, max(0.0, deadline - time.monotonic())))
        left = self.in_flight
        if left:
            log.error("exiting with %d records not acknowledged by Kafka (lost unless the engine replays them)", left)
        self.update_gauges()
        return left
