"""LMCache's connector events inside a vLLM stream (protocol doc §8): vLLM 0.33 maps carrying only
the first 7 BlockStored / 2 BlockRemoved fields, medium "cpu" written lower-case, chunk-sized blocks
(``len(token_ids)`` need not be ``block_size * len(block_hashes)``), unsigned or bytes hashes.
Its streams are labelled ``vllm``.
"""
from __future__ import annotations

from kvbus.producers.engines.base import Adapter, Release, row

TABLE = (
    row("lmcache-0.5.6", stored=("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                                 "medium", "lora_name"), removed=("block_hashes", "medium")),
)
"""LMCache releases, oldest first."""

FIRST = Release("", "lmcache", maps=True, dp_rank=True, stored=(), removed=(), stored_required=7,
                removed_required=2, signed_hashes=False, bytes_hashes=True, replay_topic=True,
                lower_stored_medium=True)
"""What the first row starts from."""

ADAPTER = Adapter("lmcache", "vllm", TABLE, FIRST)
"""The LMCache adapter (maps only: no array layout)."""
