"""``kvbus serve``, the HTTP query API, against real views on a private Redis written by the sink's own
store: ``/query`` and ``/query_by_hash`` answer what ``kvbus lookup --json`` answers, in the shape of
Mooncake's indexer API (per tenant, instance, medium and data-parallel rank, in tokens); a bad request
is a 400 naming its field; the probes follow the view's status; the metrics count what was served;
and a real ``kvbus serve`` process does the same over TCP and stops on SIGTERM."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import msgspec
import pytest
from aiohttp.test_utils import TestClient, TestServer

from kvbus.children import free_port
from kvbus.client import Load, ViewClient
from kvbus.infra.scratch_redis import RedisServer
from kvbus.runtime.settings import Settings
from kvbus.schemas.events import BlockEvent, BlockStored, canonical_hash
from kvbus.schemas.lookup import status_key
from kvbus.serve.app import Service, view_client
from kvbus.serve.query import Query, ask, medium
from kvbus.serve.serve_config import ServeConfig
from kvbus.sinks.view.redis_store import RedisStore
from tests.lookup_cli import lookup_args, lookup_json
from tests.test_hashing_extra_keys import HOLDERS, SQL_V1, SQL_V2, _vector
from tests.test_lookup_protocol import CASES, CHAIN, EMPTY_CASES, UNKNOWN, _records
from tests.vllm_hash_vectors import PROMPTS

KVBUS = Path(sys.executable).parent / "kvbus"
MODEL = "m"
"""The model the requests name and the test views' holders serve (their events name it)."""


def _as_model(records: list, model: str | None = MODEL) -> list:
    """``records`` with every event naming ``model``."""
    return [(topic, msgspec.structs.replace(ev, model=model)) for topic, ev in records]


@pytest.fixture(autouse=True)
def _no_hash_seed(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)


@pytest.fixture(scope="module")
def redis_view():
    """A private Redis with two views written by ``RedisStore.apply``: the lookup protocol's cases
    (tiers GPU, CPU, CPU@kvcr, GPU/g1; replica b with ranks 0 and 1; 24 holders of a shared prefix;
    prompts hashed by vLLM) under ``prefix``, and prompt B as vLLM published it for a base, a salted
    and a LoRA engine per hash algorithm (PYTHONHASHSEED=0) under ``lora_prefix``; every holder
    serves :data:`MODEL`."""
    with RedisServer() as srv:
        prefix, lora_prefix = f"s{uuid.uuid4().hex[:8]}:", f"l{uuid.uuid4().hex[:8]}:"
        RedisStore(srv.client(), prefix).apply(_as_model(_records()))
        records = []
        for algo in ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor"):
            for holder, (release, lora, salt) in HOLDERS.items():
                v = _vector(release, algo, lora, salt)
                records.append(("kvbus.blocks", BlockEvent(
                    replica=f"{holder}-{algo}", dp_rank=0, epoch=1, seq=0, index=0, ts=time.time(), model=MODEL,
                    event=BlockStored(block_hashes=[canonical_hash(h) for h in v.hashes], medium="GPU",
                                      block_size=16))))
        RedisStore(srv.client(), lora_prefix).apply(records)
        yield srv, prefix, lora_prefix


def _service(url: str, prefix: str, **config) -> Service:
    cfg = ServeConfig(prefix=prefix, tie_break="name", **config)
    return Service(view_client(url, cfg), cfg)


async def _post(client: TestClient, path: str, body) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    resp = await client.post(path, data=data, headers={"Content-Type": "application/json"})
    assert resp.content_type == "application/json", await resp.text()
    return resp.status, await resp.json()


class Served:
    """An in-process service on a test server: ``await served.post(path, body)``."""

    def __init__(self, service: Service):
        self.service = service
        self.client = TestClient(TestServer(service.app()))

    async def __aenter__(self) -> "Served":
        await self.client.start_server()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.client.close()
        self.service.close()
        self.service.view.close()

    async def post(self, path: str, body) -> tuple[int, dict]:
        return await _post(self.client, path, body)


# ------------------------------------------------------------------------------------ the answers


def _kvbus_lookup_json(url: str, prefix: str, argv: list[str], capsys) -> dict:
    return json.loads(lookup_json(argv, Settings(redis_url=url), prefix, capsys))


MEDIA = {"GPU": "GPU", "CPU": "CPU"}  # the media of the test views


