"""vLLM's prefix-cache block hashing, so kvbus can compute the hashes an engine publishes.

``hash(block) = H((parent_digest or NONE_HASH, tuple(tokens), extra_keys))`` chained over the
prompt's full blocks (protocol doc §5; vLLM ``hash_block_tokens``). ``H`` is the engine's
``--prefix-caching-hash-algo`` (``vllm/utils/hashing.py``):

* ``sha256``: SHA-256 of ``pickle.dumps(obj, protocol=5)`` (32-byte digest);
* ``sha256_cbor``: SHA-256 of canonical CBOR of ``obj`` (32 bytes);
* ``xxhash``: XXH3-128 of ``pickle.dumps(obj, protocol=5)`` (16 bytes);
* ``xxhash_cbor``: XXH3-128 of canonical CBOR of ``obj`` (16 bytes).

The published value is the last 8 bytes of the digest (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1:
``int.from_bytes(digest, "big") & (2**64 - 1)``). ``NONE_HASH = H(seed)`` (a ``str``), the seed
being ``PYTHONHASHSEED`` when it is set (any string, the empty one too); unset, recent releases use
``"vllm-none-hash"`` for the sha256 family and 32 random bytes (hex) drawn per engine process for
the xxhash family, older ones random bytes for every algorithm (:attr:`HashRules.fixed_default_seed`).
A random seed cannot be matched by anyone outside the engine process: :func:`resolve_seed` refuses it
(:class:`UnmatchableSeed`).

``extra_keys`` (vLLM ``generate_block_hash_extra_keys``) is ``None`` for a plain prompt, else a
tuple: the LoRA adapter's key on every block, then the request's cache salt on block 0 only
(vLLM's order is LoRA, multimodal, cache salt, prompt embeddings; kvbus computes the first and
third). Their shapes changed between releases; :data:`HASH_RELEASES` holds what kvbus knows of
that, one row per release that changed it, and :func:`hash_rules` answers for any release.

Entry point: :func:`block_hashes` (the published 8-byte hashes of a prompt). Rules for routers in
other languages: docs/lookup-protocol.md, "Block hashes"; vectors made with vLLM's own code:
tests/vectors/vllm_block_hashes.json.
"""
from __future__ import annotations

import hashlib
import os
import pickle
import re
from dataclasses import dataclass, replace
from typing import Any, Callable, Literal, Mapping, Sequence

import cbor2
import xxhash

from kvbus.schemas.events import canonical_hash

HashFn = Callable[[Any], bytes]

NONE_HASH_SEED = "vllm-none-hash"
"""vLLM's NONE_HASH seed for the sha256 family when PYTHONHASHSEED is not set (where
:attr:`HashRules.fixed_default_seed`)."""


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
"""Every vLLM ``--prefix-caching-hash-algo`` value kvbus computes -> its hash function (which releases
have which: :attr:`HashRules.algos`)."""

RANDOM_SEED_ALGOS: frozenset[str] = frozenset({"xxhash", "xxhash_cbor"})
"""Algorithms whose NONE_HASH seed vLLM always draws at random per process unless PYTHONHASHSEED is set
(not collision resistant, so vLLM keeps their seed unpredictable)."""


# ---------------------------------------------------------------------------------- release rules

LoraKey = Literal["int_id", "name", "name_path"]


@dataclass(frozen=True)
class HashRules:
    """How one vLLM release hashes blocks: a row of :data:`HASH_RELEASES` with the rows before it applied."""

    release: str
    """The first release of these rules, e.g. "0.31.0"."""
    algos: tuple[str, ...]
    """Its ``--prefix-caching-hash-algo`` values (keys of :data:`HASH_ALGOS`)."""
    fixed_default_seed: bool
    """Without PYTHONHASHSEED the sha256 family is seeded with :data:`NONE_HASH_SEED` (True) or with
    random bytes per engine process, like every algorithm then (False)."""
    lora_key: LoraKey
    """What identifies a LoRA adapter in every block's extra keys: ``"int_id"`` (the engine's
    ``lora_int_id``, assigned per engine, so no router can compute it), ``"name"`` (the bare name) or
    ``"name_path"`` (``("lora", name, path)``)."""
    tagged: bool
    """Extra keys are tagged tuples, the cache salt ``("cache_salt", salt)`` (True), or bare values (False)."""


def _rows(first: HashRules, *changes: tuple[str, dict[str, Any]]) -> tuple[HashRules, ...]:
    rules = [first]
    for release, changed in changes:
        rules.append(replace(rules[-1], release=release, **changed))
    return tuple(rules)


