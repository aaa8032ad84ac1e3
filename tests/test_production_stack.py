"""kvbus.client.production_stack: the routing logic for vLLM production-stack's router, against real
views written by the sink's store on a private Redis.

The router's endpoints, stats and requests are built by tests/production_stack_stubs.py (its
EndpointInfo, EngineStats and RequestStats field for field, and real Starlette requests whose body
was read first): production-stack's router is not on PyPI, the package named vllm-router there is
another router. Each test calls ``route_request(endpoints, engine_stats, request_stats, request)``
as production-stack's request service calls a routing logic it does not know.
"""
from __future__ import annotations

import logging
import time
import uuid
from collections import Counter

import pytest

from kvbus.children import free_port
from kvbus.client import UnmatchableSeed, ViewClient, production_stack as ps
from kvbus.client.production_stack import KvbusRouter, endpoint_load, endpoint_replica, json_body, prompt_tokens
from kvbus.infra.scratch_redis import RedisServer
from kvbus.schemas.events import BlockEvent, BlockStored
from kvbus.schemas.hashing import LoRA, block_hashes
from kvbus.sinks.view.redis_store import RedisStore
from tests.production_stack_stubs import EndpointInfo, EngineStats, ModelInfo, RequestStats, read_request

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
SEED = "0"
SYSTEM = list(range(1000, 1064))
"""A 4-block system prompt (blocks of 16) that replica-1 holds."""
COLD = list(range(5000, 5048))
"""A 3-block prompt nobody holds."""
ADAPTER = LoRA("sql-lora", "/adapters/sql-lora")
URLS = {f"replica-{i}": f"http://10.0.0.{i + 1}:8000" for i in range(3)}


def _chain(tokens: list[int], **kw) -> list[bytes]:
    return block_hashes(tokens, 16, "sha256", SEED, **kw)


def _stored(replica: str, chain: list[bytes], seq: int) -> tuple[str, BlockEvent]:
    return ("kvbus.blocks", BlockEvent(replica=replica, dp_rank=0, epoch=1, seq=seq, index=0, ts=time.time(),
                                       event=BlockStored(block_hashes=chain, medium="GPU")))


@pytest.fixture(scope="module")
def server():
    with RedisServer() as srv:
        yield srv


@pytest.fixture()
def view(server):
    """A fresh view: replica-1 holds SYSTEM, replica-2 holds SYSTEM's first block and, as the adapter
    hashes them with a cache salt, SYSTEM's blocks; replica-0 holds nothing. (url, prefix, store)."""
    prefix = f"ps{uuid.uuid4().hex[:8]}:"
    store = RedisStore(server.client(), prefix)
    store.apply([_stored("replica-1", _chain(SYSTEM), 0), _stored("replica-2", _chain(SYSTEM[:16]), 0),
                 _stored("replica-2", _chain(SYSTEM, lora=ADAPTER, cache_salt="tenant-a"), 1)])
    return server.url, prefix, store


def _endpoints(by: str = "pod") -> list[EndpointInfo]:
    """Three endpoints of MODEL, replica-i at 10.0.0.<i+1>:8000, known by pod name (Kubernetes service
    discovery) or by URL only (static backends)."""
    info = {MODEL: ModelInfo(MODEL), ADAPTER.name: ModelInfo(ADAPTER.name, root=ADAPTER.path, parent=MODEL)}
    return [EndpointInfo(url=url, model_names=[MODEL, ADAPTER.name], Id=name, model_info=info,
                         pod_name=name if by == "pod" else None) for name, url in URLS.items()]


def _router(url: str, prefix: str, **kw) -> KvbusRouter:
    kw.setdefault("status_every", 0.0)
    return KvbusRouter(ViewClient(url, prefix), block_size=16, algo="sha256", hash_seed=SEED, **kw)


def _completion(tokens: list[int], **body) -> dict:
    return {"model": MODEL, "prompt": tokens, "max_tokens": 8, **body}


BUSY_1 = {URLS["replica-1"]: RequestStats(qps=9.0, in_prefill_requests=3, in_decoding_requests=4)}
"""replica-1 the most loaded endpoint, the others idle."""


# ---------------------------------------------------------------- by prefix


