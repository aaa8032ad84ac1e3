"""Lookup input (hash strings, tokens -> vLLM block hashes) and ``kvbus lookup`` output."""
from __future__ import annotations

import json
import time
import uuid

import pytest
from hypothesis import given, strategies as st

from kvbus.client.lookup_cli import parse_hash, parse_hashes
from kvbus.infra.scratch_redis import RedisServer
from kvbus.runtime.settings import Settings
from kvbus.schemas.events import BlockEvent, BlockStored, canonical_hash
from kvbus.schemas.hashing import block_hashes
from kvbus.sinks.view.redis_store import RedisStore
from tests.lookup_cli import run_lookup

# protocol doc §11: tokens 1..32, block size 16, PYTHONHASHSEED unset
SHA256_H0, SHA256_H1 = 1403909460543360175, 1643945449041937783
CBOR_H0, CBOR_H1 = 8866452693264111234, 807986237951177663


@pytest.fixture(autouse=True)
def _no_hash_seed(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)


def test_tokens_hash_like_vllm_sha256():
    assert block_hashes(range(1, 33), 16, "sha256") == [canonical_hash(SHA256_H0), canonical_hash(SHA256_H1)]
    assert canonical_hash(SHA256_H0).hex() == "137bb037547f4caf"


def test_tokens_hash_like_vllm_sha256_cbor():
    assert block_hashes(range(1, 33), 16, "sha256_cbor") == [canonical_hash(CBOR_H0), canonical_hash(CBOR_H1)]


def test_partial_trailing_block_has_no_hash_and_unknown_algo_is_refused():
    assert block_hashes(range(1, 40), 16) == block_hashes(range(1, 33), 16)
    with pytest.raises(ValueError):
        block_hashes(range(1, 33), 16, "md5")


def test_hash_strings_in_every_accepted_form():
    assert parse_hash(str(SHA256_H0)) == canonical_hash(SHA256_H0)
    assert parse_hash("0x137bb037547f4caf") == canonical_hash(SHA256_H0)
    assert parse_hash("-1234567890123456789") == canonical_hash(17212176183586094827)  # SGLang signed
    assert parse_hash("18446744073709551615") == b"\xff" * 8
    assert parse_hashes(" 1, 2 ,") == [canonical_hash(1), canonical_hash(2)]
    for bad in ("18446744073709551616", "-9223372036854775809", "0x1ffffffffffffffff", "abc", ""):
        with pytest.raises(ValueError):
            parse_hash(bad)


@given(st.integers(min_value=0, max_value=2**64 - 1))
def test_decimal_hex_and_signed_forms_agree(v):
    signed = v - 2**64 if v >= 2**63 else v
    assert parse_hash(str(v)) == parse_hash(hex(v)) == parse_hash(str(signed)) == canonical_hash(v)


@pytest.fixture(scope="module")
def view():
    """A private Redis with a small known view: a (dp 0) and b (dp 0, 1)."""
    with RedisServer() as srv:
        prefix = f"l{uuid.uuid4().hex[:8]}:"
        chain = block_hashes(range(1, 65), 16)  # 4 blocks
        store = RedisStore(srv.client(), prefix)

        def ev(replica, dp, seq, hashes, medium="GPU"):
            return ("kvbus.blocks", BlockEvent(replica=replica, dp_rank=dp, epoch=1, seq=seq, index=0, ts=time.time(),
                                               event=BlockStored(block_hashes=hashes, medium=medium)))

        store.apply([ev("a", 0, 0, chain), ev("a", 0, 1, chain[:2], "CPU"), ev("b", 0, 0, chain[:1]),
                     ev("b", 1, 0, chain[:3], "CPU")])
        yield Settings(redis_url=srv.url), prefix, chain


def run(settings, argv, capsys) -> tuple[int, str]:
    code, out, _ = run_lookup(argv, settings, capsys)
    return code, out


def test_lookup_json_by_tokens(view, capsys):
    settings, prefix, _ = view
    tokens = ",".join(str(t) for t in range(1, 70))
    code, out = run(settings, ["--tokens", tokens, "--block-size", "16", "--prefix", prefix, "--json"], capsys)
    assert code == 0
    assert json.loads(out) == {
        "a": {"matched": 4, "tiers": {"CPU": 2, "GPU": 4}, "score": 4.0, "replica": "a", "dp_rank": 0},
        "b#1": {"matched": 3, "tiers": {"CPU": 3}, "score": 2.4, "replica": "b", "dp_rank": 1},
        "b#0": {"matched": 1, "tiers": {"GPU": 1}, "score": 1.0, "replica": "b", "dp_rank": 0},
    }


def test_lookup_json_by_hashes_with_candidates_and_weights(view, capsys):
    settings, prefix, chain = view
    hashes = ",".join(str(int.from_bytes(h, "big")) for h in chain)
    code, out = run(settings, ["--hashes", hashes, "--prefix", prefix, "--replicas", "b", "--weights", "CPU=0.5",
                               "--json"], capsys)
    assert code == 0
    got = json.loads(out)
    assert list(got) == ["b#1", "b#0"]
    assert got["b#1"]["score"] == 1.5


def test_lookup_table_output_and_bad_input(view, capsys):
    settings, prefix, chain = view
    code, out = run(settings, ["--hashes", "0x" + chain[0].hex(), "--prefix", prefix], capsys)
    assert code == 0 and out.splitlines()[0].startswith("replica")
    assert any(line.startswith("a ") for line in out.splitlines())
    code, out = run(settings, ["--hashes", "12,zz", "--prefix", prefix], capsys)
    assert code == 2
    code, out = run(settings, ["--hashes", "12", "--prefix", prefix, "--json"], capsys)
    assert code == 0 and json.loads(out) == {}
