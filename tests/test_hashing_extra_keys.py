"""LoRA and cache-salt block hashing (kvbus.schemas.hashing, ``kvbus lookup --tokens --lora-name ...
--cache-salt ... --engine-version ...``) against vLLM's own hashes, in every release row of
``HASH_RELEASES``. Vectors and how they were made: tests/vectors/vllm_block_hashes.json
(tests/vllm_hash_vectors.py reads it).
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
    HASH_RELEASES,
    LoRA,
    UnmatchableSeed,
    block_digests,
    block_hashes,
    extra_keys,
    first_release,
    hash_rules,
    none_hash,
    release_tuple,
    resolve_seed,
)
from kvbus.sinks.view.redis_store import RedisStore
from tests.lookup_cli import run_lookup
from tests.vllm_hash_vectors import ALL, NEWEST, PROMPTS, RELEASES, Vector

COMPUTABLE = [v for v in ALL if not v.random_seed]
RANDOM = [v for v in ALL if v.random_seed]


@pytest.fixture(autouse=True)
def _no_hash_seed(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)


def _lora(v: Vector) -> LoRA | None:
    return LoRA(*v.lora) if v.lora else None


def _as_json(keys):
    """kvbus's extra keys as the vectors write vLLM's (tuples as lists)."""
    return json.loads(json.dumps(keys))


# ---------------------------------------------------------------------------------- the vectors themselves

def test_vectors_cover_every_release_row_and_the_release_before_it():
    """Each row of HASH_RELEASES is the first release of its rules: vectors come from the row's own wheel
    and from the PyPI release just before it, which still hashes as the row before."""
    vector_releases = {v.vllm for v in ALL}
    assert vector_releases == set(RELEASES)
    assert {hash_rules(r).release for r in vector_releases} == {row.release for row in HASH_RELEASES}
    just_before = {"0.11.1": "0.11.0", "0.13.0": "0.12.0", "0.29.0": "0.28.0", "0.31.0": "0.30.0"}
    assert set(just_before) == {row.release for row in HASH_RELEASES[1:]}
    for row, prev in zip(HASH_RELEASES[1:], HASH_RELEASES):
        assert row.release in vector_releases and just_before[row.release] in vector_releases
        assert hash_rules(just_before[row.release]) == prev
    assert HASH_RELEASES[0].release in vector_releases


@pytest.mark.parametrize("release", sorted(RELEASES, key=release_tuple))
def test_table_says_what_each_wheel_has(release):
    rules = hash_rules(release)
    assert list(rules.algos) == RELEASES[release]["algos"]
    assert (rules.lora_key == "int_id") == RELEASES[release]["lora_keyed_by_int_id"]
    kinds = {(v.lora is not None, v.cache_salt is not None) for v in COMPUTABLE if v.vllm == release}
    assert {(False, False), (False, True)} <= kinds
    if rules.lora_key != "int_id":
        assert {(True, False), (True, True)} <= kinds
    assert {v.algo for v in ALL if v.vllm == release} == set(rules.algos)


def test_the_vectors_show_each_rule_change():
    """vLLM's own hashes differ where the table says the rules changed (so the vectors test them)."""
    def hashes(release, lora, salt="tenant-a", algo="sha256"):
        (v,) = [v for v in COMPUTABLE if (v.vllm, v.algo, v.seed, v.prompt, v.block_size, v.lora and v.lora[1][-2:],
                                          v.cache_salt) == (release, algo, "0", "B", 16, lora, salt)]
        return v.hashes
    # the adapter's path: hashed from 0.31.0 on, not before
    assert hashes("0.30.0", "v1", None) == hashes("0.30.0", "v2", None)
    assert hashes("0.31.0", "v1", None) != hashes("0.31.0", "v2", None)
    # tagged keys: 0.31.0's salted plain prompt differs from 0.30.0's, 0.31.0 = 0.33.0
    assert hashes("0.30.0", None) != hashes("0.31.0", None) == hashes(NEWEST, None)
    assert hashes("0.30.0", None, None) == hashes("0.31.0", None, None)
    # a salt changes every block (the chain carries it), LoRA too
    assert all(a != b for a, b in zip(hashes(NEWEST, None), hashes(NEWEST, None, None)))
    assert all(a != b for a, b in zip(hashes(NEWEST, "v1", None), hashes(NEWEST, None, None)))
    # the unseeded sha256 chain was random before 0.29.0, vLLM's fixed seed from then on
    assert {v.vllm for v in RANDOM if v.algo == "sha256"} == {r for r in RELEASES if release_tuple(r) < (0, 29)}


# ---------------------------------------------------------------------------------- kvbus equals vLLM

