"""Block-hash test vectors made with vLLM's own hashing code (tests/test_hashing_vllm.py,
tests/test_hashing_extra_keys.py, tests/test_lookup_protocol.py), read from
tests/vectors/vllm_block_hashes.json: a file for every language's tests, whose "about" says how it
was made (tests/vectors/make_vllm_vectors.py, from vLLM's PyPI wheels, outside the repository) and
whose "sources" names each wheel and its sha256.

:data:`ALL`: every vector (:class:`Vector`). :data:`VECTORS`: vLLM 0.33.0's vectors without LoRA and
with a deterministic seed, as tuples (algo, PYTHONHASHSEED or None for unset, prompt, block size,
cache_salt, NONE_HASH hex, digests hex of the prompt's full blocks).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FILE = Path(__file__).resolve().parent / "vectors" / "vllm_block_hashes.json"
DOC: dict[str, Any] = json.loads(FILE.read_text())

PROMPTS: dict[str, list[int]] = DOC["prompts"]
RELEASES: dict[str, dict[str, Any]] = DOC["releases"]
"""vLLM release -> what the script saw of it: ``algos`` (its get_hash_fn_by_name names),
``lora_keyed_by_int_id``."""
NEWEST = max(RELEASES, key=lambda v: tuple(map(int, v.split("."))))


@dataclass(frozen=True)
class Vector:
    """One case run through vLLM ``vllm``'s block hasher."""

    vllm: str
    algo: str
    seed: str | None
    """PYTHONHASHSEED, None = unset."""
    prompt: str
    block_size: int
    lora: tuple[str, str] | None
    """(lora_name, lora_path), None = no LoRA."""
    cache_salt: str | None
    random_seed: bool
    """vLLM drew NONE_HASH at random (two init_none_hash calls differed): no digests."""
    none_hash: str | None = None
    digests: tuple[str, ...] = ()
    hashes: tuple[int, ...] = ()
    """The published ints (last 8 bytes of each digest)."""
    extra_keys: Any = None
    """vLLM's generate_block_hash_extra_keys per block, tuples as lists."""
    event_extra_keys: Any = None
    """to_event_extra_keys of them (the releases that have it), tuples as lists."""

    @property
    def tokens(self) -> list[int]:
        return PROMPTS[self.prompt]

    def __str__(self) -> str:  # pytest ids
        lora = f"lora={self.lora[0]}@{self.lora[1][-12:]}" if self.lora else "nolora"
        return (f"{self.vllm}-{self.algo}-seed={self.seed}-{self.prompt}{self.block_size}-{lora}-"
                f"salt={(self.cache_salt or '')[:10]}")


def _vector(v: dict[str, Any]) -> Vector:
    return Vector(vllm=v["vllm"], algo=v["algo"], seed=v["pythonhashseed"], prompt=v["prompt"],
                  block_size=v["block_size"], lora=(v["lora"]["name"], v["lora"]["path"]) if v["lora"] else None,
                  cache_salt=v["cache_salt"], random_seed=v["random_seed"], none_hash=v.get("none_hash"),
                  digests=tuple(v.get("digests", ())), hashes=tuple(v.get("hashes", ())),
                  extra_keys=v.get("extra_keys"), event_extra_keys=v.get("event_extra_keys"))


ALL: list[Vector] = [_vector(v) for v in DOC["vectors"]]

VECTORS = [(v.algo, v.seed, v.prompt, v.block_size, v.cache_salt, v.none_hash, list(v.digests))
           for v in ALL if v.vllm == NEWEST and v.lora is None and not v.random_seed]