HASH_RELEASES: tuple[HashRules, ...] = _rows(
    # bytes digests chained from NONE_HASH = H(PYTHONHASHSEED); earlier releases chained ints
    HashRules("0.10.2", algos=("sha256", "sha256_cbor"), fixed_default_seed=False, lora_key="int_id",
              tagged=False),
    ("0.11.1", {"lora_key": "name"}),
    ("0.13.0", {"algos": ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")}),
    ("0.29.0", {"fixed_default_seed": True}),
    ("0.31.0", {"lora_key": "name_path", "tagged": True}),
)
"""vLLM releases, oldest first: each row is the first release whose block hashing differs from the
row before (checked against every row's wheel and the release before it: tests/vectors/). A release
between two rows hashes as the older one; one after the last row as the last row."""

_RELEASE = re.compile(r"^(?:vllm-)?v?(\d+(?:\.\d+)*)(?:[.+\-]?(?:post|rc|dev|a|b)\d*)*(?:\+[\w.]+)?$")


def release_tuple(version: str) -> tuple[int, ...]:
    """``"0.31.0"``, ``"0.31"``, ``"v0.31.0"``, ``"vllm-0.31.0"``, ``"0.31.0rc1"`` -> (0, 31, 0); at least
    three numbers, so they compare as releases (a pre- or post-release counts as its release). ValueError
    for anything else."""
    m = _RELEASE.match(version.strip())
    if not m:
        raise ValueError(f"not a vLLM release: {version!r} (e.g. 0.33.0 or vllm-0.33.0)")
    numbers = tuple(int(x) for x in m.group(1).split("."))
    return numbers + (0,) * (3 - len(numbers))


def hash_rules(engine_version: str | None = None) -> HashRules:
    """The :class:`HashRules` of vLLM ``engine_version`` (None: the newest row). ValueError for a
    malformed version or one older than the first row."""
    if engine_version is None:
        return HASH_RELEASES[-1]
    version = release_tuple(engine_version)
    found = None
    for rules in HASH_RELEASES:
        if release_tuple(rules.release) <= version:
            found = rules
    if found is None:
        raise ValueError(f"vLLM {engine_version} is older than {HASH_RELEASES[0].release}: its block hashes "
                         "are chained from ints, not digests, which kvbus does not compute")
    return found


def first_release(**rule: Any) -> str:
    """The first release of :data:`HASH_RELEASES` whose rules have the given values, e.g.
    ``first_release(tagged=True)``; ValueError if none has."""
    for rules in HASH_RELEASES:
        if all(getattr(rules, k) == v for k, v in rule.items()):
            return rules.release
    raise ValueError(f"no vLLM release has {rule}")


# ---------------------------------------------------------------------------------- extra keys


@dataclass(frozen=True)
class LoRA:
    """A request's LoRA adapter, as vLLM's ``LoRARequest`` names it."""

    name: str
    """``lora_name``: the adapter name a request asks for (the OpenAI API's ``model``)."""
    path: str = ""
    """``lora_path``: where the engine loaded it from (what ``--lora-modules NAME=PATH`` or the load
    call gave); required where the release hashes it (:attr:`HashRules.lora_key` ``"name_path"``)."""


def _own(text: str) -> str:
    """An equal string that is no other object (CPython shares only those of at most one character).

    pickle writes a string object met twice in one tuple once and refers back to it, so the ``sha256``
    and ``xxhash`` inputs depend on which strings are the same object. In an engine, the adapter's name
    and path and the request's salt are distinct objects, also from the tags ``"lora"`` and
    ``"cache_salt"``; a caller's ``LoRA("lora", p)`` or one string given as both name and salt would
    otherwise be the same object here and change the hash."""
    return (text + " ")[:-1]


def extra_keys(n_blocks: int, lora: LoRA | None = None, cache_salt: str | None = None,
               engine_version: str | None = None) -> list[tuple[Any, ...] | None]:
    """Per block, the extra keys vLLM ``engine_version`` (None: the newest row of :data:`HASH_RELEASES`)
    hashes for a prompt of ``n_blocks`` full blocks without multimodal inputs or prompt embeddings:
    ``None`` for a plain prompt, else LoRA's key on every block then the salt on block 0 (an empty
    salt is no salt, as in vLLM). ValueError when the release keys LoRA by its engine-assigned int id,
    or needs the adapter's path and none is given."""
    rules = hash_rules(engine_version)
    lora_keys: list[Any] = []
    if lora is not None:
        if not isinstance(lora.name, str) or not lora.name or not isinstance(lora.path, str):
            raise ValueError(f"a LoRA adapter needs a name and a string path, got {lora!r}")
        if rules.lora_key == "int_id":
            raise ValueError(f"vLLM {engine_version} keys a LoRA request's blocks by the adapter's lora_int_id "
                             f"(before {first_release(lora_key='name')}), which each engine assigns as it loads "
                             "adapters: no router can compute those hashes")
        if rules.lora_key == "name":
            lora_keys.append(_own(lora.name))
        else:
            if not lora.path:
                raise ValueError(f"vLLM {first_release(lora_key='name_path')} and later hash a LoRA adapter's path "
                                 f"with its name{f' (here {engine_version})' if engine_version else ''}: give the "
                                 "path the engines loaded it from (--lora-path)")
            lora_keys.append(("lora", _own(lora.name), _own(lora.path)))
    if cache_salt is not None and not isinstance(cache_salt, str):
        raise ValueError(f"a cache salt is a string, got {type(cache_salt).__name__}")
    salt_keys: list[Any] = []
    if cache_salt:
        salt_keys.append(("cache_salt", _own(cache_salt)) if rules.tagged else _own(cache_salt))
    out: list[tuple[Any, ...] | None] = []
    for i in range(n_blocks):
        keys = lora_keys + (salt_keys if i == 0 else [])
        out.append(tuple(keys) if keys else None)
    return out


# ---------------------------------------------------------------------------------- the chain


class UnmatchableSeed(ValueError):
    """A chain was asked for without a seed where the engine's seed is random."""


def resolve_seed(algo: str, seed: str | None = None, env: Mapping[str, str] | None = None,
                 engine_version: str | None = None) -> str:
    """The NONE_HASH seed an engine of vLLM ``engine_version`` (None: the newest) using ``algo`` has:
    ``seed`` if given (the engine's PYTHONHASHSEED, e.g. from ``--hash-seed``), else ``PYTHONHASHSEED``
    of ``env`` (default ``os.environ``) if set, else ``"vllm-none-hash"`` for the sha256 family in
    releases with :attr:`HashRules.fixed_default_seed`. Otherwise the engine drew a random seed: raises
    :class:`UnmatchableSeed`. ValueError for an ``algo`` the release does not have."""
    if algo not in HASH_ALGOS:
        raise ValueError(f"unknown hash algorithm {algo!r}; one of {sorted(HASH_ALGOS)}")
    rules = hash_rules(engine_version)
    if algo not in rules.algos:  # only an older release (engine_version given) lacks one
        raise ValueError(f"vLLM {engine_version} has no --prefix-caching-hash-algo {algo} "
                         f"(one of {', '.join(rules.algos)})")
    if seed is None:
        seed = (os.environ if env is None else env).get("PYTHONHASHSEED")
    if seed is not None:
        return seed
    if algo not in RANDOM_SEED_ALGOS and rules.fixed_default_seed:
        return NONE_HASH_SEED
    if algo in RANDOM_SEED_ALGOS:
        why = (f"a vLLM engine running {algo} without PYTHONHASHSEED seeds every prompt's first block with "
               "32 random bytes drawn per engine process")
    else:
        why = (f"vLLM {engine_version} (before {first_release(fixed_default_seed=True)}) without PYTHONHASHSEED seeds "
               "every prompt's first block with 32 random bytes drawn per engine process, for every algorithm")
    raise UnmatchableSeed(
        f"--algo {algo} needs the engine's hash seed: {why}, so its block hashes exist only inside that "
        "process and no router can compute them. Start vLLM with PYTHONHASHSEED=<seed> (the same on every "
        "replica) and give the same value here (--hash-seed, or PYTHONHASHSEED)")


def none_hash(algo: str = "sha256", seed: str | None = None, engine_version: str | None = None) -> bytes:
    """The parent digest of a prompt's first block: ``H(resolve_seed(algo, seed, engine_version=...))``."""
    s = resolve_seed(algo, seed, engine_version=engine_version)  # checks algo first
    return HASH_ALGOS[algo](s)


def block_digests(
    token_ids: Sequence[int],
    block_size: int,
    algo: str = "sha256",
    extra_keys: Sequence[tuple[Any, ...] | None] | None = None,
    seed: str | None = None,
    *,
    engine_version: str | None = None,
) -> list[bytes]:
    """Full digests of every full block of ``token_ids``, chained from NONE_HASH.

    ``extra_keys`` optionally gives one hash-input extra-key tuple (or None) per block, as
    :func:`extra_keys` makes them. ``seed``, ``engine_version``: see :func:`resolve_seed`. A trailing
    partial block gets no hash, as in vLLM.
    """
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    parent = none_hash(algo, seed, engine_version)  # checks algo and seed
    fn = HASH_ALGOS[algo]
    out: list[bytes] = []
    for i in range(len(token_ids) // block_size):
        extra = extra_keys[i] if extra_keys is not None else None
        parent = fn((parent, tuple(token_ids[i * block_size:(i + 1) * block_size]), extra))
        out.append(parent)
    return out


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    algo: str = "sha256",
    seed: str | None = None,
    *,
    lora: LoRA | None = None,
    cache_salt: str | None = None,
    engine_version: str | None = None,
) -> list[bytes]:
    """The canonical 8-byte hashes (what vLLM publishes by default) of every full block of a prompt.

    ``algo``: the engines' ``--prefix-caching-hash-algo``; ``seed``: their PYTHONHASHSEED (None: this
    process's, else vLLM's default where it has one); ``lora``: the request's adapter (None: the base
    model); ``cache_salt``: the request's ``cache_salt`` (None or "": none); ``engine_version``: the
    engines' vLLM release (None: the newest row of :data:`HASH_RELEASES`). ValueError (or its
    :class:`UnmatchableSeed`) for what the release cannot be matched on."""
    keys = None
    if lora is not None or cache_salt:
        keys = extra_keys(len(token_ids) // block_size if block_size > 0 else 0, lora, cache_salt, engine_version)
    digests = block_digests(token_ids, block_size, algo, keys, seed, engine_version=engine_version)
    return [canonical_hash(d) for d in digests]