def translated(lookup_json: dict, block_size: int, tenant: str = "default") -> dict:
    """``kvbus lookup --json`` in the query API's shape, by the rule docs/serve.md states: instances are
    replicas in the order of their best holder; longest_matched the most any rank holds; a medium's
    count the most any rank holds there (at most that rank's matched); DP a rank's matched; in tokens."""
    out: dict = {}
    for m in lookup_json.values():
        inst = out.setdefault(m["replica"], {"longest_matched": 0, "GPU": 0, "CPU": 0, "DISK": 0, "DP": {}})
        inst["longest_matched"] = max(inst["longest_matched"], m["matched"] * block_size)
        inst["DP"][str(m["dp_rank"])] = m["matched"] * block_size
        for tier, n in m["tiers"].items():
            name = MEDIA[tier.split("@")[0].split("/")[0]]
            inst[name] = max(inst[name], min(n, m["matched"]) * block_size)
    for inst in out.values():
        inst["DP"] = dict(sorted(inst["DP"].items(), key=lambda kv: int(kv[0])))
    return {tenant: out}


def _request(argv: list[str]) -> tuple[str, dict, dict]:
    """(path, request body, ServeConfig fields) of a ``kvbus lookup`` case without --weights."""
    a = lookup_args(argv)
    body: dict = {"model": a.model or MODEL, "block_size": a.block_size}
    if a.replicas:
        body["instance_id"] = a.replicas
    if a.hashes:
        return "/query_by_hash", {**body, "seq_hashes": [int(h, 0) for h in a.hashes.split(",")]}, {}
    return "/query", {**body, "token_ids": [int(t) for t in a.tokens.split(",")]}, \
        {"algo": a.algo, "hash_seed": a.hash_seed}


SINGLE_CANDIDATE = {case for case, argv in CASES.items() if "--replicas" not in argv or "," not in
                    argv[argv.index("--replicas") + 1]}
ANSWER_CASES = sorted(c for c in SINGLE_CANDIDATE if "--weights" not in CASES[c] and "--model" not in CASES[c])


@pytest.mark.parametrize("threads", [4, 0])
@pytest.mark.parametrize("case", ANSWER_CASES)
async def test_answers_equal_kvbus_lookup_json(redis_view, capsys, case, threads):
    """Every lookup-protocol case (hashes, gaps, signed and hex hashes, tokens with each algorithm,
    blocks of 8, an instance filter), with lookups on threads and on the event loop."""
    srv, prefix, _ = redis_view
    path, body, config = _request(CASES[case])
    want = translated(_kvbus_lookup_json(srv.url, prefix, CASES[case], capsys), body["block_size"])
    async with Served(_service(srv.url, prefix, threads=threads, **config)) as s:
        status, got = await s.post(path, body)
    assert status == 200, got
    assert got == want
    assert list(got["default"]) == list(want["default"]), "instances in the lookup's order"
    if case not in EMPTY_CASES:
        assert got["default"], "the case finds holders"


async def test_the_answer_per_instance_medium_and_rank(redis_view):
    """The view of _records() by hand: a holds 6 blocks on GPU, 2 on CPU; b holds 1 on GPU at rank 0
    and 3 on CPU@kvcr at rank 1; c holds 4 in KV group 1 on GPU and 3 on CPU."""
    srv, prefix, _ = redis_view
    hashes = [int.from_bytes(h, "big") for h in CHAIN]
    async with Served(_service(srv.url, prefix)) as s:
        status, got = await s.post("/query_by_hash", {"model": "m", "block_size": 64, "seq_hashes": hashes,
                                                      "tenant_id": "team-a"})
        assert status == 200
        assert list(got) == ["team-a"]
        answer = got["team-a"]
        assert answer["a"] == {"longest_matched": 384, "GPU": 384, "CPU": 128, "DISK": 0, "DP": {"0": 384}}
        assert answer["b"] == {"longest_matched": 192, "GPU": 64, "CPU": 192, "DISK": 0, "DP": {"0": 64, "1": 192}}
        assert answer["c"] == {"longest_matched": 256, "GPU": 256, "CPU": 192, "DISK": 0, "DP": {"0": 256}}
        assert list(answer)[:4] == ["a", "pod#x", "c", "b"] and len(answer) == 4 + 24
        # one rank of an instance, by its holder name; a replica name takes every rank
        assert (await s.post("/query_by_hash", {"model": "m", "block_size": 16, "seq_hashes": hashes,
                                                "instance_id": "b#1"}))[1] == \
            {"default": {"b": {"longest_matched": 48, "GPU": 0, "CPU": 48, "DISK": 0, "DP": {"1": 48}}}}
        assert list((await s.post("/query_by_hash", {"model": "m", "block_size": 16, "seq_hashes": hashes,
                                                     "instance_id": "b"}))[1]["default"]["b"]["DP"]) == ["0", "1"]
        # the compatibility names of seq_hashes and model, and no hit at all
        for alias in ({"block_hash": hashes}, {"block_hashes": hashes}):
            assert await s.post("/query_by_hash", {"model_name": "m", "block_size": 64, "tenant_id": "team-a",
                                                   **alias}) == (200, got)
        unknown = [int.from_bytes(UNKNOWN, "big")]
        assert await s.post("/query_by_hash", {"model": "m", "block_size": 16, "seq_hashes": unknown}) == \
            (200, {"default": {}})
        assert await s.post("/query", {"model": "m", "block_size": 16, "token_ids": list(range(15))}) == \
            (200, {"default": {}})


