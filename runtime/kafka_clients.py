"""The confluent-kafka clients of every kvbus stage: one place for their configurations, for what a
delivery error does, and for creating topics.

* :func:`producer_conf`: every producer is idempotent (``acks=all``, ordered retries), lz4-compressed
  and partitions keys with murmur2 as the Java client and aiokafka do (:data:`PRODUCER_CONF`); a
  role lays its own properties over that (the bridge's queue bounds, the snapshot writer's record size).
* :func:`consumer_conf` / :func:`reader_conf`: every consumer commits only explicitly and starts at the
  earliest record (:data:`CONSUMER_CONF`); a reader is a consumer of a group made up for one read.
* :class:`DeliveryErrors`: a client's ``error_cb`` and delivery reports, logged at most every few
  seconds with what to fix when Kafka refused the client's security settings, counted, and kept for
  the caller's policy (the bridge holds records, the sink's dead letters and snapshots raise, the
  worker produces its outputs again).
* :func:`ensure_topics`: the one place a topic is created, from its declaration
  (:class:`kvbus.schemas.topics.TopicSpec`).
* :class:`GroupOffsets`: the one way a stage reads a consumer group's committed offsets.

Connection and security properties come from ``kafka``: a bootstrap string (an open cluster) or
:meth:`kvbus.runtime.settings.Settings.kafka` (servers, security, the log bridge); they are laid
over the role's properties, so a role never overrides them.
"""
from __future__ import annotations

import logging
import time
import uuid
from typing import Any, Callable, Iterable, Mapping, TypeVar

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from kvbus.runtime.backoff import Backoff
from kvbus.runtime.security import describe_kafka_error, kafka_error_report
from kvbus.schemas.topics import TopicSpec

log = logging.getLogger("kvbus.kafka")

RECOVERY_CONF: Mapping[str, Any] = {
    # librdkafka waits up to reconnect.backoff.max.ms (default 10 s) between attempts to reach a
    # broker that went away: a broker back after a crash or a restart was left unused for up to
    # 10 s (its partitions' leaders once preferred leaders move back to it). 1 s: on loopback or a
    # LAN an attempt costs one refused connection
    "reconnect.backoff.max.ms": 1000,
}
"""What every kvbus librdkafka client (producer and consumer) does after losing a broker; part of
:data:`PRODUCER_CONF` and :data:`CONSUMER_CONF`."""

PRODUCER_CONF: Mapping[str, Any] = {
    **RECOVERY_CONF,
    "enable.idempotence": True,  # acks=all, ordered retries, no duplicates from retries
    "acks": "all",
    "compression.type": "lz4",
    # same key -> partition mapping as the Java client and aiokafka (the worker reads with aiokafka)
    "partitioner": "murmur2_random",
    # a record waits at most this long for others to share its request: the view's freshness
    # budget is tens of ms end to end; under load librdkafka batches while requests are in flight
    "linger.ms": 5,
    "log.connection.close": False,
}
"""What every kvbus producer is; a role's properties are laid over it (:func:`producer_conf`)."""

CONSUMER_CONF: Mapping[str, Any] = {
    **RECOVERY_CONF,
    "enable.auto.commit": False,  # a stage commits what it has applied, a reader commits nothing
    "auto.offset.reset": "earliest",
    "enable.partition.eof": False,
    "log.connection.close": False,
}
"""What every kvbus consumer is; a role's properties are laid over it (:func:`consumer_conf`)."""


def client_conf(kafka: str | Mapping[str, Any]) -> dict[str, Any]:
    """A confluent-kafka base configuration from ``kafka``: a bootstrap string (an open cluster) or
    a configuration from :meth:`Settings.kafka` (bootstrap servers and security properties)."""
    return {"bootstrap.servers": kafka} if isinstance(kafka, str) else dict(kafka)


