"""Hypothesis strategies for kvbus records (every field, any value the schemas allow)."""
from __future__ import annotations

from hypothesis import strategies as st

from kvbus.schemas.events import (
    AllBlocksCleared,
    BlockEvent,
    BlockRemoved,
    BlockStored,
    DeadLetter,
    EventBatch,
    Incomplete,
    Reset,
)

h8 = st.binary(min_size=8, max_size=8)
longs = st.integers(-(2**63), 2**63 - 1)
ints = st.integers(-(2**31), 2**31 - 1)
tokens = st.one_of(st.integers(0, 200_000), longs)
text = st.text(max_size=12)
floats = st.floats(allow_nan=False)


def maybe(s):
    """``s`` or None."""
    return st.one_of(st.none(), s)


stored = st.builds(
    BlockStored,
    block_hashes=st.lists(h8, max_size=4), parent_block_hash=maybe(h8), token_ids=st.lists(tokens, max_size=40),
    block_size=ints, lora_id=maybe(longs), medium=maybe(text), lora_name=maybe(text),
    extra_keys=maybe(st.binary(max_size=10)), group_idx=maybe(ints), kv_cache_spec_kind=maybe(text),
    kv_cache_spec_sliding_window=maybe(ints), locality=maybe(text), ownership=maybe(text),
    session_id=maybe(text), lookahead_token_ids=maybe(st.lists(st.lists(longs, max_size=10), max_size=3)),
    cache_salt=maybe(text), token_id_pairs=maybe(st.lists(st.lists(longs, max_size=2), max_size=3)),
    block_digests=maybe(st.lists(st.binary(max_size=33), max_size=3)),
    parent_block_digest=maybe(st.binary(max_size=33)),
)
common_stored = st.builds(
    BlockStored, block_hashes=st.lists(h8, max_size=4), parent_block_hash=maybe(h8),
    token_ids=st.lists(tokens, max_size=40), block_size=st.sampled_from([0, 16]),
    medium=maybe(st.sampled_from(["GPU", "CPU"])), group_idx=maybe(st.integers(0, 3)),
    kv_cache_spec_kind=maybe(st.sampled_from(["full_attention", "mamba"])), lora_name=maybe(st.just("sql-lora")),
)
"""vLLM's usual shape (the codec's cached-tail and short paths)."""
removed = st.builds(BlockRemoved, block_hashes=st.lists(h8, max_size=4), medium=maybe(text), group_idx=maybe(ints),
                    locality=maybe(text), ownership=maybe(text),
                    block_digests=maybe(st.lists(st.binary(max_size=33), max_size=3)))
reset = st.builds(Reset, reason=text, missing_from=maybe(longs), missing_to=maybe(longs))
events = st.one_of(stored, common_stored, removed, st.just(AllBlocksCleared()), reset)

block_events = st.builds(BlockEvent, replica=text, epoch=longs, seq=longs, index=ints, ts=floats, event=events,
                         dp_rank=ints, model=maybe(text))
incompletes = st.builds(Incomplete, replica=text, epoch=longs, seq=longs, index=ints, workers=ints,
                        reported=st.lists(ints, max_size=10), missing=st.lists(ints, max_size=10), event=events,
                        dp_rank=ints)
dead_letters = st.builds(DeadLetter, stage=text, source=text, reason=text,
                         payload=st.lists(st.binary(max_size=20), max_size=3), ts=floats)
batches = st.builds(EventBatch, replica=text, seq=longs, ts=floats, events=st.lists(events, max_size=5),
                    dp_rank=ints, worker_rank=ints, workers=ints, engine=text, epoch=longs, topic=text,
                    first_index=st.one_of(st.just(0), ints), model=maybe(text))
records = st.one_of(batches, block_events, incompletes, dead_letters)
"""Any of the four top-level records."""