def test_media_map_kvbus_tiers_to_the_apis_pools():
    assert [medium(t) for t in ("GPU", "GPU/g1", "CPU", "CPU@kvcr", "CPU_PINNED", "DISK", "STORAGE", "FS",
                                "OBJ", "EXTERNAL@lmcache")] == \
        ["GPU", "GPU", "CPU", "CPU", "CPU", "DISK", "DISK", "DISK", "OBJ", "EXTERNAL"]


async def test_a_medium_counts_the_longest_prefix_any_rank_holds_in_any_of_its_tiers(redis_view):
    """r holds the chain at rank 0 on GPU (3 blocks), in KV group 1 on GPU (2), on CPU (1) and on CPU
    owned by kvcr (2), and at rank 1 on GPU (4); s holds it on STORAGE (3), OBJ (2), CPU_PINNED (1)."""
    srv, _, _ = redis_view
    prefix = f"m{uuid.uuid4().hex[:8]}:"
    h = [canonical_hash(0xABC0 + i) for i in range(4)]
    stores = {("r", 0): [("GPU", None, None, 3), ("GPU", None, 1, 2), ("CPU", None, None, 1), ("CPU", "kvcr", None, 2)],
              ("r", 1): [("GPU", None, None, 4)],
              ("s", 0): [("STORAGE", None, None, 3), ("OBJ", None, None, 2), ("CPU_PINNED", None, None, 1)]}
    RedisStore(srv.client(), prefix).apply(_as_model([
        ("kvbus.blocks", BlockEvent(replica=replica, dp_rank=dp, epoch=1, seq=n, index=0, ts=time.time(),
                                    event=BlockStored(block_hashes=h[:k], medium=m, ownership=own, group_idx=g)))
        for (replica, dp), tiers in stores.items() for n, (m, own, g, k) in enumerate(tiers)]))
    async with Served(_service(srv.url, prefix)) as s:
        assert await s.post("/query_by_hash", {"model": "m", "block_size": 16,
                                               "seq_hashes": [int.from_bytes(x, "big") for x in h]}) == \
            (200, {"default": {
                "r": {"longest_matched": 64, "GPU": 64, "CPU": 32, "DISK": 0, "DP": {"0": 48, "1": 64}},
                "s": {"longest_matched": 48, "GPU": 0, "CPU": 16, "DISK": 48, "OBJ": 32, "DP": {"0": 48}}}})


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"])
async def test_lora_and_cache_salt_requests_match_what_vllm_published(redis_view, algo):
    """A request names only its adapter: the server hashes it with the path of its --lora-module, and
    with the request's cache_salt, as vLLM 0.33 does; --engine-version 0.30.0 keys adapters by name."""
    srv, _, prefix = redis_view
    tokens = PROMPTS["B"]
    base = {"model": "m", "block_size": 16, "token_ids": tokens}
    async with Served(_service(srv.url, prefix, algo=algo, hash_seed="0",
                               lora_modules={SQL_V1[0]: SQL_V1[1], "other": "/adapters/other"})) as s:
        for extra, holder in [({}, "base"), ({"cache_salt": "tenant-a"}, "salted"),
                              ({"lora_name": SQL_V1[0]}, "lora-v1"), ({"lora_name": ""}, "base"),
                              ({"lora_name": None, "cache_salt": None}, "base"),
                              ({"lora_name": SQL_V1[0], "cache_salt": "tenant-a"}, "lora-v1-salted")]:
            status, got = await s.post("/query", {**base, **extra})
            assert (status, list(got["default"])) == (200, [f"{holder}-{algo}"]), extra
            assert got["default"][f"{holder}-{algo}"]["longest_matched"] == 48
        assert await s.post("/query", {**base, "lora_name": "other"}) == (200, {"default": {}})
        status, err = await s.post("/query", {**base, "lora_name": "sql"})
        assert (status, err["field"]) == (400, "lora_name") and "other, sql-adapter" in err["error"]
    async with Served(_service(srv.url, prefix, algo=algo, hash_seed="0", lora_modules={SQL_V2[0]: SQL_V2[1]})) as s:
        assert await s.post("/query", {**base, "lora_name": SQL_V1[0]}) == (200, {"default": {}})  # another path
    async with Served(_service(srv.url, prefix, algo=algo, hash_seed="0", engine_version="0.30.0")) as s:
        status, got = await s.post("/query", {**base, "lora_name": SQL_V1[0], "cache_salt": "tenant-a"})
        assert (status, list(got["default"])) == (200, [f"old-lora-{algo}"])
    async with Served(_service(srv.url, prefix, algo=algo, hash_seed="0", engine_version="0.10.2")) as s:
        status, err = await s.post("/query", {**base, "lora_name": SQL_V1[0]})
        assert (status, err["field"]) == (400, "lora_name") and "lora_int_id" in err["error"]


