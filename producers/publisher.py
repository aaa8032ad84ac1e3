"""In-process publisher: an engine hands its KV-event batches straight to Kafka, no ZMQ.

Same constructor shape and ``publish``/``shutdown`` interface as vLLM's
``EventPublisher`` implementations (``shared/docs/kv-events-protocol.md`` §2), so a
vLLM plugin (or any engine) can construct it like its ZMQ publisher. It writes the
same Avro ``EventBatch`` records to the raw topic as the bridge does, with
``engine="kvbus"``; a batch too large for one record is produced as several
(:mod:`kvbus.producers.split`).

Usage::

    pub = create_publisher("kafka", replica="pod-a", data_parallel_rank=0, model="Qwen/Qwen3-8B")
    pub.publish(batch)          # vLLM KVEventBatch, or ts/events/data_parallel_rank duck-typed
    pub.shutdown()
"""
from __future__ import annotations

import logging
import threading
import time
from operator import itemgetter
from typing import Any, Protocol

import msgspec

from kvbus.producers.engines import CONVERSION, to_kvbus_event
from kvbus.producers.engines.convert import MEDIUMS
from kvbus.producers.metrics import BridgeMetrics
from kvbus.producers.record_producer import RecordProducer, producer_conf
from kvbus.producers.sequencer import REASON_ENGINE_RESTART, REASON_GAP
from kvbus.producers.split import BatchRef
from kvbus.runtime.probes import Readiness
from kvbus.runtime.settings import Settings
from kvbus.schemas.codec import (
    FastSerde,
    batch_from_head,
    batch_head,
    confluent_header,
    encode_event,
    encode_events,
    event_array,
    event_writer,
)
from kvbus.schemas.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    DeadLetter,
    Reset,
    canonical_hashes,
    canonical_parent,
    check_model,
    holder_key,
    without_tokens,
)
from kvbus.schemas.serde import registry_client, value_schema_id

log = logging.getLogger("kvbus.producers.publisher")

ENGINE = "kvbus"
"""EventBatch.engine of records written by this publisher."""


class EventPublisher(Protocol):
    """What an engine calls (vLLM's ``EventPublisher`` interface)."""

    def publish(self, events: Any) -> None: ...
    def shutdown(self) -> None: ...


class NullEventPublisher:
    """Publishes nothing (events disabled); costs nothing."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def publish(self, events: Any) -> None:
        """Drop the batch."""

    def shutdown(self) -> None:
        """Nothing to release."""


# -- vLLM object -> Avro event ----------------------------------------------------------

_STORED_COPIED = CONVERSION.copied("BlockStored")
_REMOVED_COPIED = CONVERSION.copied("BlockRemoved")
"""(field, default) of the kvbus fields the conversion copies from an engine event as they are."""

_PLANS: dict[tuple[type, bool], Any] = {}
_STORED_SHAPE = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "medium", "group_idx",
                 "kv_cache_spec_kind")
_REMOVED_SHAPE = ("block_hashes", "medium", "group_idx")
"""The common event shapes: these fields set, every other field the conversion reads at its default."""
_NO_TOKENS: list[int] = []
"""``token_ids`` written when the prompt's tokens are not kept."""
_WRITE_STORED = event_writer("BlockStored", _STORED_SHAPE)
_WRITE_REMOVED = event_writer("BlockRemoved", _REMOVED_SHAPE)
"""The codec's positional writers of the common shapes."""


