"""vLLM's KV-event wire formats (protocol doc §3, §4 field history, §7).

:data:`TABLE` is the release table: one row per release that changed the layout, saying what it
appended or switched. Adding a vLLM release is one row, e.g. a 0.35 that appends a field ``tier``
to BlockStored (a field kvbus knows: ``BlockStored.tier`` in :mod:`kvbus.schemas.events`, whose type and
default the decoder takes unless :data:`kvbus.producers.wire_structs.WIRE_TYPES` says otherwise)::

    row("vllm-0.35", stored=("tier",)),

The decoder (its map and array structs), the conversion the bridge and the publisher share
(:mod:`kvbus.producers.engines.convert`), ``kvbus.simulator.engine_wire`` (the fleet's encoder), the list of formats
and ``--engine auto`` detection all follow from it (tests/test_engines.py adds such rows to copies of the
table).
"""
from __future__ import annotations

from kvbus.producers.engines.base import Adapter, Release, row

TABLE = (
    # [ts, events]; Stored [tag, hashes, parent, tokens, block_size, lora_id]; Removed [tag, hashes];
    # the default ``builtin`` hash was Python's signed hash()
    row("vllm-0.9.0", stored=("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id"),
        removed=("block_hashes",)),
    row("vllm-0.9.2", dp_rank=True),  # + envelope dp_rank
    row("vllm-0.10.2", stored=("medium",), removed=("medium",), signed_hashes=False, bytes_hashes=True),
    row("vllm-0.14", stored=("lora_name",), lora_id_with_lora_name=True),
    row("vllm-0.17", stored=("extra_keys",)),
    row("vllm-0.20", stored=("group_idx",), removed=("group_idx",)),
    row("vllm-0.22", stored=("kv_cache_spec_kind", "kv_cache_spec_sliding_window")),
    row("vllm-0.24", maps=True),  # events become maps
    row("vllm-0.26", stored=("locality",), removed=("locality",), replay_topic=True),
    row("vllm-0.29", stored=("ownership",), removed=("ownership",)),
    row("vllm-0.30", stored=("session_id",)),
    row("vllm-0.33", stored=("lookahead_token_ids",)),
)
"""vLLM releases, oldest first: each row is the first release of a layout change."""

FIRST = Release("", "vllm", maps=False, dp_rank=False, stored=(), removed=(), stored_required=7,
                removed_required=2, signed_hashes=True, bytes_hashes=False, replay_topic=False)
"""What the first row starts from. Maps always carry the first 7 stored / 2 removed fields."""

ADAPTER = Adapter("vllm", "vllm", TABLE, FIRST, array_layout="vllm")
"""The vLLM adapter (arrays decoded with the fields of its array releases, <= 0.23)."""