async def test_a_request_is_answered_by_the_instances_of_its_model_only(redis_view):
    """Two models' instances hold the same blocks (same prompt, same hash seed) and a third's bridge
    names no model: each request is answered by its model's instances, never by the others."""
    srv, _, _ = redis_view
    prefix = f"d{uuid.uuid4().hex[:8]}:"
    hashes = [int.from_bytes(h, "big") for h in CHAIN[:3]]
    RedisStore(srv.client(), prefix).apply([
        ("kvbus.blocks", BlockEvent(replica=r, dp_rank=0, epoch=1, seq=0, index=0, ts=time.time(), model=model,
                                    event=BlockStored(block_hashes=CHAIN[:n], medium="GPU")))
        for r, model, n in (("llama-0", "llama-3-8b", 3), ("llama-1", "llama-3-8b", 2), ("qwen-0", "qwen3-8b", 3),
                            ("unnamed-0", None, 3))])
    async with Served(_service(srv.url, prefix)) as s:
        for model, want in (("llama-3-8b", {"llama-0": 48, "llama-1": 32}), ("qwen3-8b", {"qwen-0": 48}),
                            ("mistral-7b", {})):
            status, got = await s.post("/query_by_hash", {"model": model, "block_size": 16, "seq_hashes": hashes})
            assert status == 200 and {k: v["longest_matched"] for k, v in got["default"].items()} == want, model
    q = Query(model="qwen3-8b", tenant="default", block_size=16, hashes=hashes, instance="llama-0")
    with ViewClient(srv.url, prefix) as view:
        assert ask(view, q, ServeConfig().hashing) == []


# ------------------------------------------------------------------------------------ bad requests

H = int.from_bytes(CHAIN[0], "big")
TOKENS = {"model": "m", "block_size": 16, "token_ids": list(range(32))}
HASHES = {"model": "m", "block_size": 16, "seq_hashes": [H]}


