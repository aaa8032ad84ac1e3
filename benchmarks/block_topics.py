"""The block topics a benchmark's worker writes and how to read their records back (schemas/topics.py,
"Block layouts"): layout 2, a ``BlockEvents`` record per engine batch, holder and tier on
``<blocks>-packed*`` (the worker's default), or layout 1, a ``BlockEvent`` record per event on
``<blocks>*`` (a worker run with ``KVBUS_STREAMS_BLOCK_LAYOUT=events``).

A library of the benchmarks (pipeline.py, streams.py, faults.py), not a command; the caller puts the
repository on ``sys.path`` first.
"""
from __future__ import annotations

from typing import Mapping, Optional, Union

from kvbus.schemas.events import BlockEvent, BlockEvents
from kvbus.schemas.topics import Topics
from kvbus.streams.options import StreamsOptions

BlockRecord = Union[BlockEvent, BlockEvents]
"""A decoded record of a block topic: layout 1 or layout 2."""


def writes_packed(environ: Optional[Mapping[str, str]] = None) -> bool:
    """Whether a worker run with ``environ`` (default this process's environment) writes block layout 2
    (``KVBUS_STREAMS_BLOCK_LAYOUT``, :class:`kvbus.streams.options.StreamsOptions`)."""
    return StreamsOptions.from_env(environ).block_layout == "packed"


def written_topic(topics: Topics, ownership: Optional[str] = None,
                  environ: Optional[Mapping[str, str]] = None) -> str:
    """The block topic a worker run with ``environ`` writes the events of tier ``ownership`` to (None:
    the framework-owned topic, the one every run has)."""
    return topics.for_ownership(ownership, packed=writes_packed(environ))


def record_schema(topics: Topics, topic: str) -> str:
    """The value schema of the block topic ``topic``, as :class:`kvbus.schemas.codec.FastSerde` and
    :class:`kvbus.schemas.serde.RecordSerde` name it: ``BlockEvents`` (layout 2) or ``BlockEvent``."""
    return "BlockEvents" if topics.is_packed(topic) else "BlockEvent"


def block_events(record: BlockRecord) -> list[BlockEvent]:
    """The events of a decoded block record, one :class:`BlockEvent` each, in order."""
    return record.unpacked() if isinstance(record, BlockEvents) else [record]
