"""Block layout 2 (:mod:`kvbus.schemas.topics`, "Block layouts"): the worker's consolidated events,
one Kafka record per engine batch, holder and tier instead of one per event.

The aggregation (:mod:`kvbus.streams.aggregation`) says which events are real and where they go, as a
:class:`BlockEvent` per event on its layout 1 topic; :func:`pack` lays them out as records. What a record
costs (a ``produce()``, a delivery report, the broker's per-record work, the sink's per-record decode
and checks) is then paid once per engine batch: ~20 events on vLLM's usual steps.
"""
from __future__ import annotations

from kvbus.schemas.events import BlockEvent, BlockEvents, PositionedEvent
from kvbus.schemas.topics import Topics
from kvbus.streams.aggregation import Output


class Packer:
    """Packs a processing batch's outputs (:meth:`pack`) for one deployment's topics."""

    def __init__(self, topics: Topics):
        self.topics = topics
        self._packed: dict[str, str] = {}
        """layout 1 topic -> its layout 2 topic (:meth:`Topics.packed_of`), remembered."""

    def pack(self, out: list[Output]) -> list[Output]:
        """``out`` with each run of BlockEvents of one holder and topic that share their batch (epoch,
        seq, ts, model) as one :class:`BlockEvents` output on the topic's layout 2 topic, in the place of
        its first event; other outputs (Incomplete) as they are. Each holder's events keep their order
        on every topic, which is all the sinks need (records of one key and partition stay in order)."""
        packed: list[Output] = []
        current: dict[tuple[str, bytes], tuple[tuple, list[PositionedEvent]]] = {}
        """(topic, key) -> (the shared fields of its open record, that record's events)."""
        topic_of = self._packed
        for o in out:
            v = o.value
            if type(v) is not BlockEvent:
                packed.append(o)
                continue
            head = (v.epoch, v.seq, v.ts, v.model, v.replica, v.dp_rank, o.partition)
            k = (o.topic, o.key)
            cur = current.get(k)
            if cur is not None and cur[0] == head:
                cur[1].append(PositionedEvent(index=v.index, event=v.event))
                continue
            entries = [PositionedEvent(index=v.index, event=v.event)]
            current[k] = (head, entries)
            topic = topic_of.get(o.topic)
            if topic is None:
                topic = topic_of[o.topic] = self.topics.packed_of(o.topic)
            value = BlockEvents(replica=v.replica, epoch=v.epoch, seq=v.seq, ts=v.ts, events=entries,
                                dp_rank=v.dp_rank, model=v.model)
            packed.append(Output(topic, o.key, o.partition, value, o.kind))
        return packed
