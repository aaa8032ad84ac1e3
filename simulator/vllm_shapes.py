"""vLLM 0.33's event structs as its publisher defines them, for tests that publish as vLLM does
(the in-process publisher duck-types by class name, so each is renamed to vLLM's), and its batch
envelope; ``gc=False`` as vLLM declares them (a benchmark builds millions)."""
from __future__ import annotations

import msgspec


class VllmBlockStored(msgspec.Struct, tag="BlockStored", omit_defaults=True, gc=False):
    """vLLM 0.33's BlockStored."""

    block_hashes: list
    parent_block_hash: object
    token_ids: list
    block_size: int
    lora_id: object
    medium: object
    lora_name: object
    extra_keys: object = None
    group_idx: object = None
    kv_cache_spec_kind: object = None
    kv_cache_spec_sliding_window: object = None
    locality: object = None
    ownership: object = None
    session_id: object = None
    lookahead_token_ids: object = None


VllmBlockStored.__name__ = "BlockStored"


class VllmBlockRemoved(msgspec.Struct, tag="BlockRemoved", omit_defaults=True, gc=False):
    """vLLM 0.33's BlockRemoved."""

    block_hashes: list
    medium: object
    group_idx: object = None
    locality: object = None
    ownership: object = None


VllmBlockRemoved.__name__ = "BlockRemoved"


class VllmKVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """vLLM's KVEventBatch envelope (``[ts, events, data_parallel_rank]`` on the wire)."""

    ts: float
    events: list
    data_parallel_rank: object = None


VllmKVEventBatch.__name__ = "KVEventBatch"
