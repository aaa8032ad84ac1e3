"""Bridge restart: find the last (epoch, seq) this bridge produced, from Kafka itself.

A bridge keeps no local state. On start it reads the tail of the raw topic's
partition that holds its key (``<replica>#<dp_rank>``; the partition is computed
with Kafka's murmur2 partitioner, the one the producer uses) and takes the last
record written for its (replica, dp_rank, worker_rank). It then resumes that epoch
and asks the engine to replay from ``seq + 1``, so nothing the engine still
buffers is lost (see :mod:`kvbus.producers.sequencer`).

Records of other workers and other replicas share the partition; the scan walks
back from the end in growing windows until it finds one of ours or gives up
after ``max_scan`` records (then the stream starts fresh, in a new epoch).

Split batches (:mod:`kvbus.producers.split`): the parts of one engine batch share its seq, so
the last record may be a part (``first_index`` and its event count say which events it
holds). The bridge's start-up replay begins at that seq to check the engine did not
restart; the check compares the part with its slice of the engine's copy, and when the
copy has events after the slice (the bridge stopped between two parts) the bridge
produces them first, as further parts of the same (epoch, seq) with their own
``first_index``: nothing lost, nothing twice. Without the engine's copy of that batch
(no replay endpoint, or its replay buffer no longer holds it) the bridge cannot tell a
last part from a whole batch and continues after it; the events of the unfinished
batch that never reached Kafka are then lost, like everything the engine published
while the bridge was down when it cannot replay.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from confluent_kafka import Consumer, KafkaError, TopicPartition

from kvbus.producers.sequencer import REASON_BRIDGE_START, REASON_ENGINE_RESTART, REASON_GAP
from kvbus.runtime.backoff import Backoff, sleep
from kvbus.runtime.kafka_clients import reader_conf
from kvbus.schemas.events import EventBatch, Reset, holder_key
from kvbus.schemas.topics import RECOVERY_GROUP_PREFIX

log = logging.getLogger("kvbus.producers.recovery")

DEFAULT_MAX_SCAN = 500_000
"""Most records read back from the partition tail before giving up."""


def murmur2(data: bytes) -> int:
    """Kafka's murmur2 (``org.apache.kafka.common.utils.Utils.murmur2``) as a signed 32-bit int."""
    m = 0x5BD1E995
    length = len(data)
    h = (0x9747B28C ^ length) & 0xFFFFFFFF
    n4 = length // 4
    for i in range(n4):
        k = int.from_bytes(data[4 * i:4 * i + 4], "little")
        k = (k * m) & 0xFFFFFFFF
        k ^= k >> 24
        k = (k * m) & 0xFFFFFFFF
        h = (h * m) & 0xFFFFFFFF
        h ^= k
    rest = length % 4
    tail = 4 * n4
    if rest == 3:
        h ^= data[tail + 2] << 16
    if rest >= 2:
        h ^= data[tail + 1] << 8
    if rest >= 1:
        h ^= data[tail]
        h = (h * m) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * m) & 0xFFFFFFFF
    h ^= h >> 15
    return h - (1 << 32) if h & 0x80000000 else h


def partition_for(key: bytes, partitions: int) -> int:
    """The partition Kafka's default partitioner (librdkafka ``murmur2_random``) picks for ``key``."""
    return (murmur2(key) & 0x7FFFFFFF) % partitions


@dataclass(frozen=True)
class Resume:
    """Where a restarted bridge continues."""

    epoch: int
    """Epoch of the last record this bridge produced."""
    last_seq: int | None
    """Last engine seq produced in that epoch; -1 when the epoch was just opened by an
    engine-restart marker (next is seq 0); None when unknown (bridge-start marker)."""
    record: EventBatch
    """The last record itself (maybe one part of a split batch: see ``first_index``)."""
    partition: int
    offset: int


def resume_point(batch: EventBatch) -> int | None:
    """``last_seq`` to resume from after ``batch`` (see :class:`Resume`)."""
    if batch.seq >= 0:
        return batch.seq
    marker = next((e for e in batch.events if isinstance(e, Reset)), None)
    if marker is None:
        return None
    if marker.reason == REASON_GAP and marker.missing_to is not None:
        return marker.missing_to
    if marker.reason == REASON_ENGINE_RESTART:
        return -1
    if marker.reason == REASON_BRIDGE_START:
        return None
    return None


