"""Router-side block hashing (kvbus.schemas.hashing, ``kvbus lookup --tokens``) against vLLM's own hashes,
for all four ``--prefix-caching-hash-algo`` values, and the seed rules (docs/lookup-protocol.md).
Vectors and how they were made: tests/vllm_hash_vectors.py.
"""
from __future__ import annotations

import json
import time
import uuid

import pytest

from kvbus.infra.scratch_redis import RedisServer
from kvbus.runtime.settings import Settings
from kvbus.schemas.events import BlockEvent, BlockStored, canonical_hash
from kvbus.schemas.hashing import (
    HASH_ALGOS,
    NONE_HASH_SEED,
    UnmatchableSeed,
    block_digests,
    block_hashes,
    none_hash,
    resolve_seed,
)
from kvbus.sinks.view.redis_store import RedisStore
from tests.lookup_cli import run_lookup
from tests.vllm_hash_vectors import PROMPTS, VECTORS


@pytest.fixture(autouse=True)
def _no_hash_seed(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)


def test_vectors_cover_every_algorithm_and_the_seed_cases():
    assert {v[0] for v in VECTORS} == set(HASH_ALGOS) == {"sha256", "sha256_cbor", "xxhash", "xxhash_cbor"}
    assert {(v[0], v[1]) for v in VECTORS if v[1] is None} == {("sha256", None), ("sha256_cbor", None)}
    assert {v[1] for v in VECTORS} >= {None, "0", "12345", ""}


@pytest.mark.parametrize("algo,seed,prompt,bs,salt,nh,digests", VECTORS)
def test_digests_equal_vllms(algo, seed, prompt, bs, salt, nh, digests):
    tokens = PROMPTS[prompt]
    extra = [(("cache_salt", salt),)] + [None] * (len(tokens) // bs - 1) if salt else None
    assert none_hash(algo, seed).hex() == nh
    assert [d.hex() for d in block_digests(tokens, bs, algo, extra, seed=seed)] == digests
    assert len(bytes.fromhex(digests[0])) == (16 if algo.startswith("xxhash") else 32)


@pytest.mark.parametrize("algo,seed,prompt,bs,salt,nh,digests", [v for v in VECTORS if v[4] is None])
def test_lookup_chain_is_the_published_ints_seed_from_flag_or_environment(monkeypatch, algo, seed, prompt, bs,
                                                                       salt, nh, digests):
    published = [canonical_hash(int.from_bytes(bytes.fromhex(d), "big") & (2**64 - 1)) for d in digests]
    assert block_hashes(PROMPTS[prompt], bs, algo, seed) == published
    if seed is not None:
        monkeypatch.setenv("PYTHONHASHSEED", seed)
        assert block_hashes(PROMPTS[prompt], bs, algo) == published
        monkeypatch.setenv("PYTHONHASHSEED", "not-" + seed)  # the flag wins over the environment
        assert block_hashes(PROMPTS[prompt], bs, algo, seed) == published
        assert block_hashes(PROMPTS[prompt], bs, algo) != published


@pytest.mark.parametrize("algo", ["xxhash", "xxhash_cbor"])
def test_xxhash_without_a_seed_is_refused_with_the_reason(algo):
    with pytest.raises(UnmatchableSeed) as e:
        block_hashes(PROMPTS["A"], 16, algo)
    msg = str(e.value)
    assert "random" in msg and "per engine process" in msg and "no router can compute" in msg
    assert "PYTHONHASHSEED" in msg and "--hash-seed" in msg


def test_sha256_family_default_seed_and_unknown_algorithm():
    assert resolve_seed("sha256") == resolve_seed("sha256_cbor") == NONE_HASH_SEED == "vllm-none-hash"
    assert resolve_seed("xxhash", env={"PYTHONHASHSEED": "7"}) == "7"
    assert resolve_seed("sha256", env={"PYTHONHASHSEED": ""}) == ""  # set but empty is a seed, as in vLLM
    for bad in ("md5", "xxh3", "SHA256"):
        with pytest.raises(ValueError, match="unknown hash algorithm"):
            block_hashes(PROMPTS["A"], 16, bad, "0")


# ---------------------------------------------------------------- kvbus lookup --tokens, every algorithm

def _run(argv, settings, capsys) -> tuple[int, str, str]:
    return run_lookup(argv, settings, capsys)


@pytest.fixture(scope="module")
def seeded_view():
    """A private Redis whose view holds prompt B (block size 16) as published by four engines, one
    per algorithm, all with PYTHONHASHSEED=12345 (hashes from VECTORS, i.e. from vLLM)."""
    with RedisServer() as srv:
        prefix = f"h{uuid.uuid4().hex[:8]}:"
        store = RedisStore(srv.client(), prefix)
        records = []
        for algo, seed, prompt, bs, salt, _, digests in VECTORS:
            if (seed, prompt, bs, salt) == ("12345", "B", 16, None):
                hashes = [canonical_hash(bytes.fromhex(d)) for d in digests]
                records.append(("kvbus.blocks", BlockEvent(replica=f"engine-{algo}", dp_rank=0, epoch=1, seq=0,
                                                           index=0, ts=time.time(),
                                                           event=BlockStored(block_hashes=hashes, medium="GPU"))))
        assert len(records) == 4
        store.apply(records)
        yield Settings(redis_url=srv.url), prefix


@pytest.mark.parametrize("algo", sorted(HASH_ALGOS))
def test_kvbus_lookup_tokens_finds_the_engine_of_each_algorithm(seeded_view, capsys, monkeypatch, algo):
    settings, prefix = seeded_view
    tokens = ",".join(map(str, PROMPTS["B"]))
    base = ["--tokens", tokens, "--algo", algo, "--prefix", prefix, "--json"]
    code, out, _ = _run(base + ["--hash-seed", "12345"], settings, capsys)
    assert code == 0
    assert json.loads(out) == {f"engine-{algo}": {"matched": 3, "tiers": {"GPU": 3}, "score": 3.0,
                                                  "replica": f"engine-{algo}", "dp_rank": 0}}
    monkeypatch.setenv("PYTHONHASHSEED", "12345")
    assert _run(base, settings, capsys)[:2] == (0, out)
    monkeypatch.delenv("PYTHONHASHSEED")
    code, out, err = _run(base, settings, capsys)
    if algo.startswith("xxhash"):
        assert code == 2 and out == ""
        assert err.startswith(f"kvbus lookup: --algo {algo} needs the engine's hash seed") and "no router" in err
    else:  # vLLM's default seed: not the engines' (they run with 12345)
        assert code == 0 and json.loads(out) == {}
