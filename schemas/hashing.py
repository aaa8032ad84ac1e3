"""vLLM's prefix-cache block hashing, so kvbus can compute the hashes an engine publishes.

``hash(block) = H((parent_digest or NONE_HASH, tuple(tokens), extra_keys))`` chained
over the prompt's full blocks (protocol doc §5). ``H`` is ``sha256`` (pickle
protocol 5, vLLM's default) or ``sha256_cbor`` (canonical CBOR). The published
value is the last 8 bytes of the digest (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1).
NONE_HASH follows vLLM >= 0.29: ``H("vllm-none-hash")`` unless PYTHONHASHSEED is set.
"""
from __future__ import annotations

import hashlib
import os
import pickle
from typing import Any, Callable, Sequence

from schemas.events import canonical_hash

HashFn = Callable[[Any], bytes]

NONE_HASH_SEED = "vllm-none-hash"


def sha256_pickle(obj: Any) -> bytes:
    """vLLM ``sha256``: SHA-256 of ``pickle.dumps(obj, protocol=5)``."""
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def sha256_cbor(obj: Any) -> bytes:
    """vLLM ``sha256_cbor``: SHA-256 of canonical CBOR of ``obj``."""
    import cbor2

    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


HASH_ALGOS: dict[str, HashFn] = {"sha256": sha256_pickle, "sha256_cbor": sha256_cbor}
"""Supported ``--prefix-caching-hash-algo`` values."""


def none_hash(algo: str = "sha256") -> bytes:
    """The parent digest of a prompt's first block (vLLM >= 0.29)."""
    seed = os.environ.get("PYTHONHASHSEED") or NONE_HASH_SEED
    return HASH_ALGOS[algo](seed)


def block_digests(
    token_ids: Sequence[int],
    block_size: int,
    algo: str = "sha256",
    extra_keys: Sequence[Any] | None = None,
) -> list[bytes]:
    """Full digests of every full block of ``token_ids``, chained from NONE_HASH.

    ``extra_keys`` optionally gives one hash-input extra-key tuple (or None) per block.
    A trailing partial block gets no hash, as in vLLM.
    """
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    fn = HASH_ALGOS[algo]
    parent = none_hash(algo)
    out: list[bytes] = []
    for i in range(len(token_ids) // block_size):
        extra = extra_keys[i] if extra_keys is not None else None
        parent = fn((parent, tuple(token_ids[i * block_size:(i + 1) * block_size]), extra))
        out.append(parent)
    return out


def block_hashes(
    token_ids: Sequence[int], block_size: int, algo: str = "sha256"
) -> list[bytes]:
    """Canonical 8-byte hashes (what vLLM publishes by default) of every full block."""
    return [canonical_hash(d) for d in block_digests(token_ids, block_size, algo)]