def producer_conf(kafka: str | Mapping[str, Any], role: Mapping[str, Any] | None = None,
                  overrides: Mapping[str, Any] | None = None, **callbacks: Any) -> dict[str, Any]:
    """A producer's librdkafka configuration: :data:`PRODUCER_CONF`, the ``role``'s properties, then
    ``kafka``'s connection and security, then ``overrides`` (an operator's own, e.g. the bridge's
    ``--producer-conf``), then ``callbacks`` (``error_cb``)."""
    return {**PRODUCER_CONF, **(role or {}), **client_conf(kafka), **(overrides or {}), **callbacks}


def consumer_conf(kafka: str | Mapping[str, Any], group: str, role: Mapping[str, Any] | None = None,
                  **callbacks: Any) -> dict[str, Any]:
    """A consumer's librdkafka configuration: :data:`CONSUMER_CONF` in consumer group ``group``, the
    ``role``'s properties, then ``kafka``'s connection and security, then ``callbacks``."""
    return {**CONSUMER_CONF, "group.id": group, **(role or {}), **client_conf(kafka), **callbacks}


def reader_conf(kafka: str | Mapping[str, Any], group_prefix: str, role: Mapping[str, Any] | None = None,
                **callbacks: Any) -> dict[str, Any]:
    """:func:`consumer_conf` of a consumer that reads once and commits nothing, in a group of its own:
    ``<group_prefix><random hex>`` (the prefixes of :mod:`kvbus.schemas.topics`, which ACLs grant)."""
    return consumer_conf(kafka, f"{group_prefix}{uuid.uuid4().hex}", role, **callbacks)


COORDINATOR_MOVING = frozenset({KafkaError.NOT_COORDINATOR, KafkaError.COORDINATOR_LOAD_IN_PROGRESS,
                                KafkaError.COORDINATOR_NOT_AVAILABLE})
"""Error codes of a group's coordinator that moved (after a broker fault or pause) or is still
loading (a fresh cluster): asked again a moment later, the new coordinator answers."""

T = TypeVar("T")


def until_coordinator_answers(call: Callable[[float], T], timeout: float, what: str) -> T:
    """``call(seconds left)``, asked again while it raises one of :data:`COORDINATOR_MOVING`, for up
    to ``timeout`` seconds in all; then (or on any other error) the KafkaException propagates.
    librdkafka's consumer re-queries the coordinator after such an answer, but hands the error of
    that one request to the caller of ``committed`` (seen after SIGSTOP/SIGCONT of the broker that
    coordinated a worker's group: the worker's rebuild died on NOT_COORDINATOR). ``what``: for the log."""
    pauses = Backoff(first=0.1, cap=2.0)
    deadline = time.monotonic() + timeout
    while True:
        try:
            return call(max(0.1, deadline - time.monotonic()))
        except KafkaException as exc:
            code = exc.args[0].code() if exc.args and isinstance(exc.args[0], KafkaError) else None
            pause = pauses.next()
            if code not in COORDINATOR_MOVING or time.monotonic() + pause >= deadline:
                raise
            log.info("%s: the group's coordinator answered %s; asking again in %.2f s", what,
                     exc.args[0].name(), pause)
            time.sleep(pause)


