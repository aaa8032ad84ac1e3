"""Avro side of the contract: the ``.avsc`` files, struct <-> Avro dict conversion,
and Confluent-wire-format serde built on confluent-kafka's Avro serializers.

The ``.avsc`` files in ``schemas/avro`` are the one source of truth; named types
(``kvbus.BlockHash``, the event records) are defined once and resolved by
fastavro when a top-level schema is loaded. What is registered in the registry
is the fully expanded top-level schema, under TopicNameStrategy (``<topic>-value``).
"""
from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable

import msgspec
from fastavro.schema import load_schema

from kvbus.schemas.events import (
    AllBlocksCleared,
    BlockEvent,
    BlockEvents,
    BlockRemoved,
    BlockStored,
    DeadLetter,
    Event,
    EventBatch,
    Incomplete,
    PositionedEvent,
    Reset,
    ViewSnapshot,
)

SCHEMA_DIR = Path(__file__).parent / "avro"

#: Top-level record schemas, one per topic family.
RECORDS = ("EventBatch", "BlockEvent", "BlockEvents", "Incomplete", "DeadLetter", "ViewSnapshot")

_EVENT_BY_NAME: dict[str, type] = {
    "kvbus.BlockStored": BlockStored,
    "kvbus.BlockRemoved": BlockRemoved,
    "kvbus.AllBlocksCleared": AllBlocksCleared,
    "kvbus.Reset": Reset,
}
_NAME_BY_EVENT = {cls: name for name, cls in _EVENT_BY_NAME.items()}


@lru_cache(maxsize=None)
def parsed_schema(record: str) -> dict:
    """The fastavro-parsed schema of ``kvbus.<record>`` with named types resolved."""
    return load_schema(str(SCHEMA_DIR / f"kvbus.{record}.avsc"))


@lru_cache(maxsize=None)
def schema_str(record: str) -> str:
    """The expanded JSON schema of ``kvbus.<record>``, as registered in the registry."""
    return json.dumps(_strip_fastavro_keys(parsed_schema(record)))


def _strip_fastavro_keys(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: _strip_fastavro_keys(v) for k, v in node.items() if not k.startswith("__")}
    if isinstance(node, list):
        return [_strip_fastavro_keys(v) for v in node]
    return node


# -- struct <-> Avro dict ---------------------------------------------------

def event_to_avro(event: Event) -> dict:
    """An event as a fastavro dict; ``-type`` names its union branch."""
    d = msgspec.structs.asdict(event)
    d["-type"] = _NAME_BY_EVENT[type(event)]
    return d


def event_from_avro(value: Any) -> Event:
    """An event from a fastavro union value: ``(name, dict)`` (return_record_name) or a bare dict."""
    if isinstance(value, tuple):
        name, fields = value
        # return_record_name also wraps named non-record union branches
        # (parent_block_hash: ["null", "kvbus.BlockHash"]) as (name, value): unwrap them
        fields = {k: v[1] if isinstance(v, tuple) else v for k, v in fields.items()}
        return _EVENT_BY_NAME[name](**fields)
    if isinstance(value, dict):  # read without return_record_name: tell by fields
        if "reason" in value:
            return Reset(**value)
        if "token_ids" in value:
            return BlockStored(**value)
        if "block_hashes" in value:
            return BlockRemoved(**value)
        return AllBlocksCleared()
    raise TypeError(f"not an Avro event value: {value!r}")


def batch_to_avro(batch: EventBatch, ctx: Any = None) -> dict:
    """EventBatch -> Avro dict (usable as an AvroSerializer ``to_dict``)."""
    d = msgspec.structs.asdict(batch)
    d["events"] = [event_to_avro(e) for e in batch.events]
    return d


def batch_from_avro(d: dict, ctx: Any = None) -> EventBatch:
    """Avro dict -> EventBatch (usable as an AvroDeserializer ``from_dict``)."""
    d = dict(d)
    d["events"] = [event_from_avro(e) for e in d["events"]]
    return EventBatch(**d)


def _with_event_to_avro(obj: Any, ctx: Any = None) -> dict:
    d = msgspec.structs.asdict(obj)
    d["event"] = event_to_avro(obj.event)
    return d


def _with_event_from_avro(cls: type) -> Callable[[dict, Any], Any]:
    def convert(d: dict, ctx: Any = None) -> Any:
        d = dict(d)
        d["event"] = event_from_avro(d["event"])
        return cls(**d)

    return convert


block_event_to_avro = _with_event_to_avro
"""BlockEvent -> Avro dict."""
block_event_from_avro = _with_event_from_avro(BlockEvent)
"""Avro dict -> BlockEvent."""


def block_events_to_avro(obj: BlockEvents, ctx: Any = None) -> dict:
    """BlockEvents -> Avro dict."""
    d = msgspec.structs.asdict(obj)
    d["events"] = [{"index": p.index, "event": event_to_avro(p.event)} for p in obj.events]
    return d


def block_events_from_avro(d: dict, ctx: Any = None) -> BlockEvents:
    """Avro dict -> BlockEvents."""
    d = dict(d)
    d["events"] = [PositionedEvent(index=p["index"], event=event_from_avro(p["event"])) for p in d["events"]]
    return BlockEvents(**d)


incomplete_to_avro = _with_event_to_avro
"""Incomplete -> Avro dict."""
incomplete_from_avro = _with_event_from_avro(Incomplete)
"""Avro dict -> Incomplete."""


def dead_letter_to_avro(obj: DeadLetter, ctx: Any = None) -> dict:
    """DeadLetter -> Avro dict."""
    return msgspec.structs.asdict(obj)


def dead_letter_from_avro(d: dict, ctx: Any = None) -> DeadLetter:
    """Avro dict -> DeadLetter."""
    return DeadLetter(**d)


def view_snapshot_to_avro(obj: ViewSnapshot, ctx: Any = None) -> dict:
    """ViewSnapshot -> Avro dict (nested records included)."""
    return msgspec.to_builtins(obj, builtin_types=(bytes,))


def view_snapshot_from_avro(d: dict, ctx: Any = None) -> ViewSnapshot:
    """Avro dict -> ViewSnapshot."""
    return msgspec.convert(d, ViewSnapshot)


TO_AVRO: dict[str, Callable[[Any, Any], dict]] = {
    "EventBatch": batch_to_avro,
    "BlockEvent": block_event_to_avro,
    "BlockEvents": block_events_to_avro,
    "Incomplete": incomplete_to_avro,
    "DeadLetter": dead_letter_to_avro,
    "ViewSnapshot": view_snapshot_to_avro,
}
FROM_AVRO: dict[str, Callable[[dict, Any], Any]] = {
    "EventBatch": batch_from_avro,
    "BlockEvent": block_event_from_avro,
    "BlockEvents": block_events_from_avro,
    "Incomplete": incomplete_from_avro,
    "DeadLetter": dead_letter_from_avro,
    "ViewSnapshot": view_snapshot_from_avro,
}
