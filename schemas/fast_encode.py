"""Hand-written Avro encoders of kvbus's records: the exact bytes fastavro (and so
``schemas.serde.RecordSerde.dumps``) writes, without the Confluent header, over ten times faster.

confluent-kafka's AvroSerializer spends ~20-60 µs per record resolving the many
``["null", X]`` unions of the events; these functions write the binary encoding directly
in the field order of :data:`schemas.avro_layout.LAYOUT` (checked against the ``.avsc``
files at import). tests/test_fast_codec.py proves byte equality on generated records.
:class:`schemas.fast_codec.FastSerde` adds the header and the registry's schema id.

An event may also be given pre-encoded: any object with an ``avro`` attribute holding the
event-union branch index followed by the record body (e.g. spliced out of a raw batch by
:mod:`schemas.event_scan`) is written as those bytes.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

from schemas import avro_layout  # noqa: F401  (checks the layout at import)
from schemas.events import (AllBlocksCleared, BlockEvent, BlockRemoved, BlockStored, DeadLetter, EventBatch,
                            Incomplete, Reset)
from schemas.wire import (
    DOUBLE,
    EPOCH,
    LONG,
    NULL,
    ONE,
    STR,
    bytes_list,
    fixed8s,
    longs,
    opt_bytes,
    opt_bytes_list,
    opt_fixed8,
    opt_long,
    opt_longss,
    opt_str,
    str_once,
)

B_STORED, B_REMOVED, B_CLEARED, B_RESET = b"\x00", b"\x02", b"\x04", b"\x06"
"""Branch indexes of the event union (kvbus.BlockStored, BlockRemoved, AllBlocksCleared, Reset)."""

_STORED_TAIL: dict[tuple, bytes] = {}
_REMOVED_TAIL: dict[tuple, bytes] = {}


def stored_tail(group_idx: Optional[int], kind: Optional[str]) -> bytes:
    """BlockStored fields lora_name..parent_block_digest when only group_idx and
    kv_cache_spec_kind may be set (vLLM's common case; cached)."""
    key = (group_idx, kind)
    tail = _STORED_TAIL.get(key)
    if tail is None:
        tail = NULL + NULL + opt_long(group_idx) + opt_str(kind) + NULL * 9
        if len(_STORED_TAIL) < 1024:
            _STORED_TAIL[key] = tail
    return tail


def stored(e: BlockStored) -> bytes:
    """Event-union encoding of a BlockStored (branch index + record)."""
    tokens = e.token_ids
    p = e.parent_block_hash
    m = e.medium
    head = (
        B_STORED,
        fixed8s(e.block_hashes),
        NULL if p is None else opt_fixed8(p),
        longs(tokens, len(tokens)),
        LONG[e.block_size],
        NULL if e.lora_id is None else ONE + LONG[e.lora_id],
        NULL if m is None else ONE + STR[m],
    )
    if (e.lora_name is None and e.extra_keys is None and e.kv_cache_spec_sliding_window is None
            and e.locality is None and e.ownership is None and e.session_id is None
            and e.lookahead_token_ids is None and e.cache_salt is None and e.token_id_pairs is None
            and e.block_digests is None and e.parent_block_digest is None):
        return b"".join((*head, stored_tail(e.group_idx, e.kv_cache_spec_kind)))
    return b"".join((
        *head,
        opt_str(e.lora_name),
        opt_bytes(e.extra_keys),
        opt_long(e.group_idx),
        opt_str(e.kv_cache_spec_kind),
        opt_long(e.kv_cache_spec_sliding_window),
        opt_str(e.locality),
        opt_str(e.ownership),
        opt_str(e.session_id),
        opt_longss(e.lookahead_token_ids),
        opt_str(e.cache_salt),
        opt_longss(e.token_id_pairs),
        opt_bytes_list(e.block_digests),
        opt_bytes(e.parent_block_digest),
    ))


def removed(e: BlockRemoved) -> bytes:
    """Event-union encoding of a BlockRemoved."""
    if e.block_digests is None:
        key = (e.medium, e.group_idx, e.locality, e.ownership)
        tail = _REMOVED_TAIL.get(key)
        if tail is None:
            tail = opt_str(e.medium) + opt_long(e.group_idx) + opt_str(e.locality) + opt_str(e.ownership) + NULL
            if len(_REMOVED_TAIL) < 1024:
                _REMOVED_TAIL[key] = tail
        return B_REMOVED + fixed8s(e.block_hashes) + tail
    return b"".join((B_REMOVED, fixed8s(e.block_hashes), opt_str(e.medium), opt_long(e.group_idx),
                     opt_str(e.locality), opt_str(e.ownership), opt_bytes_list(e.block_digests)))


def reset(e: Reset) -> bytes:
    """Event-union encoding of a Reset."""
    return B_RESET + STR[e.reason] + opt_long(e.missing_from) + opt_long(e.missing_to)


def _cleared(e: AllBlocksCleared) -> bytes:
    return B_CLEARED


_EVENT_WRITERS: dict[type, Callable[[Any], bytes]] = {
    BlockStored: stored,
    BlockRemoved: removed,
    AllBlocksCleared: _cleared,
    Reset: reset,
}


def event(e: Any) -> bytes:
    """Event-union encoding (branch index + record) of an event struct, or the ``avro``
    bytes of a pre-encoded event; TypeError for anything else."""
    write = _EVENT_WRITERS.get(type(e))
    if write is not None:
        return write(e)
    avro = getattr(e, "avro", None)
    if type(avro) is bytes:
        return avro
    raise TypeError(f"not a kvbus event: {type(e).__name__}")


def events(evs: list) -> bytes:
    """The ``events`` array of an EventBatch."""
    if not evs:
        return NULL
    return LONG[len(evs)] + b"".join(map(event, evs)) + NULL


def event_array(encoded: Sequence[bytes]) -> bytes:
    """The ``events`` array of already encoded events (each as :func:`event` writes it)."""
    if not encoded:
        return NULL
    return LONG[len(encoded)] + b"".join(encoded) + NULL


def batch_head(replica: str, dp_rank: int, worker_rank: int, workers: int, engine: str) -> bytes:
    """EventBatch fields replica..engine (constant for a publisher's stream: cache it)."""
    return STR[replica] + LONG[dp_rank] + LONG[worker_rank] + LONG[workers] + STR[engine]


def batch_from_head(head: bytes, epoch: int, seq: int, ts: float, topic: str, events_avro: bytes,
                    first_index: int = 0) -> bytes:
    """``head`` (:func:`batch_head`, maybe behind a wire header) followed by the remaining
    EventBatch fields; ``events_avro`` is the encoded events array (:func:`events`)."""
    return b"".join((head, EPOCH[epoch], LONG[seq], DOUBLE(ts), STR[topic], events_avro, LONG[first_index]))


def batch(b: EventBatch) -> bytes:
    """Avro body of an EventBatch."""
    return b"".join((
        STR[b.replica], LONG[b.dp_rank], LONG[b.worker_rank], LONG[b.workers], STR[b.engine],
        EPOCH[b.epoch], LONG[b.seq], DOUBLE(b.ts), STR[b.topic], events(b.events), LONG[b.first_index],
    ))


def block_event(v: BlockEvent) -> bytes:
    """Avro body of a BlockEvent."""
    return b"".join((
        STR[v.replica], LONG[v.dp_rank], EPOCH[v.epoch], LONG[v.seq], LONG[v.index], DOUBLE(v.ts), event(v.event),
    ))


def incomplete(v: Incomplete) -> bytes:
    """Avro body of an Incomplete."""
    return b"".join((
        STR[v.replica], LONG[v.dp_rank], EPOCH[v.epoch], LONG[v.seq], LONG[v.index], LONG[v.workers],
        longs(v.reported), longs(v.missing), event(v.event),
    ))


def dead_letter(v: DeadLetter) -> bytes:
    """Avro body of a DeadLetter."""
    return b"".join((
        STR[v.stage], str_once(v.source), str_once(v.reason), bytes_list(v.payload), DOUBLE(v.ts),
    ))


BODY_WRITERS: dict[str, Callable[[Any], bytes]] = {
    "EventBatch": batch,
    "BlockEvent": block_event,
    "Incomplete": incomplete,
    "DeadLetter": dead_letter,
}
"""Record kind -> writer of its Avro body."""