class GroupOffsets:
    """The committed offsets of consumer group ``group``, read through a consumer of that group that
    never subscribes (so it never joins the group nor takes partitions from its members).

    Why not ``AdminClient.list_consumer_group_offsets``: when the group's coordinator answers
    NOT_COORDINATOR (it moved after a broker fault, or a fresh cluster has not finished loading it),
    librdkafka (2.16 and earlier) asks the client's own consumer group to find the coordinator again,
    and an admin client has none: a NULL dereference that kills the whole process with SIGSEGV
    (https://github.com/confluentinc/librdkafka/issues/5040). A consumer of the group re-queries the
    coordinator and retries instead (tests/test_kafka_clients.py holds both against a fresh broker).
    """

    def __init__(self, kafka: str | Mapping[str, Any], group: str, role: Mapping[str, Any] | None = None) -> None:
        """``role``: more librdkafka properties of the consumer (e.g. a ``logger``)."""
        self._consumer = Consumer(consumer_conf(kafka, group, role))

    def serve(self) -> None:
        """Serve what librdkafka queued for the consumer (log lines for a ``logger``, errors): nothing
        else polls a consumer that never subscribes, and its queue would keep them for its whole life."""
        self._consumer.poll(0)

    def committed(self, topic_partitions: Iterable[tuple[str, int]], timeout: float = 30.0
                  ) -> dict[tuple[str, int], int | None]:
        """``(topic, partition) -> the group's next offset there``, None where it committed none.
        A coordinator that moved is asked again (:func:`until_coordinator_answers`). Raises
        KafkaException when Kafka cannot say within ``timeout`` seconds."""
        tps = [TopicPartition(t, p) for t, p in topic_partitions]
        if not tps:
            return {}
        answer = until_coordinator_answers(lambda left: self._consumer.committed(tps, timeout=left), timeout,
                                           f"committed offsets of {len(tps)} partitions")
        return {(tp.topic, tp.partition): (tp.offset if tp.offset >= 0 else None) for tp in answer}

    def watermarks(self, topic_partitions: Iterable[tuple[str, int]], timeout: float = 30.0
                   ) -> dict[tuple[str, int], tuple[int, int]]:
        """``(topic, partition) -> (earliest offset, high watermark)``, asked of each partition's
        leader now (not cached). Raises KafkaException when Kafka cannot say within ``timeout`` s."""
        return {(t, p): self._consumer.get_watermark_offsets(TopicPartition(t, p), timeout=timeout, cached=False)
                for t, p in topic_partitions}

    def consumer(self) -> Consumer:
        """The underlying consumer, for metadata and watermarks (it must never subscribe)."""
        return self._consumer

    def close(self) -> None:
        self._consumer.close()


class RateLimitedLog:
    """Log a recurring condition at most once per ``every`` seconds, with the count of the
    messages suppressed in between (`` (+N similar)``)."""

    def __init__(self, every: float = 5.0, logger: logging.Logger = log) -> None:
        self.every = every
        self.logger = logger
        self._last = float("-inf")
        self._suppressed = 0

    def __call__(self, level: int, msg: str, *args: Any) -> None:
        now = time.monotonic()
        if now - self._last >= self.every:
            suffix = f" (+{self._suppressed} similar)" if self._suppressed else ""
            self.logger.log(level, msg + suffix, *args)
            self._last = now
            self._suppressed = 0
        else:
            self._suppressed += 1


