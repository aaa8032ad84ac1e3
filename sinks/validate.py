"""Checks a decoded BlockEvent (or BlockEvents record) must pass before the sink applies it.

A record failing them cannot be right (it names its holder inconsistently, or sits on a topic its
tier does not belong to, or has an impossible position): it goes to the dead-letter topic.
"""
from __future__ import annotations

from functools import lru_cache

from kvbus.schemas.events import BlockEvent, BlockEvents, BlockRemoved, BlockStored, holder_key
from kvbus.schemas.topics import Topics


@lru_cache(maxsize=1 << 16)
def _key_of(replica: str, dp_rank: int) -> bytes:
    """The Kafka key bytes of a holder's records (cached: checked for every record)."""
    return holder_key(replica, dp_rank).encode()


def _holder_problem(key: bytes | None, replica: str, dp_rank: int) -> str | None:
    if not replica:
        return "empty replica id"
    if dp_rank < 0:
        return f"negative dp_rank {dp_rank}"
    if key is not None and key != _key_of(replica, dp_rank):
        return f"record key {key!r} does not name the event's holder {holder_key(replica, dp_rank)!r}"
    return None


def packed_problem(key: bytes | None, value: BlockEvents) -> str | None:
    """Why a BlockEvents record with Kafka key ``key`` cannot be applied at all, or None (its events are
    checked one by one, :func:`event_problem`)."""
    if not isinstance(value, BlockEvents):
        return f"not a BlockEvents: {type(value).__name__}"
    return _holder_problem(key, value.replica, value.dp_rank)


def problem(topic: str, key: bytes | None, ev: BlockEvent, topics: Topics) -> str | None:
    """Why ``ev`` read from ``topic`` (of either block layout) with Kafka key ``key`` cannot be applied,
    or None if it can."""
    if not isinstance(ev, BlockEvent):
        return f"not a BlockEvent: {type(ev).__name__}"
    return _holder_problem(key, ev.replica, ev.dp_rank) or event_problem(topic, ev, topics)


def event_problem(topic: str, ev: BlockEvent, topics: Topics) -> str | None:
    """Why ``ev`` read from ``topic`` cannot be applied, its holder aside (checked once per record:
    :func:`problem`, :func:`packed_problem`), or None if it can."""
    if ev.epoch < 0 or ev.seq < -1 or ev.index < 0:
        return f"impossible position {ev.position}"
    e = ev.event
    # A Reset sits at any position: a bridge's opens its new epoch at (epoch, -1, 0); the streams
    # stage forwards one of another TP worker right after rank 0's batch, (epoch0, seq0, 2^31-1).
    if isinstance(e, (BlockStored, BlockRemoved)):
        hashes = e.block_hashes
        sizes = set(map(len, hashes))  # in C: a Python loop over the hashes was 14% of the sink's CPU
        if sizes - {8}:
            return f"block hash of {min(sizes - {8})} bytes (canonical hashes have 8)"
        expected = topics.for_ownership(e.ownership, packed=topics.is_packed(topic))
        if topic != expected:
            return f"{type(e).__name__} of ownership {e.ownership!r} on topic {topic!r} (belongs on {expected!r})"
    return None
