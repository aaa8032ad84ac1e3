"""Read kvbus topics for a time range with a plain registry-aware consumer.

This is the consumer docs/reading-topics.md tells analytics users to configure: confluent-kafka's ``Consumer``,
``SchemaRegistryClient`` (with a timeout) and ``AvroDeserializer`` with the topic subject-name strategy
and no reader schema, so each record is decoded with the writer's schema the registry holds for
its id (records of older schema versions read as they were written). Nothing of kvbus's own
generated codec is used.

The consumer has a fresh group id and commits nothing: it assigns every partition of the chosen
topics from the first offset at or after ``since`` (``offsets_for_times``) and stops at the first
offset at or after ``until``, or at the end offset when reading starts, so the number of records
to read is known before the first one arrives. Record times need not grow with the offsets (several
producers, a clock stepped back): records between those offsets whose time is outside the range are
left out, and a record after the end offset with a time inside the range is not read.
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from confluent_kafka import Consumer, KafkaException, TopicPartition
from confluent_kafka.schema_registry import topic_subject_name_strategy
from confluent_kafka.schema_registry.avro import AvroDeserializer
from confluent_kafka.serialization import MessageField, SerializationContext

from kvbus.analytics.timerange import TimeRange
from kvbus.runtime.kafka_clients import consumer_conf, reader_conf
from kvbus.runtime.settings import Settings
from kvbus.schemas.serde import registry_client
from kvbus.schemas.topics import REPORT_GROUP_PREFIX

log = logging.getLogger("kvbus.report")


@dataclass(frozen=True)
class PartitionRange:
    """Offsets ``start <= offset < end`` of one partition to read."""

    topic: str
    partition: int
    start: int
    end: int

    @property
    def records(self) -> int:
        """Offsets in the range (transaction markers included: an upper bound of the records)."""
        return max(0, self.end - self.start)


@dataclass(frozen=True)
class Record:
    """One decoded Kafka record."""

    topic: str
    partition: int
    offset: int
    timestamp: float
    """Kafka record timestamp, seconds since the Unix epoch."""
    key: str | None
    value: Any
    """The Avro value as the deserializer returns it (dicts; a union of records as
    ``(full name, dict)``), or None for a record that could not be decoded."""


def plain_deserializer(settings: Settings) -> AvroDeserializer:
    """confluent-kafka's ``AvroDeserializer`` configured as docs/reading-topics.md says for analytics users:
    topic subject-name strategy, a registry client with a timeout (and the registry credentials of
    ``settings``, if any), writer's schema, union branches returned with their record name."""
    return AvroDeserializer(
        registry_client(settings),
        return_record_name=True,
        conf={"subject.name.strategy": topic_subject_name_strategy},
    )


def block_topics(settings: Settings, consumer: Consumer | None = None) -> list[str]:
    """The block topics of both layouts that exist (``Topics.blocks_pattern``: ``kvbus.blocks``,
    ``kvbus.blocks-packed`` and their ``.<ownership>`` tier topics), sorted."""
    own = consumer or Consumer(consumer_conf(settings.kafka(), f"{REPORT_GROUP_PREFIX}meta"))
    try:
        rx = re.compile(settings.topics.blocks_pattern())
        return sorted(t for t in own.list_topics(timeout=10).topics if rx.match(t))
    finally:
        if consumer is None:
            own.close()


def plan(consumer: Consumer, topics: list[str], span: TimeRange) -> list[PartitionRange]:
    """The offset range of every partition of ``topics`` (those that exist) within ``span``."""
    md = consumer.list_topics(timeout=10)
    tps = [TopicPartition(t, p) for t in topics if t in md.topics for p in sorted(md.topics[t].partitions)]
    if not tps:
        return []
    marks = {(tp.topic, tp.partition): consumer.get_watermark_offsets(tp, timeout=10, cached=False) for tp in tps}

    def at(ts: float | None, default: str) -> dict[tuple[str, int], int]:
        if ts is None:
            return {k: lo if default == "low" else hi for k, (lo, hi) in marks.items()}
        found = consumer.offsets_for_times([TopicPartition(tp.topic, tp.partition, int(ts * 1000)) for tp in tps],
                                           timeout=10)
        # -1: no record at or after ts, so the range starts (or ends) at the end of the partition
        return {(f.topic, f.partition): f.offset if f.offset >= 0 else marks[(f.topic, f.partition)][1] for f in found}

    start, end = at(span.since, "low"), at(span.until, "high")
    return [PartitionRange(t, p, start[(t, p)], end[(t, p)]) for (t, p) in marks]


def read(settings: Settings, topics: list[str], span: TimeRange,
         on_plan: Callable[[list[PartitionRange]], None] | None = None,
         on_record: Callable[[Record], None] | None = None) -> Iterator[Record]:
    """Every record of ``topics`` within ``span``, decoded; ``on_plan`` is called once with the
    ranges before reading, ``on_record`` after each record (progress). A record the deserializer
    cannot decode is yielded with ``value`` None (the caller counts it)."""
    consumer = Consumer(reader_conf(settings.kafka(), REPORT_GROUP_PREFIX, {"isolation.level": "read_committed"}))
    try:
        ranges = plan(consumer, topics, span)
        if on_plan is not None:
            on_plan(ranges)
        todo = {(r.topic, r.partition): r for r in ranges if r.records}
        if not todo:
            return
        consumer.assign([TopicPartition(r.topic, r.partition, r.start) for r in todo.values()])
        de = plain_deserializer(settings)
        contexts = {t: SerializationContext(t, MessageField.VALUE) for t in topics}
        while todo:
            for msg in consumer.consume(1000, timeout=0.2):  # returns when full or after the timeout
                if msg.error():
                    raise KafkaException(msg.error())
                key = (msg.topic(), msg.partition())
                r = todo.get(key)
                if r is None or msg.offset() >= r.end:
                    continue
                record_ts = msg.timestamp()[1] / 1000.0
                if not span.contains(record_ts):
                    continue
                try:
                    value = de(msg.value(), contexts[msg.topic()])
                except Exception as exc:  # noqa: BLE001 - an undecodable record is data, counted by the caller
                    log.debug("undecodable %s[%d]@%d: %s", msg.topic(), msg.partition(), msg.offset(), exc)
                    value = None
                raw_key = msg.key()
                rec = Record(msg.topic(), msg.partition(), msg.offset(), record_ts,
                             raw_key.decode("utf-8", "replace") if raw_key is not None else None, value)
                if on_record is not None:
                    on_record(rec)
                yield rec
            # done with a partition once its position passed the end (transaction markers have
            # offsets but no records, so the last offset may never arrive as a message)
            for tp in consumer.position([TopicPartition(t, p) for (t, p) in todo]):
                if tp.offset >= todo[(tp.topic, tp.partition)].end:
                    del todo[(tp.topic, tp.partition)]
    finally:
        consumer.close()

