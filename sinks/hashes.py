"""Block-hash input for lookups: hash strings as routers and operators write them, or a prompt's tokens."""
from __future__ import annotations

from typing import Sequence

from kvbus.schemas.events import canonical_hash
from kvbus.schemas.hashing import LoRA, block_hashes

U64 = 1 << 64
I64_MIN = -(1 << 63)


def parse_hash(text: str) -> bytes:
    """One block hash as its canonical 8 bytes: decimal uint64 (vLLM), negative decimal int64
    (SGLang) or ``0x`` hex (at most 16 digits). Raises ValueError otherwise."""
    s = text.strip()
    try:
        if s.lower().startswith("0x"):
            value = int(s, 16)
            if not 0 <= value < U64:
                raise ValueError
        else:
            value = int(s, 10)
            if not I64_MIN <= value < U64:
                raise ValueError
    except ValueError:
        raise ValueError(f"not a 64-bit block hash: {text!r} (decimal uint64, negative int64 or 0x-hex)") from None
    return canonical_hash(value)


def parse_hashes(text: str) -> list[bytes]:
    """Comma-separated hashes (see :func:`parse_hash`), chain order."""
    return [parse_hash(p) for p in text.split(",") if p.strip()]


def parse_tokens(text: str) -> list[int]:
    """Comma-separated token ids."""
    try:
        return [int(p) for p in text.split(",") if p.strip()]
    except ValueError as e:
        raise ValueError(f"token ids must be integers: {e}") from None


def chain_from_tokens(
    tokens: Sequence[int], block_size: int, algo: str = "sha256", seed: str | None = None, *,
    lora: LoRA | None = None, cache_salt: str | None = None, engine_version: str | None = None,
) -> list[bytes]:
    """The chain of block hashes vLLM publishes for a prompt (full blocks only; protocol doc §5):
    :func:`kvbus.schemas.hashing.block_hashes`, whose arguments these are.

    ``algo``: any of ``kvbus.schemas.hashing.HASH_ALGOS``; ``seed``: the engine's PYTHONHASHSEED (None:
    this process's PYTHONHASHSEED, else vLLM's default); ``lora``, ``cache_salt``: the request's adapter
    and salt; ``engine_version``: the engines' vLLM release (None: the newest rules). ValueError for an
    unknown algorithm or what the release cannot be matched on; ``kvbus.schemas.hashing.UnmatchableSeed``
    (a ValueError) for a seed the engine draws at random."""
    return block_hashes(tokens, block_size, algo, seed, lora=lora, cache_salt=cache_salt,
                        engine_version=engine_version)


def lora_of(name: str | None, path: str | None) -> LoRA | None:
    """The adapter of ``--lora-name`` / ``--lora-path`` (None without a name); ValueError for a path
    without a name."""
    if name is None:
        if path is not None:
            raise ValueError("--lora-path needs --lora-name")
        return None
    return LoRA(name, path or "")