def _plan(cls: type, keep_tokens: bool) -> Any:
    """An encoder specialised to one engine event class, and to keeping the prompt's tokens or not
    (``keep_tokens``, :attr:`kvbus.runtime.settings.Settings.keep_token_ids`; when not, the token fields
    are encoded at their defaults, :func:`kvbus.schemas.events.without_tokens`). Events of the common
    shape of a msgspec struct
    class go straight to the codec's positional writer of its fields
    (:func:`kvbus.schemas.codec.event_writer`), read with one ``astuple`` call at field positions found
    once, their values made by the conversion's rules (hashes, :data:`~kvbus.producers.engines.convert.MEDIUMS`);
    every other event is converted
    by :data:`kvbus.producers.engines.CONVERSION` and encoded as the struct. The bytes are the same either
    way. ValueError for a class that is no engine event type."""
    if cls in (BlockStored, BlockRemoved, AllBlocksCleared, Reset):
        return encode_event if keep_tokens else lambda e: encode_event(without_tokens(e))
    name = cls.__name__
    convert = CONVERSION.converter(cls, name)

    def slow(e: Any) -> bytes:
        return encode_event(convert(e) if keep_tokens else without_tokens(convert(e)))

    fields = getattr(cls, "__struct_fields__", None)
    if name == "AllBlocksCleared":
        cleared = encode_event(AllBlocksCleared())
        return lambda e: cleared
    if fields is None or name not in ("BlockStored", "BlockRemoved"):
        return slow
    pos = {f: i for i, f in enumerate(fields)}
    astuple = msgspec.structs.astuple
    medium_of = MEDIUMS.__getitem__
    hashes_of = canonical_hashes
    n_fields = len(fields)
    shape = _STORED_SHAPE if name == "BlockStored" else _REMOVED_SHAPE
    # every other field the conversion reads must be unset for the common shape (a new field joins by itself)
    idx = [pos[f] for f in CONVERSION.sent[name] if f not in shape and f in pos]
    others = itemgetter(*idx) if idx else (lambda v: None)
    unset = others((None,) * n_fields)
    padded = any(f not in pos for f in shape)  # a shape field the class lacks: read as a None appended
    i_h, i_m, i_g = (pos.get(f, n_fields) for f in ("block_hashes", "medium", "group_idx"))

    if name == "BlockRemoved":
        def removed(e: Any) -> bytes:
            v = astuple(e)
            if padded:
                v += (None,)
            if others(v) != unset:
                return slow(e)
            hashes, digests = hashes_of(v[i_h])
            if digests is not None:
                return slow(e)
            return _WRITE_REMOVED(hashes, medium_of(v[i_m]), v[i_g])
        return removed

    i_p, i_t, i_bs, i_k = (pos.get(f, n_fields) for f in ("parent_block_hash", "token_ids", "block_size",
                                                          "kv_cache_spec_kind"))
    parent_of = canonical_parent

    def stored(e: Any) -> bytes:
        v = astuple(e)
        if padded:
            v += (None,)
        toks = v[i_t] if keep_tokens else _NO_TOKENS
        if others(v) != unset or type(toks) is not list or toks and type(toks[0]) is not int:
            return slow(e)  # e.g. SGLang's bigram pairs
        hashes, digests = hashes_of(v[i_h])
        parent = v[i_p]
        if parent is not None:
            parent, digest = parent_of(parent)
            if digest is not None:
                return slow(e)
        if digests is not None:
            return slow(e)
        return _WRITE_STORED(hashes, parent, toks, v[i_bs], medium_of(v[i_m]), v[i_g], v[i_k])
    return stored


def encode_engine_event(e: Any, keep_tokens: bool = True) -> bytes:
    """Avro encoding (event-union branch) of a vLLM/SGLang event object (or a kvbus struct), its
    prompt tokens at their defaults unless ``keep_tokens``.

    msgspec-struct events of the common shape (integer hashes, no LoRA, no extra keys, no
    offload attribution) are encoded directly; anything else is converted by
    :data:`kvbus.producers.engines.CONVERSION` first. The bytes are the same either way."""
    key = (type(e), keep_tokens)
    f = _PLANS.get(key)
    if f is None:
        f = _PLANS[key] = _plan(type(e), keep_tokens)
    return f(e)


def encode_engine_events(events: list, keep_tokens: bool = True) -> bytes:
    """The Avro ``events`` array of engine event objects (:func:`encode_engine_event`)."""
    plans = _PLANS
    out = []
    for e in events:
        key = (type(e), keep_tokens)
        f = plans.get(key)
        if f is None:
            f = plans[key] = _plan(type(e), keep_tokens)
        out.append(f(e))
    return event_array(out)