def find_last_produced(
    kafka: str | Mapping[str, Any],
    topic: str,
    replica: str,
    dp_rank: int,
    worker_rank: int,
    loads: Callable[[bytes], EventBatch],
    *,
    max_scan: int = DEFAULT_MAX_SCAN,
    timeout: float = 10.0,
) -> Resume | None:
    """The last record this (replica, dp_rank, worker_rank) wrote to ``topic``; None if there is
    none within ``max_scan`` records of the partition's end (or the topic does not exist).

    ``kafka``: a bootstrap string or ``Settings.kafka()`` (servers and security).
    ``loads``: value bytes -> EventBatch (e.g. ``lambda b: serde.loads(b, topic)``).
    Raises ``confluent_kafka.KafkaException`` if Kafka cannot be reached within ``timeout``.
    """
    key = holder_key(replica, dp_rank).encode()
    consumer = Consumer(reader_conf(kafka, RECOVERY_GROUP_PREFIX))
    try:
        md = consumer.list_topics(topic, timeout=timeout)
        tmd = md.topics.get(topic)
        if tmd is None or tmd.error is not None or not tmd.partitions:
            return None
        partition = partition_for(key, len(tmd.partitions))
        low, high = consumer.get_watermark_offsets(TopicPartition(topic, partition), timeout=timeout)
        end = high
        window = 1000
        scanned = 0
        while end > low and scanned < max_scan:
            start = max(low, end - window)
            found = _scan_window(consumer, topic, partition, start, end, key, replica, worker_rank, loads, timeout)
            scanned += end - start
            if found is not None:
                batch, offset = found
                log.info("recovered %s worker %d: epoch %d seq %d (events %d..%d) at %s[%d]@%d",
                         key.decode(), worker_rank, batch.epoch, batch.seq, batch.first_index,
                         batch.first_index + len(batch.events) - 1, topic, partition, offset)
                return Resume(batch.epoch, resume_point(batch), batch, partition, offset)
            end = start
            window *= 4
        return None
    finally:
        consumer.close()


def _scan_window(
    consumer: Consumer, topic: str, partition: int, start: int, end: int, key: bytes,
    replica: str, worker_rank: int, loads: Callable[[bytes], EventBatch], timeout: float,
) -> tuple[EventBatch, int] | None:
    """Read offsets [start, end) and return the last record of ours in it."""
    consumer.assign([TopicPartition(topic, partition, start)])
    candidates: list[tuple[int, bytes]] = []
    deadline = time.monotonic() + timeout
    next_offset = start
    while next_offset < end:
        msgs = consumer.consume(10_000, timeout=0.5)
        if not msgs:
            if time.monotonic() > deadline:
                raise TimeoutError(f"reading {topic}[{partition}] {start}..{end} timed out at {next_offset}")
            continue
        deadline = time.monotonic() + timeout
        for msg in msgs:
            err = msg.error()
            if err is not None:
                if err.code() == KafkaError._PARTITION_EOF:
                    continue
                raise RuntimeError(f"reading {topic}[{partition}]: {err}")
            off = msg.offset()
            next_offset = off + 1
            if off >= end:
                break
            if msg.key() == key and msg.value() is not None:
                candidates.append((off, msg.value()))
    for off, value in reversed(candidates):
        try:
            batch = loads(value)
        except Exception as exc:  # a record we cannot read is not ours to resume from
            log.warning("skipping unreadable record %s[%d]@%d: %s", topic, partition, off, exc)
            continue
        if batch.replica == replica and batch.worker_rank == worker_rank:
            return batch, off
    return None


def wait_and_recover(
    recover: Callable[[], Resume | None],
    stop: Callable[[], bool],
    backoff: Backoff | None = None,
) -> tuple[bool, Resume | None]:
    """Call ``recover`` until it answers (Kafka reachable) or ``stop()``, pausing as ``backoff`` says
    between tries (default: a :class:`Backoff`'s pauses); returns (answered, result)."""
    backoff = backoff or Backoff()
    while not stop():
        try:
            return True, recover()
        except Exception as exc:
            pause = backoff.next()
            log.warning("cannot read the raw topic to recover the last position yet (%s); retrying in %.1fs",
                        exc, pause)
            sleep(pause, stop)
    return False, None


__all__ = ["murmur2", "partition_for", "Resume", "find_last_produced", "resume_point", "wait_and_recover"]
