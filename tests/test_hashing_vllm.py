"""Router-side block hashing (schemas.hashing, ``kvbus lookup --tokens``) against vLLM's own hashes,
for all four ``--prefix-caching-hash-algo`` values, and the seed rules (docs/lookup-protocol.md).

How VECTORS were made (2026-12-01; vLLM's code is not in this repository): ``pip download
vllm==0.33.0 --no-deps`` (vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl, sha256 4b6bdec4ab26...),
unzipped ``vllm/utils/hashing.py`` and ``vllm/v1/core/kv_cache_utils.py`` into a scratch directory
outside the repository, and loaded just those two with stub modules for their other vllm imports
(vllm.envs with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=True, a logger, empty classes for the config and
KV-spec types), with the real cbor2 6.3.0 and xxhash 4.1.0, under CPython 3.11. For each case the
script set or removed PYTHONHASHSEED, called vLLM's ``init_none_hash(get_hash_fn_by_name(algo))``,
then ran ``get_request_block_hasher(block_size, fn)`` on a request stub (the prompt's token ids,
no multimodal features, no LoRA, ``cache_salt`` as given, no prompt embeds) and recorded
``NONE_HASH`` and the digests it returned (the published int is their last 8 bytes,
``maybe_convert_block_hash``). The same script showed that with ``xxhash`` and no PYTHONHASHSEED two
``init_none_hash`` calls give different hashes (vLLM's random per-process seed).

Each vector: (algo, PYTHONHASHSEED or None for unset, prompt, block size, cache_salt, NONE_HASH hex,
digests hex of the prompt's full blocks).
"""
from __future__ import annotations

import argparse
import json
import time
import uuid

import pytest

from schemas.events import BlockEvent, BlockStored, canonical_hash
from schemas.hashing import HASH_ALGOS, NONE_HASH_SEED, UnmatchableSeed, block_digests, none_hash, resolve_seed
from schemas.settings import Settings
from sinks import cli
from sinks.hashes import chain_from_tokens
from sinks.redis_store import RedisStore
from tests.redis_server import RedisServer

PROMPTS = {
    "A": list(range(1, 33)),                                  # protocol doc §11: 2 blocks of 16
    "B": [(i * 7919 + 13) % 32000 for i in range(50)],        # 3 blocks of 16 + 2 tokens; 6 blocks of 8
}