@pytest.mark.parametrize("path, body, field, text", [
    ("/query", b"{", None, "not JSON"),
    ("/query", b"[1, 2]", None, "Expected `object`"),
    ("/query", {**TOKENS, "model": None}, "model", "model is required"),
    ("/query", {k: v for k, v in TOKENS.items() if k != "model"}, "model", "model is required"),
    ("/query", {**TOKENS, "model": ""}, "model", "must name the model"),
    ("/query", {**TOKENS, "model": 7}, "model", "got `int`"),
    ("/query", {**TOKENS, "model_name": "m"}, "model_name", "give one"),
    ("/query", {k: v for k, v in TOKENS.items() if k != "block_size"}, "block_size", "required"),
    ("/query", {**TOKENS, "block_size": 0}, "block_size", ">= 1"),
    ("/query", {**TOKENS, "block_size": "16"}, "block_size", "got `str`"),
    ("/query", {k: v for k, v in TOKENS.items() if k != "token_ids"}, "token_ids", "required"),
    ("/query", {**TOKENS, "token_ids": [1, -2]}, "token_ids", ">= 0"),
    ("/query", {**TOKENS, "token_ids": [1, 2.5]}, "token_ids", "got `float`"),
    ("/query", {**TOKENS, "token_ids": "1,2"}, "token_ids", "got `str`"),
    ("/query", {**TOKENS, "seq_hashes": [H]}, "seq_hashes", "unknown field"),
    ("/query", {**TOKENS, "lora_id": 3}, "lora_id", "unknown field"),
    ("/query", {**TOKENS, "lora_name": "nope"}, "lora_name", "unknown LoRA adapter 'nope'"),
    ("/query", {**TOKENS, "instance_id": ""}, "instance_id", "must name an instance"),
    ("/query", {**TOKENS, "tenant_id": 5}, "tenant_id", "got `int`"),
    ("/query", {**TOKENS, "cache_salt": ["x"]}, "cache_salt", "got `array`"),
    ("/query_by_hash", {**HASHES, "token_ids": [1]}, "token_ids", "unknown field"),
    ("/query_by_hash", {k: v for k, v in HASHES.items() if k != "seq_hashes"}, "seq_hashes", "required"),
    ("/query_by_hash", {**HASHES, "block_hashes": [H]}, "block_hashes", "give one"),
    ("/query_by_hash", {**HASHES, "seq_hashes": [H, 2**64]}, "seq_hashes", "not a 64-bit hash"),
    ("/query_by_hash", {**HASHES, "seq_hashes": [-(2**63) - 1]}, "seq_hashes", ">= -9223372036854775808"),
    ("/query_by_hash", {**HASHES, "seq_hashes": [str(H)]}, "seq_hashes", "got `str`"),
    ("/query_by_hash", {**HASHES, "block_size": None}, "block_size", "required"),
])
async def test_a_bad_request_is_a_400_naming_the_field(redis_view, path, body, field, text):
    srv, prefix, _ = redis_view
    async with Served(_service(srv.url, prefix)) as s:
        status, err = await s.post(path, body)
        assert (status, err["field"]) == (400, field), err
        assert text in err["error"], err
        metrics = await (await s.client.get("/metrics")).text()
    assert f'kvbus_serve_errors_total{{kind="bad_request",path="{path}"}} 1.0' in metrics


async def test_other_paths_methods_and_large_bodies_are_json_errors(redis_view):
    srv, prefix, _ = redis_view
    async with Served(_service(srv.url, prefix, max_body=1000)) as s:
        for method, path, status in [("GET", "/query", 405), ("POST", "/lookup", 404), ("GET", "/", 404)]:
            resp = await s.client.request(method, path)
            body = await resp.json()
            assert (resp.status, body["field"]) == (status, None) and "POST /query" in body["error"], body
        status, err = await s.post("/query", {**TOKENS, "token_ids": list(range(1000))})
        assert status == 413 and "KVBUS_SERVE_MAX_BODY" in err["error"]
        metrics = await (await s.client.get("/metrics")).text()
    assert 'kvbus_serve_requests_total{code="404",path="other"} 2.0' in metrics
    assert 'kvbus_serve_errors_total{kind="too_large",path="/query"} 1.0' in metrics


