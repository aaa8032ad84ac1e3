"""The one Kafka record producer of kvbus: used by the bridge (:class:`~kvbus.producers.raw_producer.RawProducer`)
and the in-process publisher (:class:`~kvbus.producers.publisher.KafkaEventPublisher`).

It owns everything the two paths share: the idempotent confluent-kafka producer and its
configuration, a bounded backlog in front of librdkafka's queue, delivery reports, the
rate-limited error log, splitting of batches too large for one record (:mod:`kvbus.producers.split`),
the dead-letter topic and the :class:`~kvbus.producers.metrics.BridgeMetrics`. What differs is only
how a batch's value is encoded: each path hands over the encoded value (and, for a split, a
callback encoding one part).

Delivery contract: every record handed to :meth:`RecordProducer.produce` is kept until Kafka
acknowledges it (``message.timeout.ms=0``: librdkafka never expires it) or the process exits.
Memory is bounded twice:

1. librdkafka's own queue (``queue.buffering.max.messages`` / ``.kbytes``);
2. when that is full (Kafka down or slow), a FIFO backlog, bounded by ``max_backlog`` records /
   ``max_backlog_bytes``.

When the backlog reaches a bound, :meth:`RecordProducer.accepting` turns False; it turns True
again once the backlog is down to half of both bounds. What a caller does meanwhile is its own
policy: the bridge sheds live batches (recovered by replay), the publisher drops batches and
announces them with a ``Reset(gap-unrecoverable)`` marker. Records produced while not accepting
(markers, replays, dead letters) are still held, in order.

Not thread-safe: a caller with several threads (the publisher's poll thread) serializes its
calls, except :meth:`poll`, which only serves delivery callbacks.
"""
from __future__ import annotations

import functools
import logging
import time
from collections import deque
from typing import Any, Callable, Mapping, Sequence

from confluent_kafka import KafkaError, KafkaException, Producer

from kvbus.producers.metrics import BridgeMetrics
from kvbus.producers.split import BatchRef, Splitter, record_limit
from kvbus.runtime.kafka_clients import PRODUCER_CONF, DeliveryErrors, producer_conf as kafka_producer_conf
from kvbus.schemas.events import DeadLetter

log = logging.getLogger("kvbus.producers.kafka")

BRIDGE_PRODUCER_CONF: dict[str, Any] = {
    "batch.size": 1_000_000,
    "batch.num.messages": 10_000,
    "queue.buffering.max.messages": 100_000,
    "queue.buffering.max.kbytes": 131_072,
    # never expire a queued record: while Kafka is down we hold it (bounded queue)
    "message.timeout.ms": 0,
    # a lone record goes out at once: under load the bridge's loop batches (bridge_group.Batching pauses
    # while busy), and librdkafka batches while requests are in flight; 5 ms here cost every record at
    # low load ~4 ms of freshness for no fewer requests (each was alone in its partition's batch)
    "linger.ms": 1,
}
"""The bridge's and the publisher's producer properties over every producer's
(:data:`kvbus.runtime.kafka_clients.PRODUCER_CONF`); override per key."""
DEFAULT_PRODUCER_CONF: dict[str, Any] = {**PRODUCER_CONF, **BRIDGE_PRODUCER_CONF}
"""Producer settings of the bridge and the publisher."""

DEFAULT_MAX_BACKLOG = 100_000
"""Records held beyond librdkafka's queue before :meth:`RecordProducer.accepting` turns False."""
DEFAULT_MAX_BACKLOG_BYTES = 256 * 1024 * 1024
"""Bytes (keys and values) held beyond librdkafka's queue before accepting turns False."""

STALL_SECONDS = 10.0
"""Seconds records may wait with no acknowledgement from Kafka before :meth:`RecordProducer.failure`
calls the producer failing (a healthy one is acknowledged within milliseconds)."""

_MAX_CALLBACKS = 4096
"""Distinct events-per-record counts whose bound delivery callback is cached."""


def producer_conf(kafka: str | Mapping[str, Any], overrides: dict[str, Any] | None = None,
                  **callbacks: Any) -> dict[str, Any]:
    """librdkafka configuration for ``kafka`` (a bootstrap string or ``Settings.kafka()``: servers and
    security): :data:`BRIDGE_PRODUCER_CONF` over every producer's
    (:func:`kvbus.runtime.kafka_clients.producer_conf`), then ``overrides``, then ``callbacks`` (``error_cb``)."""
    return kafka_producer_conf(kafka, BRIDGE_PRODUCER_CONF, overrides, **callbacks)