VECTORS = [
    ('sha256', None, 'A', 16, None,
     '066b1e8987e027138e98701c46128929378935f9b6cd1549105ae6b4f0d71198',
     ['7b255da405e1d722823892e4fef187b4d8ac78215d7f0dd2137bb037547f4caf',
      '8e717becdc2054b7a3223b7b844f462c0db0ac86287b752b16d077ad0843c577']),
    ('sha256', None, 'B', 16, None,
     '066b1e8987e027138e98701c46128929378935f9b6cd1549105ae6b4f0d71198',
     ['4ea0bfe8a2588221c781ec067eb776d9bb03bc71bc4b88912977068c5ff2b014',
      '1e256ac2ec2ef5e428e60f679f55338d5213612e82860b45f47d444b4dc6c9e8',
      '55f6f2c1bf838c9fd5207264682112c1a21b766e64e64382f4837052042d18e7']),
    ('sha256', '0', 'A', 16, None,
     '1973e23848344dc43a988a9b478663803cfffe1243480253f9a3cf004b14aa7c',
     ['bea72b7d33de03c1aa715efbb492d0e0d3801f00c1f985756896072ae8b31325',
      '2744667f6645310ff670b0c5d7c64987ffa5940de5a549f17d92dcbb5b559e31']),
    ('sha256', '0', 'B', 16, None,
     '1973e23848344dc43a988a9b478663803cfffe1243480253f9a3cf004b14aa7c',
     ['00ae28b2d7dfc9799d67323e14ccc0cf378faa2e235b04c0f080480f0407a58a',
      'a7abae393cef5516e9c84d39895903986dc607b99194af827c8aaf5092d62773',
      '221ddef57ce392c5b8460a20942fcded126d8b1ec15a9c3517cf8417f738f39e']),
    ('sha256', '12345', 'A', 16, None,
     '8f995978c48967714d1c4b239d0d87996a2b087980037bef700ead42eecc754c',
     ['fb4a5a02da5a7614f52b9ba7173274e36b7aabadd41356c5594d31c863969a8b',
      '54816276cdb8e75c09a0075ef18c820e600e28512912a617896b598630762182']),
    ('sha256', '12345', 'B', 16, None,
     '8f995978c48967714d1c4b239d0d87996a2b087980037bef700ead42eecc754c',
     ['1c8e1b61a39a4d5f68083f6e9ea63e7f60577cb0a2a8356fc47dbeb924ecc2b9',
      '9f84c1a6f086ae524ba1c1b9d27404aa06475c77941b9fc78e4e68fb091b9b65',
      'd10bfe7d44e199dc4f71070cd4debb2ecc0b739d58e5a89a1d5bc8194ac244f4']),
    ('sha256', '0', 'A', 16, 'tenant-a',
     '1973e23848344dc43a988a9b478663803cfffe1243480253f9a3cf004b14aa7c',
     ['206f5c8f01fd7ac9c1ac3126fccc8f865a6c5a2805f967732730ac114ef721dd',
      '0610465623c74eacb4fe36384fa6a323fdfd771d97531107714bec2e900bed96']),
    ('sha256', '0', 'B', 8, None,
     '1973e23848344dc43a988a9b478663803cfffe1243480253f9a3cf004b14aa7c',
     ['ae98e9280b028618478bc207072ac9e2bf6c64d12794a15ffeeecb2c9cbc1221',
      '036f5202c0453f22f7f63ccf9eb1818f602ea8d0a8cb2921805ae03f9fc9e2bc',
      '3805ea84e70af6e22042fe5b678b0acbed41a5df5c281b4db947f5ca7f2c257f',
      '47ceb50cd9cb141908891a1fcaa2e4eb275efd9ba43ff0fc58ea827d0987bdf2',
      '7a9e9be200f6f797893af655b68e15a3a757d2d27df969a54f3923534c09d5c4',
      '63394db56f75559b60b200085b3a216ebbdde1514c02ceac6b16ad499fe131ed']),
    ('sha256_cbor', None, 'A', 16, None,
     '9bd96a485ad84efdafb72ee48a1d7a69bcead0f8f0433173941b276b9581eef0',
     ['cd7c51bc5a8fc8643f383a2b9e01522fba7473c669e9270c7b0bf7bf7fd01682',
      '2533ea50426b36e9e4d68296cac6bce8cf602e46957d0fe40b368b33d87bf3bf']),
    ('sha256_cbor', None, 'B', 16, None,
     '9bd96a485ad84efdafb72ee48a1d7a69bcead0f8f0433173941b276b9581eef0',
     ['004c366bb040083af7c5581ca33ec9c1dfd474539ccbdd61fe256ce6f6aa1f21',
      '8460802f156ec3429c0a4e7b39f3b0d849b34c26995f765b0f25d9a970679542',
      '0b4d2f6d76097f0a3b521ce2c527c5890019587c49680673191b91556688612e']),
    ('sha256_cbor', '0', 'A', 16, None,
     '4e1195df020de59e0d65a33a4279f1183e7ae4e5d980e309f8b55adff2e61c3e',
     ['202da172482d928bbc42ab25b0151e2b895f13f41002e27b2ceabcfae6d332ea',
      '4a0a393805c6d2f0ed831000d41bb65980336c4c04895d5e26470bbec927f5bf']),
    ('sha256_cbor', '0', 'B', 16, None,
     '4e1195df020de59e0d65a33a4279f1183e7ae4e5d980e309f8b55adff2e61c3e',
     ['43049e3e9c658221aa57465b20b632e5963a9d500158da51dadd5c24ceac558f',
      'e34fa3388eaad6aeaa7919d3526a3fdc9f5e6f5c26296b43896175b5217ef3df',
      'e9f51f8c77f15c8f9dbfc6dab4adb43de488e01ed70caf54273d6dd60b3d986d']),
    ('sha256_cbor', '12345', 'A', 16, None,
     '7292412b7aee6c72390673c639cb26bbadd61da0cb7af52fea097bf4c7b340b2',
     ['ee6f104e27ab3dee1e8977187646e8f67100bb8f2f1f27ce6e479ed4e70b3bf0',
      'c6fe2e1dc1ab3dc66c9caa66e373dde62d16baca630732c4a88e866b4494fa84']),
    ('sha256_cbor', '12345', 'B', 16, None,
     '7292412b7aee6c72390673c639cb26bbadd61da0cb7af52fea097bf4c7b340b2',
     ['bbfca9bd0fc75cf77473bddc74f1538ee052d7c54559d92a3af9bdeeb393eaa1',
      'd089f19e00d3202c99eb05608b030e1d3a71dc57998a5297911a7979949ee319',
      'f6d8de4a493ba2725534cd1ad4cb99830e2484006da15ec15143f54baa29bfd2']),
    ('sha256_cbor', '0', 'A', 16, 'tenant-a',
     '4e1195df020de59e0d65a33a4279f1183e7ae4e5d980e309f8b55adff2e61c3e',
     ['c71ed03162c142001441c39eb65b64194bc942ce09164e592f18a74403ce4052',
      '1718d1718441b36cc087fe92a929bdd9217b8572c610a26507b241a2e727c572']),
    ('sha256_cbor', '0', 'B', 8, None,
     '4e1195df020de59e0d65a33a4279f1183e7ae4e5d980e309f8b55adff2e61c3e',
     ['82e4f670c37fe99e13c8b36f446c41e9f029e249d37e2c058c1c40afdd7c33ce',
      'ca6199f5a4e0c72a00a08d0c0c2eaf381095b7a8d414926b15696601a5581927',
      '0aae452e6aaa8f6daba24e8c1e13c295fe66f02fe5218a73d7985f4e085c8608',
      'e839b14b73cf5ad8c1a05316e015009fd92dcfeecb442f38d809d5a6d56cce1e',
      '21ddbd896c3be172148a3f2fba7e197d6a28a0fea16a5912b89f604d53fe0ca9',
      '65cf911557db627094ce98c2bcc404155cc055bee3ff6e8d94f14173f4e77ab7']),
    ('xxhash', '0', 'A', 16, None,
     '6fb31cc38bba6066183f7f2104b9c051',
     ['6ba7d7fc1608e5f0a4612b1b0c87458f',
      'dbd92304eaa08219c5cf8f4ce18166b6']),
    ('xxhash', '0', 'B', 16, None,
     '6fb31cc38bba6066183f7f2104b9c051',
     ['2567cbd68515c27dd184572ead3e2bb4',
      '7dd1145e678edf091fc17ed49f5bcf7e',
      'a19ccd658bf4f17eba8e92d050175435']),
    ('xxhash', '12345', 'A', 16, None,
     'ef4fe5e77aea9114c6f2cf05822b3571',
     ['314a67965dec9774c62a9627902d1ae8',
      '83d985f23f420cbdd945a162532e9383']),
    ('xxhash', '12345', 'B', 16, None,
     'ef4fe5e77aea9114c6f2cf05822b3571',
     ['c3517fe93d22d6a6e34654830975cef9',
      'e7ea3479ae0f16918c96995c85521fdf',
      '508265bc43f3f1440bf63896b32928aa']),
    ('xxhash', '0', 'A', 16, 'tenant-a',
     '6fb31cc38bba6066183f7f2104b9c051',
     ['37071f20baa01dc2cb3a8d73915b0f4d',
      '0c11d6033568ca579e1bc02006c9ec4b']),
    ('xxhash', '0', 'B', 8, None,
     '6fb31cc38bba6066183f7f2104b9c051',
     ['b3f06502924936cdb6cd4cb82fe705e1',
      '40d3bf40413674cb04351782e7a10f27',
      '1e1d0c70b812720656013174dfc0feea',
      'de3291fbcdd98854fc4e63a8bc029e99',
      'f7599bcfa33730aec1ce6883d9f54b93',
      '2e9b83dcffd9c561d703667bf43f80d2']),
    ('xxhash_cbor', '0', 'A', 16, None,
     '1ebe36576dcb573f26b99533a20aaeca',
     ['c2d7a75070fc6d6b0c3fb0af456c1009',
      '93add93233ea572fb2e2b1685bac6f8d']),
    ('xxhash_cbor', '0', 'B', 16, None,
     '1ebe36576dcb573f26b99533a20aaeca',
     ['0cdad6b38fb26d7af9c130539c5f0d3a',
      'e9393616130a211519283451e5a03b0f',
      'f4c98a8ba5305981c5da1c154285fc23']),
    ('xxhash_cbor', '12345', 'A', 16, None,
     '71c23af9c69f9961f42bc1307108debb',
     ['9a4b720e82d656321f793e0cda1e20c3',
      'a6a78e508f064a38e11cc7eb87bf4368']),
    ('xxhash_cbor', '12345', 'B', 16, None,
     '71c23af9c69f9961f42bc1307108debb',
     ['f669cbe6cc0ef84e07849da840aacc5a',
      'dd1b753c6c5005422dc985a69c672e57',
      '217ce4d7247bb3c698c6209407bee0e5']),
    ('xxhash_cbor', '0', 'A', 16, 'tenant-a',
     '1ebe36576dcb573f26b99533a20aaeca',
     ['6ba788d76f82ca15dc20165ecc7c65d7',
      '852979bb9d780ee1ca17bc71b6da84f9']),
    ('xxhash_cbor', '0', 'B', 8, None,
     '1ebe36576dcb573f26b99533a20aaeca',
     ['e9093d631fcb772a7a831e764e245394',
      'fabc3c13a9084b2cc21f2843c4d048c3',
      'e1b9b95cf76551db0e90f377f01cbf47',
      'ca18b6e358673c79c94478d69a5ee686',
      '0debdd67bdf30721c9f7aa76d178ab35',
      '2d50866f1cd618feb44c34786e03e8a6']),
    ('sha256', '', 'A', 16, None,
     '3279c4b947f331d055c47442171c9ea17712596bd7fe094c31d4a5d432b42d68',
     ['f2fc3e5a419b0b01356d6038570bcb3e853f2e1d0bc00a43e395e2413d9ea970',
      '1be5e574654c586b94bc91d944d57071258fa51259d2772ba31dcf8ad98ed01c']),
    ('xxhash', '', 'A', 16, None,
     '6b3b164a79fc6c08c6efa28fc1922294',
     ['c3b65e1c01481275735fb2b98dc0fdd6',
      'a6e5885c6bcd2328cdf24c8bde09b5a6']),
]


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
    assert chain_from_tokens(PROMPTS[prompt], bs, algo, seed) == published
    if seed is not None:
        monkeypatch.setenv("PYTHONHASHSEED", seed)
        assert chain_from_tokens(PROMPTS[prompt], bs, algo) == published
        monkeypatch.setenv("PYTHONHASHSEED", "not-" + seed)  # the flag wins over the environment
        assert chain_from_tokens(PROMPTS[prompt], bs, algo, seed) == published
        assert chain_from_tokens(PROMPTS[prompt], bs, algo) != published


