"""vLLM's prefix-cache block hashing, so kvbus can compute the hashes an engine publishes.

``hash(block) = H((parent_digest or NONE_HASH, tuple(tokens), extra_keys))`` chained over the
prompt's full blocks (protocol doc §5; vLLM ``hash_block_tokens``). ``H`` is the engine's
``--prefix-caching-hash-algo`` (vLLM 0.33, ``vllm/utils/hashing.py``):

* ``sha256``: SHA-256 of ``pickle.dumps(obj, protocol=5)`` (32-byte digest);
* ``sha256_cbor``: SHA-256 of canonical CBOR of ``obj`` (32 bytes);
* ``xxhash``: XXH3-128 of ``pickle.dumps(obj, protocol=5)`` (16 bytes);
* ``xxhash_cbor``: XXH3-128 of canonical CBOR of ``obj`` (16 bytes).

The published value is the last 8 bytes of the digest (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1:
``int.from_bytes(digest, "big") & (2**64 - 1)``). ``NONE_HASH = H(seed)`` (a ``str``), the seed
being (vLLM >= 0.29, ``resolve_none_hash_seed``): ``PYTHONHASHSEED`` when it is set (any string,
the empty one too), else ``"vllm-none-hash"`` for the sha256 family and 32 random bytes (hex) drawn
per engine process for the xxhash family. That last case cannot be matched by anyone outside the
engine process: :func:`resolve_seed` refuses it (:class:`UnmatchableSeed`). Rules for routers in
other languages: docs/lookup-protocol.md, "Block hashes".
"""
from __future__ import annotations

import hashlib
import os
import pickle
from typing import Any, Callable, Mapping, Sequence

import cbor2
import xxhash

from kvbus.schemas.events import canonical_hash

HashFn = Callable[[Any], bytes]

NONE_HASH_SEED = "vllm-none-hash"
"""vLLM's NONE_HASH seed for the sha256 family when PYTHONHASHSEED is not set."""


def sha256_pickle(obj: Any) -> bytes:
    """vLLM ``sha256``: SHA-256 of ``pickle.dumps(obj, protocol=5)`` (32 bytes)."""
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def sha256_cbor(obj: Any) -> bytes:
    """vLLM ``sha256_cbor``: SHA-256 of canonical CBOR of ``obj`` (32 bytes)."""
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def xxhash_pickle(obj: Any) -> bytes:
    """vLLM ``xxhash``: XXH3-128 of ``pickle.dumps(obj, protocol=5)`` (16 bytes, big-endian)."""
    return xxhash.xxh3_128_digest(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def xxhash_cbor(obj: Any) -> bytes:
    """vLLM ``xxhash_cbor``: XXH3-128 of canonical CBOR of ``obj`` (16 bytes, big-endian)."""
    return xxhash.xxh3_128_digest(cbor2.dumps(obj, canonical=True))


HASH_ALGOS: dict[str, HashFn] = {
    "sha256": sha256_pickle,
    "sha256_cbor": sha256_cbor,
    "xxhash": xxhash_pickle,
    "xxhash_cbor": xxhash_cbor,
}
"""Every vLLM ``--prefix-caching-hash-algo`` value (vLLM 0.33) -> its hash function."""

RANDOM_SEED_ALGOS: frozenset[str] = frozenset({"xxhash", "xxhash_cbor"})
"""Algorithms whose NONE_HASH seed vLLM draws at random per process unless PYTHONHASHSEED is set
(not collision resistant, so vLLM keeps their seed unpredictable)."""


class UnmatchableSeed(ValueError):
    """An xxhash-family chain was asked for without a seed: the engine's seed is random."""


def resolve_seed(algo: str, seed: str | None = None, env: Mapping[str, str] | None = None) -> str:
    """The NONE_HASH seed an engine using ``algo`` has: ``seed`` if given (the engine's
    PYTHONHASHSEED, e.g. from ``--hash-seed``), else ``PYTHONHASHSEED`` of ``env`` (default
    ``os.environ``) if set, else ``"vllm-none-hash"`` for the sha256 family. For the xxhash family
    with neither, raises :class:`UnmatchableSeed`: that engine drew a random seed. ValueError for an
    unknown ``algo``."""
    if algo not in HASH_ALGOS:
        raise ValueError(f"unknown hash algorithm {algo!r}; one of {sorted(HASH_ALGOS)}")
    if seed is None:
        seed = (os.environ if env is None else env).get("PYTHONHASHSEED")
    if seed is not None:
        return seed
    if algo in RANDOM_SEED_ALGOS:
        raise UnmatchableSeed(
            f"--algo {algo} needs the engine's hash seed: a vLLM engine running {algo} without "
            "PYTHONHASHSEED seeds every prompt's first block with 32 random bytes drawn per engine "
            "process, so its block hashes exist only inside that process and no router can compute "
            f"them. Start vLLM with PYTHONHASHSEED=<seed> (the same on every replica) and give the "
            "same value here (--hash-seed, or PYTHONHASHSEED)")
    return NONE_HASH_SEED


def none_hash(algo: str = "sha256", seed: str | None = None) -> bytes:
    """The parent digest of a prompt's first block: ``H(resolve_seed(algo, seed))`` (vLLM >= 0.29)."""
    s = resolve_seed(algo, seed)  # checks algo first
    return HASH_ALGOS[algo](s)


def block_digests(
    token_ids: Sequence[int],
    block_size: int,
    algo: str = "sha256",
    extra_keys: Sequence[Any] | None = None,
    seed: str | None = None,
) -> list[bytes]:
    """Full digests of every full block of ``token_ids``, chained from NONE_HASH.

    ``extra_keys`` optionally gives one hash-input extra-key tuple (or None) per block (vLLM's
    ``generate_block_hash_extra_keys``, e.g. ``(("cache_salt", "s"),)`` for block 0). ``seed``: see
    :func:`resolve_seed`. A trailing partial block gets no hash, as in vLLM.
    """
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    parent = none_hash(algo, seed)  # checks algo and seed
    fn = HASH_ALGOS[algo]
    out: list[bytes] = []
    for i in range(len(token_ids) // block_size):
        extra = extra_keys[i] if extra_keys is not None else None
        parent = fn((parent, tuple(token_ids[i * block_size:(i + 1) * block_size]), extra))
        out.append(parent)
    return out


def block_hashes(
    token_ids: Sequence[int], block_size: int, algo: str = "sha256", seed: str | None = None
) -> list[bytes]:
    """Canonical 8-byte hashes (what vLLM publishes by default) of every full block."""
    return [canonical_hash(d) for d in block_digests(token_ids, block_size, algo, seed=seed)]