class RecordProducer:
    """Produces records to ``raw_topic`` (event batches) and ``dlq_topic`` (dead letters).

    ``producer``: a confluent-kafka ``Producer`` (or a stand-in with ``produce``, ``poll``,
    ``flush`` and ``len``); None builds one from ``conf`` (:func:`producer_conf`), whose
    librdkafka errors go to the rate-limited log. ``serialize_dead_letter(dl) -> bytes``: the
    Confluent-wire-format value of a DeadLetter (it may raise, e.g. registry unreachable: the
    letter is then logged and not written). ``max_record_bytes``: largest value produced as one
    record (with ``conf``, lowered to what its ``message.max.bytes`` takes:
    :func:`~kvbus.producers.split.record_limit`).
    ``stage``: the DeadLetter stage of split batches' oversized events ("bridge", "publisher").
    ``label``: prefix of this producer's log messages (e.g. ``"kvbus publisher pod-a: "``).
    """

    def __init__(
        self,
        raw_topic: str,
        dlq_topic: str,
        serialize_dead_letter: Callable[[DeadLetter], bytes],
        metrics: BridgeMetrics,
        *,
        stage: str,
        producer: Any = None,
        conf: dict[str, Any] | None = None,
        max_record_bytes: int,
        max_backlog: int = DEFAULT_MAX_BACKLOG,
        max_backlog_bytes: int = DEFAULT_MAX_BACKLOG_BYTES,
        label: str = "",
    ) -> None:
        self.raw_topic = raw_topic
        self.dlq_topic = dlq_topic
        self._ser_dl = serialize_dead_letter
        self.metrics = metrics
        self.label = label
        self.max_backlog = max_backlog
        self.max_backlog_bytes = max_backlog_bytes
        self.errors = DeliveryErrors(conf or {}, log, label)
        """What Kafka refused (the configuration's security properties name the principal in messages)."""
        if producer is None:
            producer = Producer({**(conf or {}), "error_cb": self._on_kafka_error})
        self.producer = producer
        limit = max_record_bytes if conf is None else record_limit(max_record_bytes, conf)
        self.splitter = Splitter(limit, metrics, stage)
        self._backlog: deque[tuple[str, bytes, bytes, int]] = deque()
        """(topic, key, value, events) waiting for room in librdkafka's queue, in order."""
        self._backlog_bytes = 0
        self._shedding = False
        self._ack_cb: dict[int, Callable[[KafkaError | None, Any], None]] = {}
        self.acked = 0
        """Records Kafka acknowledged (batches and dead letters)."""
        self._stall: tuple[int | None, float] = (None, 0.0)
        """(records acknowledged, since when) as :meth:`failure` last saw them with records waiting."""

    # -- produce ----------------------------------------------------------------------------
    def fits(self, value_size: int) -> bool:
        """Whether a batch value of ``value_size`` bytes is produced as one record."""
        return self.splitter.fits(value_size)

    def produce_split(
        self,
        key: bytes,
        value_size: int,
        ref: BatchRef,
        encoded: Sequence[bytes],
        fixed: int,
        part_value: Callable[[int, int], bytes],
        first_index: int = 0,
    ) -> None:
        """Produce a batch whose value (``value_size`` bytes) is over the record limit as parts
        under ``key``, in order; ``encoded``: each event's Avro encoding; ``fixed``: size of the
        batch's value with no events; ``part_value(start, end)``: the value of the part holding
        events ``[start, end)`` (its ``first_index`` shifted by ``start``). Events too large for any
        record are dead-lettered (:class:`~kvbus.producers.split.Splitter`)."""

        def produce_part(start: int, end: int) -> None:
            self.produce(self.raw_topic, key, part_value(start, end), end - start)

        self.splitter.split(ref, value_size, encoded, fixed, produce_part, self.produce_dead_letter, first_index)

    def produce_dead_letter(self, dl: DeadLetter) -> None:
        """Queue one DeadLetter to the DLQ topic, keyed by its source."""
        try:
            value = self._ser_dl(dl)
        except Exception as exc:  # e.g. registry unreachable: the error log is all that is left
            log.error("%sdead letter for %s not written (%s: %s)", self.label, self.dlq_topic,
                      type(exc).__name__, exc)
            return
        self.produce(self.dlq_topic, dl.source.encode(), value)

    def produce(self, topic: str, key: bytes, value: bytes, events: int = -1) -> None:
        """Queue one record; ``events``: events in it (an EventBatch record), -1 for a dead letter.
        Goes to the backlog when librdkafka's queue is full or the backlog is not empty (order)."""
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

    def _callback(self, events: int) -> Callable[[KafkaError | None, Any], None]:
        cb = self._ack_cb.get(events)
        if cb is None:
            cb = functools.partial(self._delivered, events)
            if len(self._ack_cb) < _MAX_CALLBACKS:
                self._ack_cb[events] = cb
        return cb

    def _hold(self, topic: str, key: bytes, value: bytes, events: int) -> None:
        self._backlog.append((topic, key, value, events))
        self._backlog_bytes += len(value) + len(key)
        if not self._shedding and (len(self._backlog) >= self.max_backlog
                                   or self._backlog_bytes >= self.max_backlog_bytes):
            self._shedding = True
            log.warning("%sbacklog full (%d records, %d bytes): shedding live batches until Kafka catches up",
                        self.label, len(self._backlog), self._backlog_bytes)

    # -- delivery -----------------------------------------------------------------------------
    @property
    def delivery_failures(self) -> int:
        """Records Kafka refused for good (delivery callback error, or produce() refusing it)."""
        return self.errors.refusals

    def _refused(self, err: Any, topic: str) -> None:
        self.metrics.delivery_errors.inc()
        self.errors.refused(err, topic)

    def _delivered(self, events: int, err: KafkaError | None, msg: Any) -> None:
        if err is not None:
            self._refused(err, msg.topic() if msg is not None else "?")
            return
        self.acked += 1
        self.errors.acknowledged()
        if events >= 0:
            self.metrics.batches_acked.inc()
            self.metrics.events_acked.inc(events)
        lat = msg.latency() if msg is not None else None
        if lat is not None:
            self.metrics.delivery_latency.observe(lat)

    def _on_kafka_error(self, err: KafkaError) -> None:
        self.errors.error_cb(err)

    def failure(self) -> str | None:
        """Why this producer is failing, None when it is not (a bridge's ``/readyz`` reports it):
        its backlog is full (live batches are shed); records have waited :data:`STALL_SECONDS` with
        no acknowledgement; or Kafka reported an error since the last acknowledgement. A client-level
        error (brokers down, credentials refused) stands until a metadata request succeeds again, as
        an idle producer gets no acknowledgement to clear it. Called from the probe server's thread:
        it reads this producer's state and may ask Kafka for the raw topic's metadata (0.5 s at most)."""
        if self._shedding:
            return f"backlog full ({len(self._backlog)} records): live batches are shed until Kafka takes them"
        waiting, acked, now = self.in_flight, self.acked, time.monotonic()
        seen, since = self._stall
        if not waiting or seen != acked:
            self._stall = (acked, now)
        elif now - since > STALL_SECONDS:
            return f"{waiting} records waiting for Kafka's acknowledgement for {now - since:.0f} s"
        error = self.errors.last
        if error is None or not self.errors.last_is_client:
            return error
        try:
            self.producer.list_topics(self.raw_topic, timeout=0.5)
        except KafkaException:
            return error
        if self.errors.last is error:  # Kafka answers again
            self.errors.acknowledged()
        return None

    # -- loop ---------------------------------------------------------------------------------
    def poll(self, timeout: float = 0.0) -> None:
        """Serve delivery callbacks, waiting at most ``timeout`` seconds for one."""
        self.producer.poll(timeout)

    def drain(self) -> None:
        """Move backlog records into librdkafka's queue while it takes them; accept again once
        the backlog is down to half of both bounds."""
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
        if self._shedding and len(backlog) <= self.max_backlog // 2 \
                and self._backlog_bytes <= self.max_backlog_bytes // 2:
            self._shedding = False
            log.warning("%sbacklog down to %d records: accepting live batches again", self.label, len(backlog))

    def service(self) -> None:
        """One loop pass: :meth:`poll` without waiting, then :meth:`drain`."""
        self.producer.poll(0)
        if self._backlog or self._shedding:
            self.drain()

    def accepting(self) -> bool:
        """False from when the backlog reaches a bound until it is down to half."""
        return not self._shedding

    def update_gauges(self) -> None:
        """Refresh the queue and backlog gauges."""
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

    def flush(self, timeout: float) -> int:
        """Deliver what is queued within ``timeout`` seconds; returns records left unacknowledged."""
        deadline = time.monotonic() + timeout
        while self.in_flight and time.monotonic() < deadline:
            self.service()
            self.producer.flush(min(0.5, max(0.0, deadline - time.monotonic())))
        return self.in_flight
