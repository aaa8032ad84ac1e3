"""An event carried as the Avro bytes it arrived in (the streams stage's fast path)."""
from __future__ import annotations

from typing import Optional

import msgspec


class RawEvent(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """A ``BlockStored`` or ``BlockRemoved`` kept as its Avro encoding (union branch index +
    record, exactly as in the raw EventBatch and as re-emitted in BlockEvent/Incomplete).
    Made by :func:`kvbus.schemas.codec.batch_scanner` (``raw(avro, ownership, without_lora_name)``);
    :func:`kvbus.schemas.codec.encode_event` writes it as its ``avro`` bytes.

    :func:`kvbus.streams.aggregation.identity` of a RawEvent equals that of the decoded struct.
    Not tracked by the cyclic garbage collector (``gc=False``): it holds only bytes and str.
    """

    avro: bytes
    """Union branch index (0 BlockStored, 1 BlockRemoved) followed by the record body."""
    ownership: Optional[str] = None
    """The event's ``ownership`` field (None: the framework's own cache)."""
    canon: Optional[bytes] = None
    """``avro`` with ``lora_name`` set to null (the identity's input) when it was not null."""