@pytest.mark.parametrize("by", ["pod", "host:port", "mapping"])
def test_a_prompt_whose_prefix_replica_1_holds_goes_to_its_endpoint(view, server, by):
    """Each rule of endpoint_replica: the pod name; the URL's host:port (a view whose bridges ran with
    --replica 10.0.0.2:8000); a configured mapping. replica-1 is the most loaded endpoint: holding
    the prefix wins over load."""
    url, prefix, store = view
    endpoints = _endpoints("pod" if by == "pod" else "url")
    kw = {}
    if by == "host:port":
        prefix = f"hp{uuid.uuid4().hex[:8]}:"
        RedisStore(server.client(), prefix).apply([_stored("10.0.0.2:8000", _chain(SYSTEM), 0)])
    elif by == "mapping":
        kw["replica_urls"] = {name: u + "/" for name, u in URLS.items()}
    router = _router(url, prefix, **kw)
    request = read_request(_completion(SYSTEM + [7, 8, 9] * 10))
    assert router.route_request(endpoints, {}, BUSY_1, request) == URLS["replica-1"]
    d = router.decide(endpoints, {}, BUSY_1, json_body(request))
    assert (d.reason, d.matched) == (ps.PREFIX, 4)
    assert d.replica == ("10.0.0.2:8000" if by == "host:port" else "replica-1")


def test_the_longest_prefix_wins_and_a_failed_holder_is_not_a_candidate(view):
    """replica-2 holds SYSTEM's first block, replica-1 all four; when production-stack retries without
    replica-1 (its failover passes the remaining endpoints), the next holder gets it."""
    url, prefix, _ = view
    router = _router(url, prefix)
    endpoints = _endpoints()
    assert router.decide(endpoints, {}, {}, _completion(SYSTEM)).url == URLS["replica-1"]
    remaining = [e for e in endpoints if e.url != URLS["replica-1"]]
    d = router.decide(remaining, {}, {}, _completion(SYSTEM))
    assert (d.url, d.reason, d.matched) == (URLS["replica-2"], ps.PREFIX, 1)
    router.min_matched_blocks = 2
    d = router.decide(remaining, {}, {}, _completion(SYSTEM))
    assert d.reason == ps.COLD, "one block is fewer than min_matched_blocks"


def test_lora_and_cache_salt_requests_are_hashed_as_the_engines_hash_them(view):
    """replica-2 holds SYSTEM as the adapter with salt tenant-a hashes it; the adapter's path comes from
    the endpoints' model_info (vLLM's /v1/models root), or from lora_paths."""
    url, prefix, _ = view
    body = {"model": ADAPTER.name, "prompt": SYSTEM, "cache_salt": "tenant-a"}
    d = _router(url, prefix).decide(_endpoints(), {}, BUSY_1, body)
    assert (d.url, d.reason, d.matched) == (URLS["replica-2"], ps.PREFIX, 4)
    bare = [EndpointInfo(url=e.url, model_names=e.model_names, pod_name=e.pod_name) for e in _endpoints()]
    d = _router(url, prefix, lora_paths={ADAPTER.name: ADAPTER.path}).decide(bare, {}, BUSY_1, body)
    assert (d.url, d.matched) == (URLS["replica-2"], 4)
    d = _router(url, prefix).decide(_endpoints(), {}, {}, {**body, "cache_salt": "tenant-b"})
    assert d.reason == ps.COLD, "another salt: other hashes"
    d = _router(url, prefix).decide(bare, {}, {}, body)
    assert d.reason == ps.COLD, "a model no endpoint lists as an adapter is hashed as a base model"
    rootless = _endpoints()
    for e in rootless:
        e.model_info = {ADAPTER.name: ModelInfo(ADAPTER.name, parent=MODEL)}
    d = _router(url, prefix).decide(rootless, {}, BUSY_1, body)
    assert d.reason == ps.UNHASHABLE and d.url != URLS["replica-1"], "an adapter without its path: by load"
    d = _router(url, prefix).decide(_endpoints(), {}, {}, {**body, "cache_salt": 12})
    assert d.reason == ps.UNHASHABLE, "a salt that is not a string"


def test_token_ids_come_from_the_request_or_the_tokenizer(view):
    url, prefix, _ = view
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}]}
    d = _router(url, prefix).decide(_endpoints(), {}, BUSY_1, chat)
    assert d.reason == ps.NO_TOKENS and d.url != URLS["replica-1"], "no token ids: by load"
    seen = []

    def tokenizer(body: dict) -> list[int] | None:
        seen.append(body)
        return SYSTEM if body.get("messages") else None

    router = _router(url, prefix, tokenizer=tokenizer)
    assert router.route_request(_endpoints(), {}, BUSY_1, read_request(chat, "/v1/chat/completions")) \
        == URLS["replica-1"]
    assert seen == [chat], "the tokenizer gets the request's JSON body"
    assert router.decide(_endpoints(), {}, {}, {"model": MODEL, "prompt": "text"}).reason == ps.NO_TOKENS
    assert prompt_tokens({"prompt": [SYSTEM]}) == SYSTEM
    assert prompt_tokens({"prompt": [1, True]}) is None and prompt_tokens({"prompt": []}) is None
    multipart = read_request(b"--x\r\nContent-Disposition: form-data; name=file\r\n\r\nabc\r\n--x--\r\n",
                             "/v1/audio/transcriptions", "multipart/form-data; boundary=x")
    assert json_body(multipart) == {}
    assert router.decide(_endpoints(), {}, {}, json_body(multipart)).reason == ps.NO_TOKENS


