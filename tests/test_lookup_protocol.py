"""The lookup protocol (docs/lookup-protocol.md) from clients that are not kvbus's Python client.

A view is written by the real sink store (``RedisStore.apply``; ``ShardedRedisStore`` on a Redis
Cluster) on a private Redis, then every case is asked three ways and must give the same answer:
``kvbus lookup --json`` (kvbus.client.lookup_cli), ``redis-cli`` (the reply and the holder table read with
``--quoted-json``, decoded here by the rules of the protocol document, not by sinks' code), and the
Go package ``clients/go/kvbuslookup`` (go-redis) through its example ``examples/go-lookup``, whose
stdout must equal kvbus lookup's byte for byte. The Go package's own unit tests run here too.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

import msgspec
import pytest

from kvbus.client import Load, ViewClient, lookup_cli as cli
from kvbus.infra.scratch_redis import RedisServer
from kvbus.runtime.settings import Settings
from kvbus.schemas.events import BlockEvent, BlockStored, canonical_hash
from kvbus.schemas.lookup import LOOKUP_OPTIONS, MAX_PREDICT_TTL, option_args
from kvbus.sinks.view import functions
from kvbus.sinks.view.redis_store import RedisStore
from kvbus.sinks.view.sharded_store import ShardedRedisStore, shard_of
from tests.lookup_cli import lookup_args, lookup_json
from tests.vllm_hash_vectors import PROMPTS, VECTORS

REDIS_CLI = shutil.which("redis-cli") or "/usr/bin/redis-cli"
GO = shutil.which("go") or "/usr/local/go/bin/go"
EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "go-lookup"
GO_PACKAGE = Path(__file__).resolve().parent.parent / "clients" / "go" / "kvbuslookup"


def _h(i: int) -> bytes:
    return canonical_hash((0x9E3779B97F4A7C15 * (i + 1)) & (2**64 - 1))


CHAIN = [_h(i) for i in range(6)]
UNKNOWN = _h(1000)


def _vector_hashes(algo: str, seed: str | None, prompt: str = "B", block_size: int = 16) -> list[bytes]:
    (digests,) = [v[6] for v in VECTORS if (v[0], v[1], v[2], v[3], v[4]) == (algo, seed, prompt, block_size, None)]
    return [canonical_hash(bytes.fromhex(d)) for d in digests]


MODELS = {"a": "llama", "c": "llama", "b": "qwen", "vllm-sha256": "llama"}
"""The model of each replica's holders (by replica name; shared-<k>: llama for even k, qwen for odd k;
the others name no model)."""


def _records() -> list:
    """Holders: a (GPU 6 blocks, CPU 2), b#0 (GPU 1), b#1 (CPU@kvcr 3), c (GPU/g1 4; CPU 3 stored
    twice: counted), pod#x (a replica name with '#'; GPU 5), 24 holders of a shared 2-block prefix
    (a wide block), and engines holding a prompt as vLLM hashed it: prompt B with each algorithm
    (sha256 and sha256_cbor with the default seed, xxhash and xxhash_cbor with PYTHONHASHSEED=12345),
    in blocks of 8 (sha256, PYTHONHASHSEED=0), and prompt A with an empty PYTHONHASHSEED. Models:
    :data:`MODELS`."""
    out = []
    seq = {}

    def add(replica, dp, hashes, medium="GPU", ownership=None, group=None):
        n = seq[(replica, dp)] = seq.get((replica, dp), -1) + 1
        model = MODELS.get(replica) or (("llama", "qwen")[int(replica[7:]) % 2] if replica.startswith("shared-")
                                        else None)
        out.append(("kvbus.blocks", BlockEvent(
            replica=replica, dp_rank=dp, epoch=1, seq=n, index=0, ts=time.time(), model=model,
            event=BlockStored(block_hashes=hashes, medium=medium, ownership=ownership, group_idx=group))))

    add("a", 0, CHAIN)
    add("a", 0, CHAIN[:2], "CPU")
    add("b", 0, CHAIN[:1])
    add("b", 1, CHAIN[:3], "CPU", "kvcr")
    add("c", 0, CHAIN[:4], group=1)
    add("c", 0, CHAIN[:3], "CPU")
    add("c", 0, CHAIN[:3], "CPU")
    add("pod#x", 0, CHAIN[:5])
    for k in range(24):
        add(f"shared-{k}", 0, CHAIN[:2])
    add("vllm-sha256-cbor", 0, _vector_hashes("sha256_cbor", None))
    add("vllm-xxhash-cbor", 0, _vector_hashes("xxhash_cbor", "12345"), "CPU")
    add("vllm-sha256", 0, _vector_hashes("sha256", None))
    add("vllm-xxhash", 0, _vector_hashes("xxhash", "12345"))
    add("vllm-sha256-b8", 0, _vector_hashes("sha256", "0", block_size=8))
    add("vllm-sha256-empty-seed", 0, _vector_hashes("sha256", "", prompt="A"))
    return out


def _hybrid_records() -> list:
    """Hybrid-model holders (docs/lookup-protocol.md, "Hybrid models"), in this file's views: hybrid (full
    attention 6 blocks, a 48-token sliding window blocks 2-4: hits 5) and hybrid-miss (its window holds too
    little: no hit)."""
    def stored(replica, seq, hashes, group, kind, window=None):
        return ("kvbus.blocks", BlockEvent(replica=replica, dp_rank=0, epoch=1, seq=seq, index=0, ts=time.time(),
                                           event=BlockStored(block_hashes=hashes, medium="GPU", group_idx=group,
                                                             block_size=16, kv_cache_spec_kind=kind,
                                                             kv_cache_spec_sliding_window=window)))

    return [stored("hybrid", 0, CHAIN, 0, "full_attention"), stored("hybrid", 1, CHAIN[2:5], 1, "sliding_window", 48),
            stored("hybrid-miss", 0, CHAIN, 0, "full_attention"),
            stored("hybrid-miss", 1, CHAIN[3:5], 1, "sliding_window", 48)]


def _hashes(chain: list[bytes]) -> str:
    return ",".join(str(int.from_bytes(h, "big")) for h in chain)


TOKENS_A = ",".join(map(str, PROMPTS["A"]))
TOKENS_B = ",".join(map(str, PROMPTS["B"]))
CASES = {
    "all": ["--hashes", _hashes(CHAIN)],
    "replica-candidate": ["--hashes", _hashes(CHAIN), "--replicas", "b"],
    "mixed-candidates": ["--hashes", _hashes(CHAIN), "--replicas", "a,b#1,pod#x,nobody"],
    "unknown-candidates": ["--hashes", _hashes(CHAIN), "--replicas", "nobody,a#7"],
    "weights": ["--hashes", _hashes(CHAIN), "--weights", "cpu=0.25,kvcr=2,GPU=3"],
    "zero-weights": ["--hashes", _hashes(CHAIN), "--weights", "GPU=0,CPU=0,*=0"],
    "gap": ["--hashes", _hashes(CHAIN[:2] + [UNKNOWN] + CHAIN[3:])],
    "hex-and-signed": ["--hashes",
                       ",".join(["0x" + CHAIN[0].hex(), str(int.from_bytes(CHAIN[1], "big", signed=True))])],
    "nobody": ["--hashes", _hashes([UNKNOWN] + CHAIN)],
    "tokens-sha256-cbor": ["--tokens", TOKENS_B, "--algo", "sha256_cbor"],
    "tokens-xxhash-cbor": ["--tokens", TOKENS_B, "--algo", "xxhash_cbor", "--hash-seed", "12345"],
    "tokens-sha256": ["--tokens", TOKENS_B, "--algo", "sha256"],
    "tokens-xxhash": ["--tokens", TOKENS_B, "--algo", "xxhash", "--hash-seed", "12345"],
    "tokens-sha256-blocks-of-8": ["--tokens", TOKENS_B, "--algo", "sha256", "--hash-seed", "0", "--block-size", "8"],
    "tokens-sha256-empty-seed": ["--tokens", TOKENS_A, "--algo", "sha256", "--hash-seed", ""],
    "model": ["--hashes", _hashes(CHAIN), "--model", "llama"],
    "model-other": ["--hashes", _hashes(CHAIN), "--model", "qwen"],
    "model-and-candidates": ["--hashes", _hashes(CHAIN), "--model", "qwen", "--replicas", "a,b#1,pod#x,shared-3"],
    "model-of-nobody": ["--hashes", _hashes(CHAIN), "--model", "mistral"],
    "model-tokens": ["--tokens", TOKENS_B, "--algo", "sha256", "--model", "llama"],
    "predicted": ["--hashes", _hashes(CHAIN), "--predicted", "0.5"],
    "predicted-zero": ["--hashes", _hashes(CHAIN), "--predicted", "0"],
    "predicted-and-model": ["--hashes", _hashes(CHAIN), "--predicted", "0.25", "--model", "llama"],
    "predicted-and-candidates": ["--hashes", _hashes(CHAIN), "--predicted", "1", "--replicas", "b,vllm-sha256"],
}
EMPTY_CASES = {"nobody", "unknown-candidates", "model-of-nobody"}
"""The cases no holder answers."""


def _predict(view: ViewClient) -> None:
    """The predictions of this file's views (TTL 10 minutes: they outlast the module): pod#x the whole
    chain (it holds 5 blocks), b#0 its first 4 for qwen (it holds block 0), vllm-sha256 (llama's; nothing
    of the chain held) its first 3 for llama, naming the holder by its replica."""
    assert view.predict("pod#x#0", hashes=CHAIN, ttl=MAX_PREDICT_TTL) == 6
    assert view.predict("b#0", hashes=CHAIN[:4], ttl=MAX_PREDICT_TTL, model="qwen") == 4
    assert view.predict("vllm-sha256", hashes=CHAIN[:3], ttl=MAX_PREDICT_TTL, model="llama") == 3


def _kvbus_lookup(settings: Settings, prefix: str, argv: list[str], capsys) -> str:
    return lookup_json(argv, settings, prefix, capsys)


# ---------------------------------------------------------------- redis-cli

def _quote(arg: str | bytes) -> str:
    """One argument for ``redis-cli --quoted-input``: every byte as \\xHH."""
    raw = arg.encode() if isinstance(arg, str) else arg
    return '"' + "".join(f"\\x{b:02x}" for b in raw) + '"'


_ESC = re.compile(r'\\(x[0-9a-fA-F]{2}|[\\"nrtab])')
_ESC_CHARS = {"\\": b"\\", '"': b'"', "n": b"\n", "r": b"\r", "t": b"\t", "a": b"\a", "b": b"\b"}


def _bytes(s: str) -> bytes:
    """A string of ``redis-cli --quoted-json`` output: printable ASCII as is, other bytes escaped."""
    return _ESC.sub(lambda m: (chr(int(m.group(1)[1:], 16)) if m.group(1)[0] == "x" else
                               _ESC_CHARS[m.group(1)].decode("latin-1")), s).encode("latin-1")


def _quoted_json(out: str) -> Any:
    """``redis-cli --quoted-json`` output decoded. redis-cli 7.0 writes each string as its C-escaped
    form (``\\xHH``, ``\\"``, ``\\\\``) with the backslashes JSON-escaped but the escaped quote not: a
    quote byte (e.g. in a holder-id blob, hid 34) comes out as ``\\"`` inside the string, which is
    made valid JSON here before it is parsed."""
    fixed: list[str] = []
    i, in_string = 0, False
    while i < len(out):
        if in_string and out.startswith("\\\\", i):  # a C escape: its backslash, JSON-escaped
            code = out[i + 2:i + 3]
            if code == '"':
                fixed.append('\\\\\\"')
                i += 3
            elif out.startswith("\\\\", i + 2):
                fixed.append("\\\\\\\\")
                i += 4
            else:
                fixed.append("\\\\")
                i += 2
            continue
        if in_string and out[i] == "\\":  # a JSON escape of redis-cli's own
            fixed.append(out[i:i + 2])
            i += 2
            continue
        if out[i] == '"':
            in_string = not in_string
        fixed.append(out[i])
        i += 1
    return json.loads("".join(fixed))


def redis_cli(port: int, *args: str | bytes, cluster: bool = False) -> Any:
    cmd = [REDIS_CLI, "-p", str(port), *(["-c"] if cluster else []), "--quoted-input", "--quoted-json",
           *map(_quote, args)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=20, check=True).stdout
    if out.startswith("error:"):
        raise RuntimeError(out[len("error:"):].strip())  # an error reply (not valid JSON: printed as is)
    return _quoted_json(out)


def _label(desc: str) -> str:
    medium, ownership, group = desc.split("|")
    return medium + (f"@{ownership}" if ownership else "") + (f"/g{group}" if group not in ("", "0") else "")


def redis_cli_answer(port: int, views: list[tuple[str, list[str]]], chain: list[bytes], spec: str,
                     cands: list[str], cluster: bool = False, model: str | None = None,
                     predicted: str | None = None) -> dict:
    """kvbus lookup's JSON answer computed from redis-cli's output by docs/lookup-protocol.md."""
    options = [b"\0model", model] if model is not None else []
    options += [b"\0predicted", predicted] if predicted is not None else []
    holders, ranks = [], {}
    for prefix, _ in views:
        names = {int(k): v for k, v in redis_cli(port, "HGETALL", prefix + "hname", cluster=cluster).items() if k}
        split = {hid: (n.rpartition("#")[0], int(n.rpartition("#")[2])) for hid, n in names.items()}
        for replica, _dp in split.values():
            ranks[replica] = ranks.get(replica, 0) + 1
        holders.append(split)
    rows = []
    for (prefix, keys), split in zip(views, holders):
        head, blobs, descs = redis_cli(port, "FCALL_RO", "kvbus_lookup", str(len(keys)), *keys, prefix,
                                       b"".join(chain), spec, *options, *cands, cluster=cluster)
        labels = {descs[j]: _label(descs[j + 1]) for j in range(0, len(descs), 2)}
        k = 0
        answers = []
        for blob in map(_bytes, blobs):
            matched, score, n = head[k], head[k + 1], head[k + 2]
            tiers = {labels[head[k + 3 + 2 * j]]: head[k + 4 + 2 * j] for j in range(n)}
            k += 3 + 2 * n
            answers.append((blob, {"matched": matched, "tiers": dict(sorted(tiers.items())), "score": score / 1e6}))
        if k < len(head):  # the trailing part: per group, its KV cache groups' runs (hybrid models)
            for _, value in answers:
                n = head[k]
                if n:
                    value["groups"] = {str(g): r for g, r in sorted((head[k + 1 + 2 * j], head[k + 2 + 2 * j])
                                                                    for j in range(n))}
                k += 1 + 2 * n
        for blob, value in answers:
            for j in range(0, len(blob), 4):
                replica, dp = split[int.from_bytes(blob[j:j + 4], "big")]
                name = replica if ranks[replica] <= 1 and dp == 0 else f"{replica}#{dp}"
                groups = {"groups": value["groups"]} if "groups" in value else {}
                rows.append((name, {"matched": value["matched"], "tiers": value["tiers"], "score": value["score"],
                                    "replica": replica, "dp_rank": dp, **groups}))
    rows.sort(key=lambda r: (-r[1]["score"], -r[1]["matched"], r[0]))
    return dict(rows)


# ---------------------------------------------------------------- the Go example

def _need_go() -> None:
    if not os.path.exists(GO):
        if os.environ.get("CI"):
            pytest.fail(f"no Go toolchain at {GO}: the Go client of the lookup protocol is not tested")
        pytest.skip(f"no Go toolchain ({GO})")


@pytest.fixture(scope="module")
def go_lookup(tmp_path_factory) -> Path:
    """examples/go-lookup built once, with the Go package through its replace directive (go-redis and
    xxh3 from the Go module proxy; ~25 s with a cold build cache, ~1 s warm)."""
    _need_go()
    out = tmp_path_factory.mktemp("go") / "kvbus-lookup-go"
    subprocess.run([GO, "build", "-mod=readonly", "-buildvcs=false", "-o", str(out), "."],
                   cwd=EXAMPLE, check=True, timeout=600)
    return out


@pytest.mark.timeout(2 * 600 + 60)  # the two commands' own budgets: a cold build compiles the standard library
def test_go_package_unit_tests_and_vet():
    """The Go package's own tests (ranking and tie-breaks, reply decoding, weights, JSON form) and go vet."""
    _need_go()
    for cmd in ([GO, "vet", "./..."], [GO, "test", "-count=1", "./..."]):
        r = subprocess.run(cmd, cwd=GO_PACKAGE, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, f"{' '.join(cmd)}:\n{r.stdout}{r.stderr}"


def _go_argv(argv: list[str]) -> list[str]:
    """kvbus lookup's flags as the Go example's (same names, one dash)."""
    return [a[1:] if a.startswith("--") else a for a in argv]


def go(binary: Path, target: list[str], prefix: str, argv: list[str], env: dict | None = None):
    return subprocess.run([str(binary), *target, "-prefix", prefix, *_go_argv(argv)], capture_output=True,
                          text=True, timeout=30, env={**os.environ, **(env or {})})


# ---------------------------------------------------------------- single node

@pytest.fixture(scope="module")
def view():
    with RedisServer() as srv:
        prefix = f"p{uuid.uuid4().hex[:8]}:"
        RedisStore(srv.client(), prefix).apply(_records() + _hybrid_records())
        with ViewClient(srv.url, prefix) as v:
            _predict(v)
        yield srv, prefix


def _spec_and_cands(argv: list[str]) -> tuple[list[bytes], str, list[str], dict[str, str | None]]:
    """What kvbus lookup sends for these flags: the chain, ARGV[3], the candidates and the options (model,
    predicted weight: redis_cli_answer's keywords)."""
    from kvbus.client.lookup_cli import parse_hashes, parse_tokens
    from kvbus.schemas.hashing import block_hashes
    from kvbus.sinks.view.refcounts import Weights

    a = lookup_args(argv)
    chain = parse_hashes(a.hashes) if a.hashes else block_hashes(parse_tokens(a.tokens), a.block_size, a.algo,
                                                                      a.hash_seed)
    cands = [c.strip() for c in (a.replicas or "").split(",") if c.strip()]
    return chain, Weights.parse(a.weights).spec(), cands, {"model": a.model, "predicted": a.predicted}


@pytest.mark.parametrize("case", sorted(CASES))
def test_redis_cli_gets_kvbus_lookups_answer(view, capsys, case):
    srv, prefix = view
    argv = CASES[case]
    answer = json.loads(_kvbus_lookup(Settings(redis_url=srv.url), prefix, argv, capsys))
    if case not in EMPTY_CASES:
        assert answer, "the case finds holders"
    chain, spec, cands, options = _spec_and_cands(argv)
    got = redis_cli_answer(srv.port, [(prefix, [])], chain, spec, cands, **options)
    assert list(got.items()) == list(answer.items())  # same holders, values and order


@pytest.mark.parametrize("case", sorted(CASES))
def test_go_prints_kvbus_lookups_answer(view, go_lookup, capsys, case):
    srv, prefix = view
    want = _kvbus_lookup(Settings(redis_url=srv.url), prefix, CASES[case], capsys)
    g = go(go_lookup, ["-addr", f"127.0.0.1:{srv.port}"], prefix, CASES[case])
    assert (g.returncode, g.stderr) == (0, "")
    assert g.stdout == want


def test_the_view_is_what_the_cases_assume(view, capsys):
    srv, prefix = view
    got = json.loads(_kvbus_lookup(Settings(redis_url=srv.url), prefix, CASES["all"], capsys))
    assert got["a"] == {"matched": 6, "tiers": {"CPU": 2, "GPU": 6}, "score": 6.0, "replica": "a", "dp_rank": 0}
    assert got["b#1"]["tiers"] == {"CPU@kvcr": 3} and got["c"]["tiers"] == {"CPU": 3, "GPU/g1": 4}
    assert got["pod#x"]["matched"] == 5 and got["shared-7"]["matched"] == 2
    assert got["hybrid"] == {"matched": 5, "tiers": {"GPU": 6}, "score": 5.0, "replica": "hybrid", "dp_rank": 0,
                             "groups": {"0": 6, "1": 5}}
    assert "hybrid-miss" not in got and "groups" not in got["a"]
    assert len(got) == 6 + 24
    assert srv.client().exists(prefix.encode() + b"W:" + CHAIN[0]), "block 0 is wide (over 20 members)"
    llama = json.loads(_kvbus_lookup(Settings(redis_url=srv.url), prefix, CASES["model"], capsys))
    assert set(llama) == {"a", "c"} | {f"shared-{k}" for k in range(0, 24, 2)} and llama["a"] == got["a"]
    assert set(json.loads(_kvbus_lookup(Settings(redis_url=srv.url), prefix, CASES["model-and-candidates"],
                                        capsys))) == {"b#1", "shared-3"}


def test_layout_version_is_in_the_views_meta(view):
    srv, prefix = view
    assert functions.layout_version() == "3"
    assert redis_cli(srv.port, "HGET", prefix + "meta", "layout") == functions.layout_version()


def test_go_refuses_a_view_of_another_layout_and_the_function_names_the_cause(view, go_lookup):
    srv, _ = view
    prefix = f"o{uuid.uuid4().hex[:8]}:"
    RedisStore(srv.client(), prefix).apply(_records()[:1])
    srv.client().hset(prefix + "meta", "layout", "2")
    g = go(go_lookup, ["-addr", f"127.0.0.1:{srv.port}"], prefix, CASES["all"])
    assert g.returncode == 2 and "has layout 2; this client speaks 3" in g.stderr
    with pytest.raises(RuntimeError, match="older key layout"):
        redis_cli(srv.port, "FCALL_RO", "kvbus_lookup", "0", prefix, b"".join(CHAIN), "")


def test_errors_of_the_call(view):
    srv, prefix = view
    with pytest.raises(RuntimeError, match=r'KEYS\[1\] must be the prefix'):
        redis_cli(srv.port, "FCALL_RO", "kvbus_lookup", "1", prefix + "x", prefix, b"".join(CHAIN), "")
    with pytest.raises(RuntimeError, match="string expected, got nil"):  # ARGV[3] is required
        redis_cli(srv.port, "FCALL_RO", "kvbus_lookup", "0", prefix, b"".join(CHAIN))
    assert redis_cli(srv.port, "FCALL_RO", "kvbus_lookup", "0", prefix, b"", "") == [[], [], []]
    with pytest.raises(RuntimeError, match="(?i)function not found"):
        redis_cli(srv.port, "FCALL_RO", "kvbus_nosuch", "0", prefix)


def test_errors_of_the_model_option(view):
    srv, prefix = view
    chain = b"".join(CHAIN)
    with pytest.raises(RuntimeError, match='kvbus: unknown lookup option tenant'):
        redis_cli(srv.port, "FCALL_RO", "kvbus_lookup", "0", prefix, chain, "", b"\0tenant", "x")
    for bad in ([b"\0model"], [b"\0model", ""], ["a", b"\0model"]):
        with pytest.raises(RuntimeError, match="kvbus: lookup option model needs a model name"):
            redis_cli(srv.port, "FCALL_RO", "kvbus_lookup", "0", prefix, chain, "", *bad)
    # options and candidates in any order: the same answer
    first = redis_cli(srv.port, "FCALL_RO", "kvbus_lookup", "0", prefix, chain, "", b"\0model", "qwen", "b")
    assert first == redis_cli(srv.port, "FCALL_RO", "kvbus_lookup", "0", prefix, chain, "", "b", b"\0model", "qwen")
    assert len(first[1]) == 2, "b#0 and b#1, qwen's, answer as two groups"


def test_errors_of_the_predicted_option(view):
    srv, prefix = view
    chain = b"".join(CHAIN)
    for bad in ([b"\0predicted"], [b"\0predicted", ""], [b"\0predicted", "x"], [b"\0predicted", "-1"],
                [b"\0predicted", "inf"], [b"\0predicted", "nan"]):
        with pytest.raises(RuntimeError, match=r"kvbus: lookup option predicted needs a weight \(a number >= 0\)"):
            redis_cli(srv.port, "FCALL_RO", "kvbus_lookup", "0", prefix, chain, "", *bad)
    first = redis_cli(srv.port, "FCALL_RO", "kvbus_lookup", "0", prefix, chain, "", b"\0predicted", "1", "b",
                      b"\0model", "qwen")
    assert first == redis_cli(srv.port, "FCALL_RO", "kvbus_lookup", "0", prefix, chain, "", b"\0model", "qwen",
                              "b", b"\0predicted", "1")
    descs = first[2]
    assert dict(zip(descs[::2], descs[1::2]))[64] == "predicted||0", "the pseudo tier's code and descriptor"


def test_predicted_entries_change_only_the_answers_of_lookups_with_the_option(view, capsys):
    srv, prefix = view
    settings = Settings(redis_url=srv.url)
    before = json.loads(_kvbus_lookup(settings, prefix, CASES["all"], capsys))
    got = json.loads(_kvbus_lookup(settings, prefix, CASES["predicted"], capsys))
    assert got["pod#x"] == {"matched": 6, "tiers": {"GPU": 5, "predicted": 6}, "score": 5.5, "replica": "pod#x",
                            "dp_rank": 0}
    assert got["b#0"]["tiers"] == {"GPU": 1, "predicted": 4} and got["b#0"]["score"] == 2.5
    assert got["vllm-sha256"] == {"matched": 3, "tiers": {"predicted": 3}, "score": 1.5, "replica": "vllm-sha256",
                                  "dp_rank": 0}
    predicted = ("pod#x", "b#0", "vllm-sha256")
    assert {k: v for k, v in got.items() if k not in predicted} == \
        {k: v for k, v in before.items() if k not in predicted}, "holders without predictions answer as without it"
    llama = json.loads(_kvbus_lookup(settings, prefix, CASES["predicted-and-model"], capsys))
    assert llama["vllm-sha256"]["matched"] == 3 and "b#0" not in llama and "pod#x" not in llama
    assert "predicted" not in json.dumps(before)


def test_the_lookup_options_are_declared_once_and_every_reader_takes_them_from_there():
    """Python's declaration (kvbus.schemas.lookup.LOOKUP_OPTIONS) is what the Go package lists, what
    ``kvbus lookup`` has flags for and what :func:`option_args` checks."""
    text = (GO_PACKAGE / "protocol.go").read_text()
    body = re.search(r"var LookupOptions = \[\]LookupOption\{\n(.*?)\n\}", text, re.S)
    assert body, "protocol.go declares no LookupOptions"
    go = re.findall(r'\{"([^"]+)", "([^"]+)"\}', body.group(1))
    assert go == [(o.name, o.meaning) for o in LOOKUP_OPTIONS]
    parser = argparse.ArgumentParser()
    cli.add_lookup_args(parser)
    flags = {a.dest: a.help for a in parser._actions}
    assert all(flags.get(o.name) == o.meaning for o in LOOKUP_OPTIONS)
    assert option_args() == [] and option_args(model=None) == []
    assert option_args(model="qwen") == ["\0model", "qwen"]
    assert option_args(predicted=0.5, model="qwen") == ["\0model", "qwen", "\0predicted", "0.5"]
    assert option_args(predicted="2") == ["\0predicted", "2.0"] and option_args(predicted=0) == ["\0predicted", "0.0"]
    for bad in (-0.5, float("nan"), float("inf"), "x"):
        with pytest.raises(ValueError):
            option_args(predicted=bad)
    with pytest.raises(ValueError):
        option_args(model="")
    with pytest.raises(TypeError, match="tenant"):
        option_args(tenant="x")


# ---------------------------------------------------------------- views and readers from before models

def _without_models(records: list) -> list:
    return [(t, msgspec.structs.replace(ev, model=None)) for t, ev in records]


def _old_apply_args(store: RedisStore, records: list) -> list[list]:
    """The ``kvbus_apply`` calls a sink of the release before models sends: no model names after the
    view id and offsets (or neither of them)."""
    return [args for _, args, _ in store.packer.calls(records)]


@pytest.fixture(scope="module")
def old_view(view):
    """The records of ``view`` as a sink before models wrote them: old-shaped ``kvbus_apply`` calls."""
    srv, _ = view
    prefix = f"old{uuid.uuid4().hex[:8]}:"
    store = RedisStore(srv.client(), prefix)
    for args in _old_apply_args(store, _records() + _hybrid_records()):
        store.transport.call("kvbus_apply", *args)
    return srv, prefix


def test_a_view_written_before_models_has_no_model_keys_and_answers_as_before(view, old_view, capsys):
    srv, old = old_view
    _, new = view
    keys = {k[len(old):] for k in srv.client().scan_iter(match=old + "*", count=1000)}
    assert b"mh" not in keys and not any(srv.client().hexists(old + k.decode(), "m") for k in keys
                                         if k.startswith(b"H:"))
    model_less = RedisStore(srv.client(), f"n{uuid.uuid4().hex[:8]}:")
    model_less.apply(_without_models(_records() + _hybrid_records()))
    assert sorted(srv.client().scan_iter(match=model_less.prefix + "*", count=1000)) == sorted(
        model_less.prefix.encode() + k for k in keys), "events without a model write the old view's keys"
    for case in ("all", "mixed-candidates", "weights", "tokens-sha256"):
        chain, spec, cands, _ = _spec_and_cands(CASES[case])
        old_shaped = ["FCALL_RO", "kvbus_lookup", "0"]
        replies = [redis_cli(srv.port, *old_shaped, p, b"".join(chain), spec, *cands) for p in (old, new)]
        assert replies[0] == replies[1], "an old-shaped call answers the same on a view with models"
        assert _kvbus_lookup(Settings(redis_url=srv.url), old, CASES[case], capsys) == \
            _kvbus_lookup(Settings(redis_url=srv.url), new, CASES[case], capsys)


def test_a_new_reader_on_a_view_before_models_finds_no_holder_of_a_model_until_it_names_one(old_view, go_lookup,
                                                                                            capsys):
    srv, old = old_view
    assert json.loads(_kvbus_lookup(Settings(redis_url=srv.url), old, CASES["model"], capsys)) == {}
    g = go(go_lookup, ["-addr", f"127.0.0.1:{srv.port}"], old, CASES["model"])
    assert (g.returncode, g.stdout.strip()) == (0, "{}"), g.stderr
    store = RedisStore(srv.client(), old)
    store.apply([("kvbus.blocks", BlockEvent(replica="a", epoch=1, seq=100, index=0, ts=time.time(), model="llama",
                                             event=BlockStored(block_hashes=CHAIN[5:], medium="GPU")))])
    got = json.loads(_kvbus_lookup(Settings(redis_url=srv.url), old, CASES["model"], capsys))
    assert list(got) == ["a"] and got["a"]["matched"] == 6, "its next event names the holder's model"
    for args in _old_apply_args(store, [("kvbus.blocks", BlockEvent(
            replica="a", epoch=1, seq=101, index=0, ts=time.time(), event=BlockStored(block_hashes=CHAIN[:1])))]):
        store.transport.call("kvbus_apply", *args)  # an older sink still running: its calls leave models as they are
    assert list(json.loads(_kvbus_lookup(Settings(redis_url=srv.url), old, CASES["model"], capsys))) == ["a"]


# ---------------------------------------------------------------- the Go package's own test against Redis

def _model_view_records() -> list:
    """The view the Go package's TestLookupNamingAModelAnswersOnlyItsHolders reads (model_redis_test.go)."""
    chain = [canonical_hash(i) for i in (1, 2, 3)]
    return [("kvbus.blocks", BlockEvent(replica=r, epoch=1, seq=0, index=0, ts=time.time(), model=m,
                                        event=BlockStored(block_hashes=chain[:n], medium="GPU")))
            for r, m, n in (("l0", "llama", 3), ("l1", "llama", 2), ("q0", "qwen", 3), ("u0", None, 3))]


def test_go_package_lookups_naming_a_model_on_redis_and_redis_cluster():
    """``go test`` of the Go package against a view the sink store wrote, on a Redis and a Redis Cluster."""
    _need_go()
    from kvbus.infra.scratch_cluster import RedisClusterServer

    prefix = f"g{uuid.uuid4().hex[:8]}:"
    with RedisServer() as srv, RedisClusterServer(3) as cl:
        RedisStore(srv.client(), prefix).apply(_model_view_records())
        ShardedRedisStore(cl.url, prefix).apply(_model_view_records())
        env = {**os.environ, "KVBUS_TEST_PREFIX": prefix, "KVBUS_TEST_REDIS_ADDR": f"127.0.0.1:{srv.port}",
               "KVBUS_TEST_CLUSTER_ADDRS": ",".join(f"{n.host}:{n.port}" for n in cl.nodes if n.master)}
        r = subprocess.run([GO, "test", "-count=1", "-v", "-run",
                            "TestLookupNamingAModel|TestSharedLoad|TestPredictThenLookup", "./..."],
                           cwd=GO_PACKAGE, capture_output=True, text=True, timeout=600, env=env, check=False)
        # the Go router's report, as Python's client reads it, on both
        loads = [ViewClient(url, prefix).load() for url in (srv.url, cl.url)]
    assert r.returncode == 0, r.stdout + r.stderr
    assert "--- PASS: TestLookupNamingAModelAnswersOnlyItsHolders" in r.stdout and "SKIP" not in r.stdout
    assert "--- PASS: TestSharedLoadReportedByAGoRouter" in r.stdout
    assert "--- PASS: TestPredictThenLookupWithThePredictedOption" in r.stdout
    assert loads == [{"l0": Load(2, 64)}] * 2


def test_status_key_as_routers_read_it(view, go_lookup):
    srv, _ = view
    store = RedisStore(srv.client(), f"s{uuid.uuid4().hex[:8]}:", load=False)
    target = ["-addr", f"127.0.0.1:{srv.port}"]
    assert store.status()["state"] == "missing" and redis_cli(srv.port, "HGETALL", store.prefix + "status") == {}
    assert "view is missing" in go(go_lookup, target, store.prefix, CASES["all"]).stderr
    store.apply(_records()[:2])
    assert store.status()["state"] == "ready"
    assert go(go_lookup, target, store.prefix, CASES["all"]).stderr == ""
    store.set_status(state="rebuilding", since=12.5, phase="replaying")
    assert redis_cli(srv.port, "HGETALL", store.prefix + "status") == {"state": "rebuilding", "since": "12.5",
                                                                        "phase": "replaying"}
    g = go(go_lookup, target, store.prefix, CASES["all"])
    assert g.returncode == 0 and "view is rebuilding" in g.stderr


def test_a_read_only_acl_user_is_enough(view, go_lookup, capsys):
    srv, prefix = view
    srv.client().acl_setuser("router", enabled=True, passwords=["+pw"], keys=[f"%R~{prefix}*"],
                             commands=["-@all", "+@read", "+fcall_ro"])
    want = _kvbus_lookup(Settings(redis_url=srv.url), prefix, CASES["all"], capsys)
    g = go(go_lookup, ["-addr", f"127.0.0.1:{srv.port}", "-user", "router"], prefix, CASES["all"],
           env={"REDIS_PASSWORD": "pw"})
    assert (g.returncode, g.stdout) == (0, want), g.stderr
    g = go(go_lookup, ["-addr", f"127.0.0.1:{srv.port}", "-user", "router"], prefix, CASES["all"],
           env={"REDIS_PASSWORD": "wrong"})
    assert g.returncode == 2


def test_go_hashes_tokens_with_the_seed_from_the_environment_and_refuses_xxhash_without(view, go_lookup, capsys,
                                                                                       monkeypatch):
    srv, prefix = view
    target = ["-addr", f"127.0.0.1:{srv.port}"]
    argv = ["--tokens", TOKENS_B, "--algo", "xxhash_cbor"]
    monkeypatch.setenv("PYTHONHASHSEED", "12345")
    want = _kvbus_lookup(Settings(redis_url=srv.url), prefix, argv, capsys)
    assert list(json.loads(want)) == ["vllm-xxhash-cbor"]
    assert go(go_lookup, target, prefix, argv).stdout == want
    monkeypatch.delenv("PYTHONHASHSEED")
    g = go(go_lookup, target, prefix, argv)
    assert g.returncode == 2 and "random" in g.stderr and "no router" in g.stderr


# ---------------------------------------------------------------- Redis Cluster (the sharded view)

@pytest.fixture(scope="module")
def sharded_view():
    """The same records in the sharded view on a 3-master Redis Cluster and in a single-node view."""
    from kvbus.infra.scratch_cluster import RedisClusterServer

    with RedisClusterServer(3) as cl, RedisServer() as srv:
        prefix = f"c{uuid.uuid4().hex[:8]}:"
        records = _records() + _hybrid_records()
        ShardedRedisStore(cl.url, prefix).apply(records)
        RedisStore(srv.client(), prefix).apply(records)
        for url in (cl.url, srv.url):
            with ViewClient(url, prefix) as v:
                _predict(v)
        masters = [f"{n.host}:{n.port}" for n in cl.nodes if n.master]
        shards = int(redis_cli(cl.nodes[0].port, "HGET", prefix + "{s0}:meta", "shards", cluster=True))
        assert shards == 16
        views = [(f"{prefix}{{s{i}}}:", [f"{prefix}{{s{i}}}:meta", f"{prefix}{{s{i}}}:guard"]) for i in range(shards)]
        used = sum(1 for p, _ in views if cl.client().exists(p + "hname"))
        assert used > 8, "the holders are spread over the shards"
        assert shard_of("b#0", shards) != shard_of("b#1", shards), "display names need every shard's holders"
        yield cl, srv, prefix, masters, views


SHARDED_CASES = ("all", "mixed-candidates", "weights", "tokens-xxhash-cbor", "tokens-sha256", "model",
                 "model-and-candidates", "predicted", "predicted-and-model")


def test_sharded_view_redis_cli_one_call_per_shard_union_of_answers(sharded_view, capsys):
    cl, srv, prefix, _, views = sharded_view
    for case in SHARDED_CASES:
        want = _kvbus_lookup(Settings(redis_url=cl.url), prefix, CASES[case], capsys)
        assert want == _kvbus_lookup(Settings(redis_url=srv.url), prefix, CASES[case], capsys)
        chain, spec, cands, options = _spec_and_cands(CASES[case])
        got = redis_cli_answer(cl.nodes[0].port, views, chain, spec, cands, cluster=True, **options)
        assert list(got.items()) == list(json.loads(want).items())


def test_sharded_view_go(sharded_view, go_lookup, capsys):
    cl, _, prefix, masters, _ = sharded_view
    for case in SHARDED_CASES:
        want = _kvbus_lookup(Settings(redis_url=cl.url), prefix, CASES[case], capsys)
        g = go(go_lookup, ["-cluster", ",".join(masters)], prefix, CASES[case])
        assert (g.returncode, g.stdout) == (0, want), g.stderr
