"""The order of a holder's events across the two block layouts (:mod:`kvbus.schemas.topics`, "Block
layouts"), while workers move from one layout to the other.

A tier's events of one holder form one position order (its *track*, :meth:`Topics.track`) whichever
layout carries them, and a track must be applied in order. Within one layout Kafka keeps a partition's
records in order; across the two it does not: when the workers switch from layout 1 to layout 2 (an
upgrade) or back, a holder's last layout 1 records may still be unread when its first layout 2 records
arrive. Both topics of a track are co-partitioned (the holder's key, the raw partition) and given to the
same sink (librdkafka's range assignor gives equal partition numbers of equal-sized topics to one member).

The rule, per (track, partition): records of the layout last applied there pass. Records of the other
layout pass only once the partition of the layout applied before is read to its end (its high watermark,
asked of the broker: a switch is rare, and the cached watermark may predate the switch); until then they
are held, read again later (the sink seeks back to them). Where this sink has applied nothing yet (it
started, or was given the partition), layout 1 counts as applied before: the upgrade goes from layout 1
to layout 2. The old layout's records that arrive after that are duplicates of what the new layout
carries from the same raw offsets (a worker re-produces what it did not commit), and the view's positions
skip them. When a batch holds both layouts of a partition and the gate lets both pass, their events are
applied in position order (:func:`in_position_order`). Going back to layout 1 is ordered the same way
while the sinks run; a sink started meanwhile takes layout 1 first, so let the sinks read the packed
topics to their end before starting workers of layout 1 (docs/operating.md).
"""
from __future__ import annotations

import logging
from typing import Any, Callable

from confluent_kafka import TopicPartition

from kvbus.schemas.events import BlockEvent
from kvbus.schemas.topics import Topics

log = logging.getLogger("kvbus.sinks")

WATERMARK_TIMEOUT = 5.0
"""Seconds the broker has to answer a high-watermark query at a layout switch (no answer: the records wait)."""

Partition = tuple[str, int]
"""(topic, partition)."""


class LayoutGate:
    """Which records of a polled batch wait for the other layout (:meth:`held`)."""

    def __init__(self, consumer: Any, topics: Topics, applied: Callable[[], dict[Partition, int]]):
        self.consumer = consumer
        self.topics = topics
        self.applied = applied
        """(topic, partition) -> the offset after the last record the view holds (the sink's positions)."""
        self._last: dict[tuple[str, int], bool] = {}
        """(track, partition) -> whether the layout last applied there is layout 2 (packed)."""
        self._track: dict[str, str] = {}
        self._holding: set[Partition] = set()
        """What the last :meth:`held` held (logged when it starts waiting)."""
        self.switching = False
        """Whether the last :meth:`held` checked a partition (a layout other than the last one applied came)."""

    def forget(self) -> None:
        """After a reassignment or a resync: every partition's next record is checked again."""
        self._last.clear()

    def held(self, msgs: list) -> set[Partition]:
        """The (topic, partition)s of ``msgs`` whose records must wait: see the module doc."""
        firsts: dict[Partition, Any] = {}
        ends: dict[Partition, int] = {}
        for m in msgs:
            if m.error() is None:
                tp = (m.topic(), m.partition())
                firsts.setdefault(tp, m)
                ends[tp] = m.offset() + 1
        checks = []
        for (topic, p) in firsts:
            packed = self.topics.is_packed(topic)
            if self._last.get((self.track_of(topic), p), False) != packed:
                checks.append((topic, p))
        self.switching = bool(checks)
        if not checks:
            return set()
        assigned = {(tp.topic, tp.partition) for tp in self.consumer.assignment()}
        held: set[Partition] = set()
        for topic, p in checks:
            other = self._counterpart(topic)
            if (other, p) in assigned and self._behind(other, p, ends):
                held.add((topic, p))
            else:
                self._last[(self.track_of(topic), p)] = self.topics.is_packed(topic)
        for topic, p in held - self._holding:
            log.info("%s[%d]: held until %s[%d] is read to its end (the workers switched block layouts)",
                     topic, p, self._counterpart(topic), p)
        self._holding = held
        return held

    def both_layouts(self, msgs: list) -> bool:
        """Whether ``msgs`` hold records of both layouts of one (track, partition)."""
        seen = {(m.topic(), m.partition()) for m in msgs if m.error() is None}
        return any(self.topics.is_packed(t) and (self._counterpart(t), p) in seen for t, p in seen)

    def _behind(self, topic: str, partition: int, ends: dict[Partition, int]) -> bool:
        """Whether (topic, partition) has records the view does not hold and this batch does not bring."""
        try:
            low, high = self.consumer.get_watermark_offsets(TopicPartition(topic, partition),
                                                            timeout=WATERMARK_TIMEOUT, cached=False)
        except Exception as e:  # KafkaException: the broker did not answer; ask again with the next batch
            log.warning("%s[%d]: high watermark not known (%s): records of the other layout wait", topic, partition, e)
            return True
        done = max(self.applied().get((topic, partition), low), ends.get((topic, partition), low))
        return high > done

    def track_of(self, topic: str) -> str:
        """The track of a block topic (:meth:`Topics.track`), remembered."""
        track = self._track.get(topic)
        if track is None:
            track = self._track[topic] = self.topics.track(topic)
        return track

    def _counterpart(self, topic: str) -> str:
        """The topic of the same track in the other layout."""
        return self.track_of(topic) if self.topics.is_packed(topic) else self.topics.packed_of(topic)


def in_position_order(records: list[tuple[str, BlockEvent]], sources: list) -> tuple[list, list]:
    """``records`` ((track, event)) and their ``sources`` sorted alike by track, holder and position
    (stable): for a batch that holds both layouts of a partition."""
    order = sorted(range(len(records)), key=lambda i: (records[i][0], records[i][1].replica, records[i][1].dp_rank,
                                                      records[i][1].position))
    return [records[i] for i in order], [sources[i] for i in order]