# ---------------------------------------------------------------- by load


def test_a_cold_prompt_goes_to_the_least_loaded_endpoint(view):
    url, prefix, _ = view
    router = _router(url, prefix)
    endpoints = _endpoints()
    u0, u1, u2 = URLS.values()
    cases = [
        # the router's own in-flight requests first
        ({}, {u0: RequestStats(in_prefill_requests=2), u1: RequestStats(in_decoding_requests=1),
              u2: RequestStats(in_prefill_requests=1, in_decoding_requests=2)}, u1),
        # then the engines' running and queued requests (an endpoint without stats is idle)
        ({u0: EngineStats(num_running_requests=4), u2: EngineStats(num_queuing_requests=1)},
         {u1: RequestStats(in_prefill_requests=1)}, u2),
        ({u0: EngineStats(num_running_requests=4), u1: EngineStats(num_queuing_requests=2),
          u2: EngineStats(num_running_requests=1, num_queuing_requests=2)}, {}, u1),
        # then the qps
        ({}, {u0: RequestStats(qps=3.0), u1: RequestStats(qps=2.0), u2: RequestStats(qps=2.5)}, u1),
    ]
    for engine_stats, request_stats, want in cases:
        d = router.decide(endpoints, engine_stats, request_stats, _completion(COLD))
        assert (d.url, d.reason) == (want, ps.COLD), (engine_stats, request_stats)
    assert endpoint_load(u0, {}, {}) == (0, 0, 0.0)


def test_ties_spread(view):
    """Equal loads spread cold prompts over every endpoint; replicas holding a prefix equally share
    its requests, the less loaded first."""
    url, prefix, store = view
    router = _router(url, prefix, tie_seed=7)
    endpoints = _endpoints()
    cold = Counter(router.route_request(endpoints, {}, {}, _completion(COLD)) for _ in range(60))
    assert set(cold) == set(URLS.values()) and min(cold.values()) >= 5, cold
    store.apply([_stored("replica-0", _chain(SYSTEM), 0)])  # replica-0 and replica-1 now tie on SYSTEM
    warm = Counter(router.route_request(endpoints, {}, {}, _completion(SYSTEM)) for _ in range(60))
    assert set(warm) == {URLS["replica-0"], URLS["replica-1"]} and min(warm.values()) >= 5, warm
    assert {router.route_request(endpoints, {}, BUSY_1, _completion(SYSTEM)) for _ in range(20)} \
        == {URLS["replica-0"]}, "the less loaded of the tied holders"
    assert router.decisions == Counter({ps.COLD: 60, ps.PREFIX: 80})


def test_a_rebuilding_view_falls_back_to_load_and_comes_back(view, caplog):
    url, prefix, store = view
    router = _router(url, prefix)
    endpoints = _endpoints()
    store.set_status(state="rebuilding", since=time.time(), phase="replaying")
    with caplog.at_level(logging.INFO, logger="kvbus.client.production_stack"):
        for _ in range(3):
            d = router.decide(endpoints, {}, BUSY_1, _completion(SYSTEM))
            assert d.reason == ps.NOT_READY and d.url != URLS["replica-1"]
        store.set_status(state="ready", since=time.time())
        d = router.decide(endpoints, {}, BUSY_1, _completion(SYSTEM))
        assert (d.url, d.reason) == (URLS["replica-1"], ps.PREFIX)
    said = [r.getMessage() for r in caplog.records]
    assert said == ["the view is rebuilding: routing by load until it is back",
                    "the view answers again: routing by prefix"], said


def test_the_status_is_read_at_most_every_status_every_seconds(view):
    url, prefix, store = view
    router = _router(url, prefix, status_every=3600.0)
    assert router.decide(_endpoints(), {}, {}, _completion(SYSTEM)).reason == ps.PREFIX
    store.set_status(state="rebuilding", since=time.time())
    assert router.decide(_endpoints(), {}, {}, _completion(SYSTEM)).reason == ps.PREFIX, "cached status"
    router.status_every = 0.0
    assert router.decide(_endpoints(), {}, {}, _completion(SYSTEM)).reason == ps.NOT_READY


