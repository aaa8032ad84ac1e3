"""Which engine family sent an event: the one vLLM-vs-SGLang rule, used by the decoder to pick the layout
of a tagged array (``decode_batch(engine="auto")``) and by :func:`detect_engine` to label a stream.

An event fits a family when some release in its table could have sent it (:meth:`Adapter.read`: shape,
value kinds, hash kinds, the release's promises), and its medium, if set, is not one that another family
alone publishes (:attr:`Adapter.own_mediums`).

For a BlockStored array the two array layouts agree up to ``medium`` (index 6); after it vLLM has
``lora_name, extra_keys, group_idx, ...`` and SGLang ``cache_salt, session_id, lora_name``. So, for example:
a string at index 8 or 9 is SGLang (vLLM's ``extra_keys`` is a list, ``group_idx`` an int); a list at 8,
an int at 9 or more than 10 elements is vLLM; a string at index 7 is SGLang's ``cache_salt`` when
``lora_id`` is None (vLLM sends ``lora_id`` with every ``lora_name``), when a hash is negative (vLLM's
array releases with a ``medium`` send unsigned hashes) or when the medium is SGLang's alone.
"""
from __future__ import annotations

from typing import Any

import msgspec

from kvbus.producers.engines.base import Adapter
from kvbus.producers.engines.catalog import ADAPTERS
from kvbus.schemas.events import normalize_medium

DEFAULT_ARRAY_LAYOUT: str = next(a.array_layout for a in ADAPTERS.values() if a.array_layout)
"""The array layout ("vllm") of an array that fits no family or more than one: where every family's
reading is the same event, or where no engine could have sent it."""

_OWNER: dict[str, str] = {m: a.label for a in ADAPTERS.values() for m in a.own_mediums}
"""Medium -> the label of the one family that publishes it."""


def senders(event: Any) -> tuple[Adapter, ...]:
    """The adapters whose releases could have sent ``event``, a plain msgpack-decoded map or tagged
    array (module doc): () when none could, every adapter for AllBlocksCleared."""
    out = []
    for adapter in ADAPTERS.values():
        values = adapter.read(event)
        if values is None:
            continue
        medium = normalize_medium(values.get("medium"))
        if medium in _OWNER and _OWNER[medium] != adapter.label:
            continue
        out.append(adapter)
    return tuple(out)


def array_layout(event: list) -> str:
    """The layout ``decode_batch(engine="auto")`` reads a tagged array with: that of the one family
    that could have sent it, else :data:`DEFAULT_ARRAY_LAYOUT`."""
    layouts = {a.array_layout for a in senders(event)}
    return layouts.pop() if len(layouts) == 1 and None not in layouts else DEFAULT_ARRAY_LAYOUT


_ANY = msgspec.msgpack.Decoder()


def detect_engine(payload: bytes) -> str | None:
    """The ``EventBatch.engine`` label of the stream a batch payload (ZMQ frame 2) comes from, from
    its first event only one engine label's releases could have sent (:func:`senders`):
    "vllm" or "sglang"; None when every event fits both (or the payload is unreadable)."""
    try:
        env = _ANY.decode(payload)
        events = env[1]
    except (msgspec.DecodeError, TypeError, IndexError, KeyError, RecursionError):
        return None
    if not isinstance(events, list):
        return None
    for ev in events:
        labels = {a.label for a in senders(ev)}
        if len(labels) == 1:
            return labels.pop()
    return None