# -- the publisher ------------------------------------------------------------------------

class KafkaEventPublisher:
    """Publishes an engine's KV-event batches to Kafka (topic ``settings.topics.raw``) as Avro
    ``EventBatch`` records keyed ``<replica>#<dp_rank>``.

    Contract (as vLLM's ``EventPublisher``):

    * **At-least-once, in order.** Each ``publish()`` becomes one record with ``seq`` =
      0, 1, 2, ... (monotonic, per publisher) in ``epoch`` = this publisher's start time in
      ms; the idempotent producer keeps per-partition order. A consumer may see a record
      twice (retries across a producer restart) and tells by its (epoch, seq) position.
    * **Large batches.** A batch whose value exceeds ``max_record_bytes`` (default
      ``settings.max_record_bytes``) becomes several records of the same seq with consecutive
      ``first_index``, in order; an event too large for any record is dead-lettered to
      ``settings.topics.dlq`` (truncated; :mod:`kvbus.producers.split`). ``metrics`` counts them.
    * **Never blocks the engine.** ``publish()`` encodes and queues; delivery is
      asynchronous. While Kafka is unreachable records wait in librdkafka's bounded queue
      (``hwm`` records) plus a backlog of ``max_queue_size`` records; beyond that batches
      are dropped and the loss is announced by a ``Reset(gap-unrecoverable, from, to)``
      marker (seq -1, new epoch) before the next record that fits.
    * **Start.** A new publisher is a new engine run: it first writes a
      ``Reset(engine-restart)`` marker (seq -1) in its epoch, so consumers drop what the
      previous run of this (replica, dp_rank) announced.
    * **No prompt tokens.** The events' token ids (:data:`kvbus.schemas.events.TOKEN_FIELDS`) are
      written at their defaults unless ``settings.keep_token_ids`` (``KVBUS_KEEP_TOKEN_IDS``).
    * ``shutdown()`` delivers what is queued (bounded wait) and closes; ``publish()``
      afterwards raises RuntimeError.

    kvbus arguments: ``replica`` (required), ``settings`` (topics, registry; default from the
    environment), ``worker_rank``/``workers``, ``producer_overrides`` (librdkafka settings),
    ``schema_id`` (skip the registry lookup), ``producer`` (an injected producer, tests),
    ``max_record_bytes``, ``metrics`` (a :class:`~kvbus.producers.metrics.BridgeMetrics`; records out and
    acknowledged, delivery errors, dropped batches, markers, queue and backlog depth),
    ``metrics_port`` (serve those at ``http://0.0.0.0:<port>/metrics``, with ``/healthz`` and ``/readyz``:
    503 while the producer fails; default: not served), ``model`` (the model the engine serves, its
    served model name, written into every record as ``EventBatch.model`` so that lookups naming the
    model find this replica; default None: lookups naming a model skip it).

    vLLM constructor arguments: ``endpoint`` is the Kafka bootstrap (default
    ``settings.bootstrap``); ``topic`` is carried as EventBatch.topic; ``hwm`` bounds
    librdkafka's queue; ``max_queue_size`` the backlog beyond it; ``replay_endpoint`` and
    ``buffer_steps`` are accepted and unused (Kafka is the replay log).
    """

    def __init__(
        self,
        data_parallel_rank: int = 0,
        endpoint: str | None = None,
        replay_endpoint: str | None = None,
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        max_queue_size: int = 100_000,
        topic: str = "",
        *,
        replica: str,
        settings: Settings | None = None,
        worker_rank: int = 0,
        workers: int = 1,
        producer_overrides: dict[str, Any] | None = None,
        schema_id: int | None = None,
        producer: Any = None,
        max_record_bytes: int | None = None,
        metrics: BridgeMetrics | None = None,
        metrics_port: int | None = None,
        model: str | None = None,
    ) -> None:
        self.settings = settings or Settings.from_env()
        self.dp_rank = data_parallel_rank
        self.replica = replica
        self.model = check_model(model)
        self.topic = topic
        self.worker_rank = worker_rank
        self.workers = workers
        self.kafka_topic = self.settings.topics.raw
        if schema_id is None:
            schema_id = value_schema_id(registry_client(self.settings), self.kafka_topic, "EventBatch")
        self._header = confluent_header(schema_id)
        self.metrics = metrics or BridgeMetrics()
        readiness = Readiness(starting="its producer")
        if metrics_port:
            self.metrics.serve(metrics_port, readiness)
            log.info("kvbus publisher %s: metrics on :%d/metrics, probes on /healthz and /readyz", replica,
                     metrics_port)
        overrides = {"queue.buffering.max.messages": hwm, **(producer_overrides or {})}
        self._dead_letter_serde: FastSerde | None = None
        self.records = RecordProducer(
            self.kafka_topic, self.settings.topics.dlq, self._serialize_dead_letter, self.metrics,
            stage="publisher", producer=producer,
            conf=producer_conf({**self.settings.kafka(), **({"bootstrap.servers": endpoint} if endpoint else {})},
                               overrides),
            max_record_bytes=max_record_bytes or self.settings.max_record_bytes, max_backlog=max_queue_size,
            label=f"kvbus publisher {replica}: ",
        )
        """The shared record producer: backlog (``max_queue_size`` records), delivery, split, DLQ."""
        readiness.add(self.records.failure)  # /readyz: 503 while the producer fails
        readiness.starting = None
        self.producer = self.records.producer
        self.splitter = self.records.splitter
        self.epoch = int(time.time() * 1000)
        self._seq = 0
        self._prefix: dict[int, bytes] = {}
        self._keys: dict[int, bytes] = {}
        self._lost: tuple[int, int] | None = None
        self._closed = False
        self.dropped = 0
        """Batches dropped because queue and backlog were full."""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._poller = threading.Thread(target=self._poll_loop, name="kvbus-publisher-poll", daemon=True)
        self._poller.start()
        self._marker(REASON_ENGINE_RESTART, None, None, self.dp_rank)

    @property
    def acked(self) -> int:
        """Records Kafka acknowledged."""
        return self.records.acked

    @property
    def failed(self) -> int:
        """Records Kafka refused (delivery error)."""
        return self.records.delivery_failures

    # -- encoding -----------------------------------------------------------------------
    def _key_prefix(self, dp: int) -> tuple[bytes, bytes]:
        prefix = self._prefix.get(dp)
        if prefix is None:
            prefix = self._prefix[dp] = self._header + batch_head(self.replica, dp, self.worker_rank, self.workers,
                                                                  ENGINE, self.model)
            self._keys[dp] = holder_key(self.replica, dp).encode()
        return self._keys[dp], prefix

    def _marker(self, reason: str, missing_from: int | None, missing_to: int | None, dp: int) -> None:
        key, prefix = self._key_prefix(dp)
        value = batch_from_head(prefix, self.epoch, -1, time.time(), self.topic,
                                encode_events([Reset(reason=reason, missing_from=missing_from, missing_to=missing_to)]))
        self.metrics.resets.inc()
        self.records.produce(self.kafka_topic, key, value, 1)

    def publish(self, events: Any) -> None:
        """Publish one batch: an object with ``ts``, ``events`` and optionally
        ``data_parallel_rank`` (vLLM KVEventBatch, kvbus.schemas.events.EventBatch or alike)."""
        if self._closed:
            raise RuntimeError("publish() after shutdown()")
        batch = events
        dp = getattr(batch, "data_parallel_rank", None)
        if dp is None:
            dp = getattr(batch, "dp_rank", None)
        if dp is None:
            dp = self.dp_rank
        evs = encode_engine_events(batch.events, self.settings.keep_token_ids)
        key, prefix = self._key_prefix(dp)
        records = self.records
        with self._lock:
            seq = self._seq
            self._seq += 1
            if not records.accepting():
                self.dropped += 1
                self.metrics.shed.inc()
                lo = self._lost[0] if self._lost else seq
                self._lost = (lo, seq)
                return
            if self._lost is not None:
                lo, hi = self._lost
                self._lost = None
                self.epoch = max(self.epoch + 1, int(time.time() * 1000))
                log.warning("kvbus publisher %s: batches %d..%d were dropped (Kafka unavailable); new epoch %d",
                            self.replica, lo, hi, self.epoch)
                self._marker(REASON_GAP, lo, hi, dp)
            ts = float(batch.ts)
            n = len(batch.events)
            self.metrics.events_in.inc(n)
            value = batch_from_head(prefix, self.epoch, seq, ts, self.topic, evs)
            if records.fits(len(value)):
                records.produce(self.kafka_topic, key, value, n)
            else:
                self._produce_split(key, prefix, dp, seq, ts, batch.events, len(value))

    def _produce_split(self, key: bytes, prefix: bytes, dp: int, seq: int, ts: float, events: Any,
                       value_size: int) -> None:
        """Queue one batch as parts under the record limit; dead-letter events that fit no record."""
        encoded = [encode_engine_event(e, self.settings.keep_token_ids) for e in events]
        epoch = self.epoch

        def part_value(start: int, end: int) -> bytes:
            return batch_from_head(prefix, epoch, seq, ts, self.topic, event_array(encoded[start:end]), start)

        ref = BatchRef(self.replica, dp, self.worker_rank, epoch, seq)
        fixed = len(batch_from_head(prefix, epoch, seq, ts, self.topic, event_array([])))
        self.records.produce_split(key, value_size, ref, encoded, fixed, part_value)

    def _serialize_dead_letter(self, dl: DeadLetter) -> bytes:
        """A DeadLetter's value for the DLQ topic (its schema id is looked up on first use; raises
        when the registry is unreachable, and the record producer logs the letter as lost)."""
        if self._dead_letter_serde is None:
            self._dead_letter_serde = FastSerde(registry_client(self.settings), "DeadLetter")
        return self._dead_letter_serde.dumps(dl, self.settings.topics.dlq)

    def _poll_loop(self) -> None:
        records = self.records
        while not self._stop.is_set():
            records.poll(0.05)
            if records.backlog or not records.accepting():
                with self._lock:
                    records.drain()
            records.update_gauges()

    # -- lifecycle ----------------------------------------------------------------------
    @property
    def pending(self) -> int:
        """Records not yet acknowledged (queue + backlog)."""
        return self.records.in_flight

    def flush(self, timeout: float = 10.0) -> int:
        """Wait up to ``timeout`` s for delivery; returns records still pending."""
        deadline = time.monotonic() + timeout
        while self.pending and time.monotonic() < deadline:
            with self._lock:
                self.records.drain()
            self.producer.flush(min(0.2, max(0.0, deadline - time.monotonic())))
        return self.pending

    def shutdown(self, timeout: float = 10.0) -> None:
        """Deliver what is queued (at most ``timeout`` s) and stop."""
        if self._closed:
            return
        self._closed = True
        left = self.flush(timeout)
        self._stop.set()
        self._poller.join(timeout=2)
        if left:
            log.error("kvbus publisher %s: %d records not delivered at shutdown", self.replica, left)


PUBLISHERS: dict[str, type] = {"null": NullEventPublisher, "kafka": KafkaEventPublisher}
"""Publisher kinds of :func:`create_publisher`."""


def create_publisher(kind: str = "kafka", **kwargs: Any) -> EventPublisher:
    """A publisher by kind ("null" or "kafka"); ``kwargs`` go to its constructor."""
    try:
        cls = PUBLISHERS[kind]
    except KeyError:
        raise ValueError(f"unknown publisher {kind!r}; known: {', '.join(PUBLISHERS)}") from None
    return cls(**kwargs)


__all__ = ["KafkaEventPublisher", "NullEventPublisher", "EventPublisher", "create_publisher", "to_kvbus_event"]
