"""SGLang's KV-event wire formats (protocol doc §4, §7): tagged arrays up to 0.5.19, maps after,
signed int64 hashes throughout. :data:`TABLE` is the release table (one row per layout change).

SGLang arrays are decoded with every field SGLang ever sent (``[.., lora_id, medium, cache_salt,
session_id, lora_name]``): per the protocol doc its arrays stopped at ``medium``, the longer layout
is accepted defensively.
"""
from __future__ import annotations

from kvbus.producers.engines.base import Adapter, Release, row

TABLE = (
    row("sglang-0.5.10", stored=("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                                 "medium"), removed=("block_hashes", "medium")),  # tagged arrays
    row("sglang-0.5.20", stored=("cache_salt", "session_id"), maps=True),
    row("sglang-0.5.22", stored=("lora_name",)),
    row("sglang-0.5.23", replay_topic=True),  # replay replies carry the topic frame
)
"""SGLang releases, oldest first."""

FIRST = Release("", "sglang", maps=False, dp_rank=True, stored=(), removed=(), stored_required=5,
                removed_required=1, signed_hashes=True, bytes_hashes=False, replay_topic=False)
"""What the first row starts from. Maps always carry the first 5 stored / 1 removed fields."""

ADAPTER = Adapter("sglang", "sglang", TABLE, FIRST, array_layout="sglang", arrays_take_every_field=True,
                  own_mediums=("CPU_PINNED", "DISK", "EXTERNAL"))
"""The SGLang adapter. Its mediums ``CPU_PINNED``, ``DISK`` and ``EXTERNAL`` (``StorageMedium``) are
SGLang's alone (protocol doc §6, §7)."""
