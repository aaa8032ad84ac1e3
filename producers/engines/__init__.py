"""Engine adapters: one module per engine family (:mod:`.vllm`, :mod:`.sglang`, :mod:`.lmcache`), each
declaring its release table once; the registry mapping engine names to them (:mod:`.registry`); the one
conversion of engine events to kvbus structs (:mod:`.convert`, :data:`CONVERSION`); and the one rule
telling the families apart (:mod:`.families`).

Derived from the tables: :data:`FORMATS` (every wire-format id), the decoder's wire structs
(:mod:`kvbus.producers.wire_structs`: the map layout is the union of every family's fields, each array
layout its family's), the conversion the bridge and the publisher share, the fleet's encoder
(:mod:`kvbus.simulator.engine_wire`) and :func:`detect_engine` (``--engine auto`` labelling).
"""
from __future__ import annotations

from kvbus.producers.engines.base import Adapter, Release, row, union
from kvbus.producers.engines.catalog import ADAPTERS, FORMATS, RELEASES, SENT, new_adapter, release, resolve_format
from kvbus.producers.engines.convert import ENGINE_EVENTS, Conversion
from kvbus.producers.engines.families import DEFAULT_ARRAY_LAYOUT, array_layout, detect_engine, senders

__all__ = ["ADAPTERS", "CONVERSION", "DEFAULT_ARRAY_LAYOUT", "ENGINE_EVENTS", "FORMATS", "RELEASES", "SENT",
           "Adapter", "Conversion", "Release", "array_layout", "detect_engine", "new_adapter", "release",
           "resolve_format", "row", "senders", "to_kvbus_event", "union"]

CONVERSION = Conversion(SENT)
"""The conversion of every event the release tables describe, shared by the bridge's decoder and the
in-process publisher."""

to_kvbus_event = CONVERSION.event
"""An engine's event object (vLLM's, SGLang's, or any object with their class names and fields) as its
:mod:`kvbus.schemas.events` struct (:meth:`Conversion.event`)."""