async def test_a_routed_prompt_predicted_over_http_counts_in_queries_that_ask_for_predictions(redis_view):
    """``POST /predict`` records a prompt's blocks on the instance it was routed to; ``/query_by_hash`` and
    ``/query`` count them only with ``predicted`` (their weight), never for another model."""
    srv, _, _ = redis_view
    prefix = f"p{uuid.uuid4().hex[:8]}:"
    chain = [canonical_hash(0xD00D + i) for i in range(4)]
    RedisStore(srv.client(), prefix).apply([("kvbus.blocks", BlockEvent(
        replica="p1", dp_rank=0, epoch=1, seq=0, index=0, ts=time.time(), model=MODEL,
        event=BlockStored(block_hashes=chain[:2], medium="GPU", block_size=16)))])
    hashes = [int.from_bytes(h, "big") for h in chain]
    async with Served(_service(srv.url, prefix)) as s:
        status, body = await s.post("/predict", {"model": MODEL, "instance_id": "p1", "seq_hashes": hashes,
                                                 "ttl": 60})
        assert (status, body) == (200, {"predicted": 4}), body
        ask = {"model": MODEL, "block_size": 16, "seq_hashes": hashes}
        for extra, matched in (({}, 2), ({"predicted": 0.5}, 4)):
            status, body = await s.post("/query_by_hash", {**ask, **extra})
            assert status == 200 and body["default"]["p1"]["longest_matched"] == matched * 16, (extra, body)
        status, body = await s.post("/query_by_hash", {**ask, "model": "other", "predicted": 0.5})
        assert status == 200 and "p1" not in body["default"], body
        for bad, field in (({"model": MODEL, "seq_hashes": hashes}, "instance_id"),
                           ({"model": MODEL, "instance_id": "p1", "seq_hashes": hashes, "ttl": 0}, "ttl"),
                           ({"model": MODEL, "instance_id": "p1", "token_ids": [1] * 32}, "block_size")):
            status, err = await s.post("/predict", bad)
            assert (status, err["field"]) == (400, field), err


async def test_route_weighs_the_prefix_an_instance_holds_against_the_shared_load(redis_view):
    """``POST /route``: the routing policy (kvbus.client.routing.choose) over one lookup with the routers'
    shared load. r1 holds 3 of the prompt's 4 blocks; idle, it gets the prompt; with 8 requests in flight
    (another router's report) a large beta sends it to idle r2, a small one keeps it on r1."""
    srv, _, _ = redis_view
    prefix = f"r{uuid.uuid4().hex[:8]}:"
    chain = [canonical_hash(0xBEEF + i) for i in range(4)]
    RedisStore(srv.client(), prefix).apply([("kvbus.blocks", BlockEvent(
        replica="r1", dp_rank=0, epoch=1, seq=0, index=0, ts=time.time(), model=MODEL,
        event=BlockStored(block_hashes=chain[:3], medium="GPU", block_size=16)))])
    ask = {"model": MODEL, "block_size": 16, "seq_hashes": [int.from_bytes(h, "big") for h in chain],
           "instances": ["r2", "r1"]}
    async with Served(_service(srv.url, prefix)) as s:
        status, body = await s.post("/route", ask)
        assert (status, body) == (200, {"instance": "r1", "matched": 48, "prompt_blocks": 4,
                                        "load": {"r2": 0, "r1": 0}}), body
        ViewClient(srv.url, prefix).report("another-router", {"r1": Load(8, 800)})
        for beta, instance in ((2.0, "r2"), (0.1, "r1")):
            status, body = await s.post("/route", {**ask, "beta": beta})
            assert status == 200 and body["instance"] == instance and body["load"]["r1"] == 8, (beta, body)
        for bad, field in (({**ask, "instances": []}, "instances"), ({**ask, "beta": -1}, "beta")):
            status, err = await s.post("/route", bad)
            assert (status, err["field"]) == (400, field), err


async def test_routers_report_and_read_their_shared_load_over_http(redis_view):
    """Two routers report over ``POST /load``; ``GET /load`` answers their sums, what a Python router's
    ``ViewClient.load`` reads too; bad reports are 400s naming the field."""
    srv, prefix, _ = redis_view
    async with Served(_service(srv.url, prefix)) as s:
        for router, load in (("r1", {"a": {"requests": 2, "tokens": 70}}),
                             ("r2", {"a": {"requests": 1, "tokens": 5}, "b": {"requests": 1}})):
            status, body = await s.post("/load", {"router": router, "load": load})
            assert status == 200 and body["router"] == router, body
        resp = await s.client.get("/load")
        want = {"a": {"requests": 3, "tokens": 75}, "b": {"requests": 1, "tokens": 0}}
        assert (resp.status, await resp.json()) == (200, want)
        assert ViewClient(srv.url, prefix).load() == {"a": Load(3, 75), "b": Load(1, 0)}
        for body, field in (({"load": {}}, "router"), ({"router": "r", "lease": 0}, "lease"),
                            ({"router": "r", "load": {"a": {"requests": -1}}}, "load"), ([], None)):
            status, err = await s.post("/load", body)
            assert (status, err["field"]) == (400, field), err