def test_an_unreachable_view_routes_by_load(caplog):
    port = free_port()  # nothing listens there
    router = KvbusRouter(ViewClient(f"redis://127.0.0.1:{port}/0", socket_connect_timeout=0.5), hash_seed=SEED)
    with caplog.at_level(logging.WARNING, logger="kvbus.client.production_stack"):
        urls = {router.route_request(_endpoints(), {}, BUSY_1, _completion(SYSTEM)) for _ in range(10)}
    assert urls and URLS["replica-1"] not in urls
    assert router.decisions == Counter({ps.VIEW_ERROR: 10})
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and said[0].startswith("the view could not be read (ConnectionError"), said


# ---------------------------------------------------------------- configuration


def test_the_replica_rules_and_bad_configurations_are_named(view):
    url, prefix, _ = view
    ep = EndpointInfo(url="https://vllm.example:8443/", model_names=[MODEL])
    assert endpoint_replica(ep) == "vllm.example:8443"
    assert endpoint_replica(EndpointInfo(url="https://vllm.example", model_names=[MODEL])) == "vllm.example:443"
    assert endpoint_replica(EndpointInfo(url="http://[fd00::5]:8000", model_names=[MODEL])) == "[fd00::5]:8000"
    assert endpoint_replica(ep, {"https://vllm.example:8443": "vllm-0"}) == "vllm-0"
    twins = [EndpointInfo(url=u, model_names=[MODEL], pod_name="vllm-0") for u in list(URLS.values())[:2]]
    with pytest.raises(ValueError, match="both map to replica 'vllm-0'"):
        _router(url, prefix).decide(twins, {}, {}, _completion(SYSTEM))
    with pytest.raises(ValueError, match="no endpoint"):
        _router(url, prefix).decide([], {}, {}, _completion(SYSTEM))
    with pytest.raises(UnmatchableSeed):
        KvbusRouter(ViewClient(url, prefix), algo="xxhash")
    with pytest.raises(ValueError, match="unknown hash algorithm"):
        KvbusRouter(ViewClient(url, prefix), algo="md5")
    with pytest.raises(ValueError, match="not a number"):
        KvbusRouter(ViewClient(url, prefix), hash_seed=SEED, weights="GPU=lots")
    with pytest.raises(ValueError, match="min_matched_blocks"):
        KvbusRouter(ViewClient(url, prefix), hash_seed=SEED, min_matched_blocks=0)


def test_what_production_stacks_request_service_reads_of_its_router(view):
    """Besides route_request it calls extract_session_id(request, request_json) and reads
    max_instance_failover_reroute_attempts; the 5-argument call of its own logics works too."""
    url, prefix, _ = view
    router = KvbusRouter(ViewClient(url, prefix), hash_seed=SEED, max_instance_failover_reroute_attempts=2)
    request = read_request(_completion(SYSTEM))
    assert router.extract_session_id(request, json_body(request)) is None
    assert router.max_instance_failover_reroute_attempts == 2
    assert router.route_request(_endpoints(), {}, {}, request, _completion(SYSTEM)) == URLS["replica-1"]
    assert router.route_request(_endpoints(), {}, {}, _completion(SYSTEM)) == URLS["replica-1"]
    assert ps.PRODUCTION_STACK is False, "production-stack's router is not installed here"
    owned = KvbusRouter(url, hash_seed=SEED)
    assert owned.view.prefix == "kvbus:" and owned.route_request(_endpoints(), {}, {}, _completion(COLD))
    owned.close()


def test_with_beta_reuse_is_weighed_against_load(view):
    """``beta``: the routing policy (kvbus.client.routing.choose). replica-1 holds 4 of the prompt's 5 blocks
    and is the most loaded endpoint (7 requests in flight, the others none): a small beta keeps the prompt
    there; a beta at which its relative load outweighs its reuse sends it to an idle replica."""
    url, prefix, _ = view
    body = _completion(SYSTEM + [7, 8, 9] * 10)
    d = _router(url, prefix, beta=0.1).decide(_endpoints(), {}, BUSY_1, body)
    assert (d.replica, d.reason, d.matched) == ("replica-1", ps.PREFIX, 4)
    d = _router(url, prefix, beta=2.0).decide(_endpoints(), {}, BUSY_1, body)
    assert d.replica != "replica-1" and d.url != URLS["replica-1"], d
    with pytest.raises(ValueError):
        _router(url, prefix, beta=-1)