@pytest.mark.parametrize("algo", ["xxhash", "xxhash_cbor"])
def test_xxhash_without_a_seed_is_refused_with_the_reason(algo):
    with pytest.raises(UnmatchableSeed) as e:
        chain_from_tokens(PROMPTS["A"], 16, algo)
    msg = str(e.value)
    assert "random" in msg and "per engine process" in msg and "no router can compute" in msg
    assert "PYTHONHASHSEED" in msg and "--hash-seed" in msg


def test_sha256_family_default_seed_and_unknown_algorithm():
    assert resolve_seed("sha256") == resolve_seed("sha256_cbor") == NONE_HASH_SEED == "vllm-none-hash"
    assert resolve_seed("xxhash", env={"PYTHONHASHSEED": "7"}) == "7"
    assert resolve_seed("sha256", env={"PYTHONHASHSEED": ""}) == ""  # set but empty is a seed, as in vLLM
    for bad in ("md5", "xxh3", "SHA256"):
        with pytest.raises(ValueError, match="unknown hash algorithm"):
            chain_from_tokens(PROMPTS["A"], 16, bad, "0")


# ---------------------------------------------------------------- kvbus lookup --tokens, every algorithm

def _run(argv, settings, capsys) -> tuple[int, str, str]:
    p = argparse.ArgumentParser()
    cli.add_lookup_args(p)
    code = cli.run_lookup(p.parse_args(argv), settings)
    out = capsys.readouterr()
    return code, out.out, out.err


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