# ------------------------------------------------------------------------------------ probes and metrics


async def test_readyz_follows_the_views_status_and_queries_fail_503_without_redis(redis_view):
    srv, prefix, _ = redis_view
    r = srv.client()
    async with Served(_service(srv.url, prefix)) as s:
        get = s.client.get
        assert ((await get("/healthz")).status, await (await get("/healthz")).text()) == (200, "ok\n")
        resp = await get("/readyz")
        assert (resp.status, await resp.json()) == (200, {"ready": True})
        r.hset(status_key(prefix), mapping={"state": "rebuilding", "phase": "replaying", "since": "1"})
        try:
            resp = await get("/readyz")
            assert resp.status == 503
            assert (await resp.json())["reasons"] == [f"the view is rebuilding, replaying (P status under {prefix!r})"]
        finally:
            r.delete(status_key(prefix))
        assert (await get("/readyz")).status == 200
    async with Served(_service(srv.url, "nothing-here:")) as s:
        resp = await s.client.get("/readyz")
        assert (resp.status, (await resp.json())["reasons"]) == (503, ["the view is missing (P status under "
                                                                       "'nothing-here:')"])
    with RedisServer() as gone:
        service = _service(gone.url, prefix)
        gone.kill()
        async with Served(service) as s:
            resp = await s.client.get("/readyz")
            body = await resp.json()
            assert resp.status == 503 and body["reasons"][0].startswith("Redis unavailable (ConnectionError"), body
            status, err = await s.post("/query_by_hash", HASHES)
            assert status == 503 and err["error"].startswith("the view cannot be read: ConnectionError"), err
            assert ((await s.client.get("/healthz")).status) == 200
            metrics = await (await s.client.get("/metrics")).text()
    assert 'kvbus_serve_errors_total{kind="view_unavailable",path="/query_by_hash"} 1.0' in metrics


def _sample(metrics: str, name: str) -> float:
    """The value of sample ``name`` (with its labels, as the exposition writes them)."""
    (value,) = [line.rsplit(" ", 1)[1] for line in metrics.splitlines() if line.rsplit(" ", 1)[0] == name]
    return float(value)


async def test_metrics_count_requests_latency_errors_and_answers(redis_view):
    srv, prefix, _ = redis_view
    async with Served(_service(srv.url, prefix)) as s:
        for _ in range(5):
            assert (await s.post("/query_by_hash", HASHES))[0] == 200
        for _ in range(3):
            assert (await s.post("/query", TOKENS))[0] == 200
        assert (await s.post("/query", {}))[0] == 400
        metrics = await (await s.client.get("/metrics")).text()
    assert _sample(metrics, 'kvbus_serve_requests_total{code="200",path="/query_by_hash"}') == 5
    assert _sample(metrics, 'kvbus_serve_requests_total{code="200",path="/query"}') == 3
    assert _sample(metrics, 'kvbus_serve_requests_total{code="400",path="/query"}') == 1
    assert _sample(metrics, 'kvbus_serve_request_seconds_count{path="/query"}') == 4
    assert _sample(metrics, 'kvbus_serve_request_seconds_sum{path="/query_by_hash"}') > 0
    assert _sample(metrics, 'kvbus_serve_request_seconds_bucket{le="+Inf",path="/query_by_hash"}') == 5
    assert _sample(metrics, "kvbus_serve_lookup_seconds_count") == 8
    assert _sample(metrics, 'kvbus_serve_answer_instances_bucket{le="0.0"}') == 3  # the tokens hold nothing
    assert _sample(metrics, "kvbus_serve_answer_instances_count") == 8
    assert _sample(metrics, 'kvbus_serve_errors_total{kind="bad_request",path="/query"}') == 1
    assert _sample(metrics, "kvbus_serve_requests_in_flight") == 1  # the /metrics request itself


# ------------------------------------------------------------------------------------ a real process