@pytest.mark.parametrize("v", COMPUTABLE, ids=str)
def test_chain_equals_vllms(v: Vector):
    lora = _lora(v)
    assert none_hash(v.algo, v.seed, v.vllm).hex() == v.none_hash
    keys = extra_keys(len(v.tokens) // v.block_size, lora, v.cache_salt, v.vllm)
    assert _as_json(keys) == v.extra_keys
    assert [d.hex() for d in block_digests(v.tokens, v.block_size, v.algo, keys, v.seed,
                                           engine_version=v.vllm)] == list(v.digests)
    published = [canonical_hash(h) for h in v.hashes]
    assert block_hashes(v.tokens, v.block_size, v.algo, v.seed, lora=lora, cache_salt=v.cache_salt,
                        engine_version=v.vllm) == published
    if hash_rules(v.vllm) == HASH_RELEASES[-1]:  # the default rules are the newest row's
        assert block_hashes(v.tokens, v.block_size, v.algo, v.seed, lora=lora, cache_salt=v.cache_salt) == published
    if lora is not None and hash_rules(v.vllm).lora_key == "name":  # the path is not hashed: none needed
        assert block_hashes(v.tokens, v.block_size, v.algo, v.seed, lora=LoRA(lora.name), cache_salt=v.cache_salt,
                            engine_version=v.vllm) == published


@pytest.mark.parametrize("v", RANDOM, ids=str)
def test_an_unseeded_chain_vllm_draws_at_random_is_refused(v: Vector):
    with pytest.raises(UnmatchableSeed) as e:
        block_hashes(v.tokens, v.block_size, v.algo, v.seed, lora=_lora(v), cache_salt=v.cache_salt,
                     engine_version=v.vllm)
    msg = str(e.value)
    assert msg.startswith(f"--algo {v.algo} needs the engine's hash seed") and "random" in msg
    assert "PYTHONHASHSEED" in msg and "--hash-seed" in msg
    if v.algo not in ("xxhash", "xxhash_cbor"):
        assert f"vLLM {v.vllm} (before {first_release(fixed_default_seed=True)})" in msg
    assert resolve_seed(v.algo, env={"PYTHONHASHSEED": "0"}, engine_version=v.vllm) == "0"


# ---------------------------------------------------------------------------------- what cannot be matched

@pytest.mark.parametrize("release", [r for r in RELEASES if RELEASES[r]["lora_keyed_by_int_id"]])
def test_releases_keying_lora_by_int_id_refuse_lora(release):
    with pytest.raises(ValueError, match=rf"vLLM {release} keys a LoRA request's blocks by the adapter's "
                                         r"lora_int_id \(before 0\.11\.1\).*no router can compute"):
        block_hashes(PROMPTS["B"], 16, "sha256", "0", lora=LoRA("sql-adapter", "/p"), engine_version=release)
    # their salted and plain chains are computed (vectors above)
    assert any(v.vllm == release and v.cache_salt for v in COMPUTABLE)


def test_newest_rules_need_the_adapter_path():
    for version in (None, "0.31.0", "0.33.0", "vllm-0.40.1"):
        with pytest.raises(ValueError, match=r"vLLM 0\.31\.0 and later hash a LoRA adapter's path.*--lora-path"):
            block_hashes(PROMPTS["B"], 16, "sha256", "0", lora=LoRA("sql-adapter"), engine_version=version)
    with pytest.raises(ValueError, match="needs a name"):
        extra_keys(1, LoRA("", "/p"))


def test_algorithms_a_release_lacks_and_releases_before_the_table():
    with pytest.raises(ValueError, match=r"vLLM 0\.12\.0 has no --prefix-caching-hash-algo xxhash "
                                         r"\(one of sha256, sha256_cbor\)"):
        block_hashes(PROMPTS["A"], 16, "xxhash", "0", engine_version="0.12.0")
    with pytest.raises(ValueError, match="unknown hash algorithm 'md5'"):
        block_hashes(PROMPTS["A"], 16, "md5", "0", engine_version="0.12.0")
    for old in ("0.10.1", "0.9.2", "0.8.5.post1"):
        with pytest.raises(ValueError, match=rf"vLLM {old} is older than 0\.10\.2: .*chained from ints"):
            hash_rules(old)


def test_engine_versions_as_written():
    assert release_tuple("0.30.0") == release_tuple("vllm-0.30.0") == release_tuple("v0.30.0") == (0, 30, 0)
    assert release_tuple("0.30") == (0, 30, 0) and release_tuple("1") == (1, 0, 0)
    assert release_tuple("0.10.1.1") == (0, 10, 1, 1) > release_tuple("0.10.1")
    assert release_tuple(" 0.31.0rc1 ") == release_tuple("0.31.0.post2") == release_tuple("0.31.0+cu128") == (0, 31, 0)
    assert hash_rules("0.30.9").release == "0.29.0" and hash_rules("0.31").release == "0.31.0"
    assert hash_rules("1.2.0") == hash_rules(None) == HASH_RELEASES[-1]
    for bad in ("", "latest", "0.x", "sglang-0.5.2", "0..1", "0.31.0 beta"):
        with pytest.raises(ValueError, match="not a vLLM release"):
            hash_rules(bad)


def test_empty_salt_is_no_salt_and_plain_prompts_have_no_extra_keys():
    assert extra_keys(3) == [None, None, None]
    assert extra_keys(2, cache_salt="") == [None, None]
    assert block_hashes(PROMPTS["B"], 16, "sha256", "0", cache_salt="") == block_hashes(PROMPTS["B"], 16, "sha256", "0")
    assert extra_keys(2, LoRA("a", "/p"), "s") == [(("lora", "a", "/p"), ("cache_salt", "s")), (("lora", "a", "/p"),)]
    assert extra_keys(2, LoRA("a", "/p"), "s", "0.30.0") == [("a", "s"), ("a",)]
    assert extra_keys(0, LoRA("a", "/p"), "s") == []
    with pytest.raises(ValueError, match="a cache salt is a string"):
        extra_keys(1, cache_salt=b"s")  # type: ignore[arg-type]
    assert set(HASH_ALGOS) == set(HASH_RELEASES[-1].algos)


# ---------------------------------------------------------------------------------- kvbus lookup --tokens

def _vector(release, algo, lora, salt, prompt="B", bs=16, seed="0") -> Vector:
    (v,) = [v for v in COMPUTABLE if (v.vllm, v.algo, v.seed, v.prompt, v.block_size, v.lora, v.cache_salt)
            == (release, algo, seed, prompt, bs, lora, salt)]
    return v


SQL_V1 = ("sql-adapter", "/adapters/sql-adapter/v1")
SQL_V2 = ("sql-adapter", "/adapters/sql-adapter/v2")
HOLDERS = {  # replica -> the vector (as vLLM published it) whose chain it holds; prompt B, block size 16
    "base": (NEWEST, None, None),
    "salted": (NEWEST, None, "tenant-a"),
    "lora-v1": (NEWEST, SQL_V1, None),
    "lora-v1-salted": (NEWEST, SQL_V1, "tenant-a"),
    "old-lora": ("0.30.0", SQL_V1, "tenant-a"),
}


def _run(argv, settings, capsys) -> tuple[int, str, str]:
    return run_lookup(argv, settings, capsys)


@pytest.fixture(scope="module")
def lora_view():
    """A private Redis whose view holds prompt B as vLLM published it for HOLDERS, for every algorithm
    (replica ``<holder>-<algo>``), all engines with PYTHONHASHSEED=0."""
    with RedisServer() as srv:
        prefix = f"x{uuid.uuid4().hex[:8]}:"
        records = []
        for algo in sorted(HASH_ALGOS):
            for holder, (release, lora, salt) in HOLDERS.items():
                v = _vector(release, algo, lora, salt)
                records.append(("kvbus.blocks", BlockEvent(
                    replica=f"{holder}-{algo}", dp_rank=0, epoch=1, seq=0, index=0, ts=time.time(),
                    event=BlockStored(block_hashes=[canonical_hash(h) for h in v.hashes], medium="GPU",
                                      token_ids=v.tokens[:48], block_size=16, lora_id=1 if lora else None,
                                      lora_name=lora[0] if lora else None))))
        RedisStore(srv.client(), prefix).apply(records)
        yield Settings(redis_url=srv.url), prefix


def _holders(out: str) -> dict[str, int]:
    return {name: m["matched"] for name, m in json.loads(out).items()}


@pytest.mark.parametrize("algo", sorted(HASH_ALGOS))
def test_lookup_tokens_matches_only_the_holder_of_the_same_adapter_and_salt(lora_view, capsys, algo):
    settings, prefix = lora_view
    base = ["--tokens", ",".join(map(str, PROMPTS["B"])), "--algo", algo, "--hash-seed", "0", "--prefix", prefix,
            "--json"]
    v1 = ["--lora-name", SQL_V1[0], "--lora-path", SQL_V1[1]]
    cases = [
        ([], "base"),
        (["--cache-salt", "tenant-a"], "salted"),
        (v1, "lora-v1"),
        (v1 + ["--cache-salt", "tenant-a"], "lora-v1-salted"),
        (["--cache-salt", "tenant-a", "--lora-path", SQL_V1[1], "--lora-name", SQL_V1[0], "--engine-version", "0.30.0"],
         "old-lora"),
        (["--lora-name", SQL_V1[0], "--cache-salt", "tenant-a", "--engine-version", "vllm-0.30.0"], "old-lora"),
    ]
    for extra, holder in cases:
        code, out, err = _run(base + extra, settings, capsys)
        assert code == 0, err
        assert _holders(out) == {f"{holder}-{algo}": 3}, extra
    # the same name re-pointed at another path, or another salt, holds nothing yet
    for extra in (["--lora-name", SQL_V2[0], "--lora-path", SQL_V2[1]], ["--cache-salt", "tenant-b"],
                  ["--lora-name", "other-adapter", "--lora-path", SQL_V1[1]]):
        code, out, err = _run(base + extra, settings, capsys)
        assert (code, json.loads(out)) == (0, {}), (extra, err)


def test_lookup_refuses_options_that_cannot_apply(lora_view, capsys):
    settings, prefix = lora_view
    tokens = ["--tokens", ",".join(map(str, PROMPTS["B"])), "--hash-seed", "0", "--prefix", prefix, "--json"]
    hashes = ["--hashes", "1,2", "--prefix", prefix, "--json"]
    refusals = [
        (tokens + ["--lora-name", "sql-adapter"], ("vLLM 0.31.0 and later hash a LoRA adapter's path with its name: "
                                                   "give the path the engines loaded it from (--lora-path)")),
        (tokens + ["--lora-name", "a", "--engine-version", "0.32.0"], "(here 0.32.0)"),
        (tokens + ["--lora-path", "/p"], "--lora-path needs --lora-name"),
        (tokens + ["--lora-name", "a", "--engine-version", "0.11.0"], "lora_int_id"),
        (tokens + ["--engine-version", "0.9.0"], "older than 0.10.2"),
        (tokens + ["--engine-version", "newest"], "not a vLLM release: 'newest'"),
        (tokens + ["--algo", "xxhash", "--engine-version", "0.12.0"], "has no --prefix-caching-hash-algo xxhash"),
        (hashes + ["--lora-name", "a", "--cache-salt", "s"], "--lora-name, --cache-salt apply to --tokens"),
        (hashes + ["--engine-version", "0.30.0"], "--engine-version apply to --tokens"),
    ]
    for argv, text in refusals:
        code, out, err = _run(argv, settings, capsys)
        assert (code, out) == (2, ""), argv
        assert err.startswith("kvbus lookup: ") and text in err, (argv, err)
    # unseeded sha256 before 0.29.0: the engine's seed was random
    code, out, err = _run(tokens[:2] + ["--prefix", prefix, "--engine-version", "0.28.0"], settings, capsys)
    assert code == 2 and err.startswith("kvbus lookup: --algo sha256 needs the engine's hash seed: vLLM 0.28.0")


@pytest.mark.parametrize("algo", sorted(HASH_ALGOS))
def test_names_equal_to_the_tags_hash_as_in_the_engine(algo):
    """pickle refers back to a string object met before in the same tuple: a caller's literal "lora" is the
    tag's own object here, not in the engine (vLLM's vector was made with separate objects)."""
    v = _vector(NEWEST, algo, ("lora", "cache_salt"), "lora", prompt="A")
    assert block_hashes(PROMPTS["A"], 16, algo, "0", lora=LoRA("lora", "cache_salt"), cache_salt="lora") == [
        canonical_hash(h) for h in v.hashes]
    one = _vector(NEWEST, algo, ("a", "/"), "a", prompt="A")  # 1-character strings: shared in every CPython
    assert block_hashes(PROMPTS["A"], 16, algo, "0", lora=LoRA("a", "/"), cache_salt="a") == [
        canonical_hash(h) for h in one.hashes]


def test_the_protocol_doc_shows_the_release_table():
    """docs/lookup-protocol.md's table of hashing releases is HASH_RELEASES, row for row."""
    from pathlib import Path

    lora = {"int_id": "`lora_int_id` (refused)", "name": "`name`", "name_path": '`("lora", name, path)`'}
    seed = {True: "`vllm-none-hash` for the sha256 family", False: "random (refused)"}
    salt = {True: '`("cache_salt", salt)`', False: "`salt`"}
    rows = [f"| {r.release} | {', '.join(r.algos)} | {seed[r.fixed_default_seed]} | {lora[r.lora_key]} | "
            f"{salt[r.tagged]} |" for r in HASH_RELEASES]
    text = (Path(__file__).resolve().parents[1] / "docs" / "lookup-protocol.md").read_text()
    assert [line for line in text.splitlines() if line.startswith(("| 0.", "| 1."))] == rows