class DeliveryErrors:
    """What Kafka refused of one client: its records (delivery reports) and the client itself
    (``error_cb``: brokers down, credentials or rights refused).

    Each is described with what to fix when it is a security refusal (named by the client's
    configuration ``conf``: its SASL user and protocol) and logged at most every ``every`` seconds
    per kind, prefixed by ``label``; records refused are counted. What follows is the caller's
    policy: :meth:`take` the texts since the last call (and raise, or produce again), read
    :attr:`last` (a probe), :meth:`acknowledged` when Kafka takes a record again."""

    def __init__(self, conf: Mapping[str, Any], logger: logging.Logger = log, label: str = "",
                 every: float = 5.0) -> None:
        self.conf = dict(conf)
        self.label = label
        self.refusals = 0
        """Records Kafka refused for good (a delivery report's error, or produce() refusing one)."""
        self.last: str | None = None
        """The last error since Kafka last acknowledged a record (None: none)."""
        self.last_is_client = False
        """Whether :attr:`last` came from the client (brokers down, credentials refused) rather than a record."""
        self._pending: list[str] = []
        self._records_log = RateLimitedLog(every, logger)
        self._client_log = RateLimitedLog(every, logger)

    def refused(self, err: Any, topic: str) -> str:
        """A record to ``topic`` that Kafka (or the client, ``err`` a KafkaError or its text) refused:
        counted, logged, kept; returns its description."""
        text = describe_kafka_error(err, self.conf)
        self.refusals += 1
        self.last, self.last_is_client = f"a record to {topic} was refused: {text}", False
        self._pending.append(text)
        self._records_log(logging.ERROR, "%srecord to %s refused: %s", self.label, topic, text)
        return text

    def on_delivery(self, err: KafkaError | None, msg: Any) -> None:
        """A delivery report (``on_delivery``): a refusal is :meth:`refused`, an acknowledgement
        :meth:`acknowledged`."""
        if err is not None:
            self.refused(err, msg.topic() if msg is not None else "?")
        else:
            self.acknowledged()

    def error_cb(self, err: KafkaError) -> None:
        """librdkafka's client-level errors (``error_cb``), logged as an error when it is a security
        refusal (no retry fixes it), else as a warning."""
        level, text = kafka_error_report(err, self.conf)
        self.last, self.last_is_client = f"Kafka: {text}", True
        self._client_log(level, "%skafka: %s", self.label, text)

    def acknowledged(self) -> None:
        """Kafka acknowledged a record: :attr:`last` is cleared."""
        if self.last is not None:
            self.last = None

    def take(self) -> list[str]:
        """The descriptions of the records refused since the last call."""
        pending, self._pending = self._pending, []
        return pending

    def raise_if_undelivered(self, what: str, remaining: int) -> None:
        """After a flush that left ``remaining`` records queued: :class:`KafkaException` naming ``what``
        if any were left or refused since the last :meth:`take`."""
        errors = self.take()
        if remaining or errors:
            raise KafkaException(f"{what} not delivered ({remaining} pending, errors: {errors[:3]})")


def ensure_topics(kafka: str | Mapping[str, Any] | AdminClient, specs: Iterable[TopicSpec],
                  timeout: float = 30.0) -> list[str]:
    """Create the topics of ``specs`` that do not exist, as declared (partitions, replicas,
    configuration); an existing topic is left as it is. Waits until each has a leader on every
    partition; returns the names created by this call. ``kafka``: a bootstrap string,
    :meth:`Settings.kafka`, or an admin client."""
    specs = list({s.name: s for s in specs}.values())
    if not specs:
        return []
    admin = kafka if isinstance(kafka, AdminClient) else AdminClient(client_conf(kafka))
    md = admin.list_topics(timeout=timeout)
    missing = [s for s in specs if s.name not in md.topics or md.topics[s.name].error is not None]
    created: list[str] = []
    if missing:
        new = [NewTopic(s.name, num_partitions=s.partitions, replication_factor=s.replicas, config=dict(s.config))
               for s in missing]
        for name, fut in admin.create_topics(new, operation_timeout=timeout, request_timeout=timeout).items():
            try:
                fut.result(timeout=timeout)
                created.append(name)
            except KafkaException as exc:
                err = exc.args[0] if exc.args else None
                if not (isinstance(err, KafkaError) and err.code() == KafkaError.TOPIC_ALREADY_EXISTS):
                    raise
    _wait_for_leaders(admin, [s.name for s in specs], timeout)
    for s in missing:
        if s.name in created:
            log.info("created topic %s (partitions %d, replication %d, cleanup.policy %s)", s.name, s.partitions,
                     s.replicas, s.config.get("cleanup.policy", "delete"))
    return created


def _wait_for_leaders(admin: AdminClient, names: list[str], timeout: float) -> None:
    """Until metadata shows every topic of ``names`` with a leader on each partition."""
    deadline = time.monotonic() + timeout
    while True:
        md = admin.list_topics(timeout=max(1.0, deadline - time.monotonic()))
        pending = [n for n in names
                   if n not in md.topics or md.topics[n].error is not None or not md.topics[n].partitions
                   or any(p.leader < 0 for p in md.topics[n].partitions.values())]
        if not pending:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"topics without a leader after {timeout:.0f} s: {', '.join(pending)}")
        time.sleep(0.2)