def _http(method: str, url: str, body: dict | None = None) -> tuple[int, bytes]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_a_kvbus_serve_process_answers_as_kvbus_lookup_and_stops_on_sigterm(redis_view, tmp_path):
    srv, prefix, _ = redis_view
    port = free_port()
    env = {**os.environ, "KVBUS_REDIS_URL": srv.url, "KVBUS_SERVE_PREFIX": prefix}
    env.pop("KVBUS_SERVE_LORA_MODULES", None)
    log = open(tmp_path / "serve.log", "w+")
    argv = [str(KVBUS), "serve", "--port", str(port), "--host", "127.0.0.1", "--algo", "sha256",
            "--lora-module", f"{SQL_V1[0]}={SQL_V1[1]}"]
    proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline, seen = time.monotonic() + 30, None
        while True:
            try:
                if _http("GET", base + "/healthz") == (200, b"ok\n"):
                    break
            except OSError as e:
                seen = e
            assert proc.poll() is None and time.monotonic() < deadline, \
                f"kvbus serve did not answer /healthz on :{port} within 30 s (last: {seen!r}; exit {proc.poll()})"
            time.sleep(0.1)
        assert _http("GET", base + "/readyz") == (200, b'{"ready": true}\n')
        for case in ("all", "gap", "replica-candidate", "tokens-sha256"):
            path, body, _ = _request(CASES[case])
            lookup = subprocess.run([str(KVBUS), "lookup", *CASES[case], "--prefix", prefix, "--json"], env=env,
                                    capture_output=True, text=True, timeout=60)
            assert lookup.returncode == 0, lookup.stderr
            status, answer = _http("POST", base + path, body)
            assert (status, json.loads(answer)) == (200, translated(json.loads(lookup.stdout), body["block_size"]))
        status, answer = _http("POST", base + "/query", {"model": "m", "block_size": 16, "token_ids": PROMPTS["B"],
                                                         "lora_name": SQL_V1[0]})
        assert status == 200 and json.loads(answer) == {"default": {}}  # the view of `prefix` has no adapter
        status, err = _http("POST", base + "/query", {"model": "m", "token_ids": [1]})
        assert (status, json.loads(err)["field"]) == (400, "block_size")
        status, metrics = _http("GET", base + "/metrics")
        assert status == 200 and b'kvbus_serve_requests_total{code="400",path="/query"} 1.0' in metrics
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
        log.seek(0)
        output = log.read()
    assert code == 0, output
    assert f"on http://127.0.0.1:{port}" in output and "adapters: sql-adapter" in output and "stopping" in output


@pytest.mark.parametrize("argv, env, line", [
    (["serve"], {"KVBUS_SERVE_THREADS": "many"}, "kvbus serve: KVBUS_SERVE_THREADS=many: expected a whole number >= 0"),
    (["serve"], {"KVBUS_SERVE_LORA_MODULES": "sql"},
     "kvbus serve: KVBUS_SERVE_LORA_MODULES=sql: expected NAME=PATH (an adapter and the path the engines loaded it "
     "from)"),
    (["serve", "--lora-module", "sql"], {},
     "kvbus serve: argument --lora-module: expected NAME=PATH (an adapter and the path the engines loaded it "
     "from), got 'sql' (see kvbus serve --help)"),
    (["serve", "--algo", "md5"], {},
     "kvbus serve: argument --algo: expected one of sha256, sha256_cbor, xxhash, xxhash_cbor, got 'md5' "
     "(see kvbus serve --help)"),
    (["serve"], {"KVBUS_SERVE_ENGINE_VERSION": "new"},
     "kvbus serve: KVBUS_SERVE_ENGINE_VERSION=new: expected a vLLM release, e.g. 0.33.0"),
])
def test_a_malformed_setting_exits_2_naming_it(argv, env, line):
    out = subprocess.run([str(KVBUS), *argv], env={**os.environ, **env}, capture_output=True, text=True, timeout=60)
    assert (out.returncode, out.stderr, out.stdout) == (2, line + "\n", "")


def test_engines_settings_no_router_can_hash_for_exit_2():
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    out = subprocess.run([str(KVBUS), "serve", "--algo", "xxhash"], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and out.stderr.startswith("kvbus serve: --algo xxhash needs the engine's hash seed"), \
        out.stderr
    assert out.stderr.count("\n") == 1


def test_a_port_in_use_exits_1_saying_so(redis_view):
    import socket

    srv, prefix, _ = redis_view
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = subprocess.run([str(KVBUS), "serve", "--host", "127.0.0.1", "--port", str(port)],
                             env={**os.environ, "KVBUS_REDIS_URL": srv.url}, capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and f"cannot listen on 127.0.0.1:{port}" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
