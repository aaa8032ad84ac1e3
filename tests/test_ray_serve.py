"""kvbus as a Ray Serve request router (kvbus.client.ray_serve), in a real Ray Serve application on a
local Ray: two replicas of a simulated engine (tests/ray_engine.py) publish what they cache through the
real pipeline (Kafka, worker, sink, Redis), and the deployment's router reads the view.

* Requests sharing a cached prefix land on the replica that holds it, and that replica's cache hits
  them (its answer says how many blocks it had).
* Prompts no replica holds, and every request while the view cannot be read, go Ray's way (power of
  two choices): both replicas get some.
"""
from __future__ import annotations

import os
import uuid
from collections import Counter

import pytest

ray = pytest.importorskip("ray")
from ray import serve  # noqa: E402
from ray.serve.config import RequestRouterConfig  # noqa: E402

from kvbus.children import free_port  # noqa: E402
from kvbus.client import ViewClient  # noqa: E402
from kvbus.client.ray_serve import KvbusRequestRouter, request_tokens  # noqa: E402
from tests.pipeline import Pipeline, eventually  # noqa: E402
from tests.ray_engine import SimulatedEngine  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

BS = 16
SEED = "0"
SYSTEM_A = [100 + i for i in range(4 * BS)]
SYSTEM_B = [5000 + i for i in range(4 * BS)]


def test_token_ids_are_read_from_the_call_as_documented() -> None:
    assert request_tokens((), {"request_token_ids": [1, 2]}) == [1, 2]
    assert request_tokens(({"prompt": [3, 4]},), {}) == [3, 4]
    assert request_tokens(({"prompt": [[5, 6]]},), {}) == [5, 6]

    class Body:
        prompt = [7]

    assert request_tokens((Body(),), {}) == [7]
    assert request_tokens(({"prompt": "text"},), {}) is None
    assert request_tokens(({"messages": []},), {"prompt_token_ids": [True]}) is None


@pytest.fixture
def ray_local():
    ray.init(num_cpus=4, include_dashboard=False, object_store_memory=200 * 1024**2, log_to_driver=False,
             configure_logging=False)
    try:
        yield
    finally:
        serve.shutdown()
        ray.shutdown()


def test_requests_sharing_a_prefix_land_on_the_replica_that_holds_it(test_settings, tmp_path, ray_local) -> None:
    run = uuid.uuid4().hex[:8]
    prefix = f"ray{run}:"
    pipeline = Pipeline(test_settings, tmp_path)
    try:
        pipeline.start("sink", "sink", "--group", f"sink-{run}", "--prefix", prefix)
        pipeline.start("worker", "worker", "--app-id", f"ray-{run}", "--workdir", str(tmp_path))
        engine = serve.deployment(
            SimulatedEngine, num_replicas=2, max_ongoing_requests=8, ray_actor_options={"num_cpus": 0},
            request_router_config=RequestRouterConfig(
                request_router_class="kvbus.client.ray_serve.KvbusRequestRouter",
                request_router_kwargs={"view_url": test_settings.redis_url, "prefix": prefix, "block_size": BS,
                                       "algo": "sha256", "hash_seed": SEED, "status_every": 0.0}))
        handle = serve.run(engine.bind(test_settings.to_env(), BS, SEED), name=f"ray{run}", route_prefix=None)
        view = ViewClient(test_settings.redis_url, prefix)

        def ask(tokens: list[int]) -> dict:
            return handle.remote({"prompt": tokens}).result(timeout_s=60)

        def held_by(tokens: list[int], replica: str):
            """the view lists the replica as holding all four blocks of the prompt"""
            found = {m.replica: m.matched for m in view.lookup(tokens=tokens, block_size=BS, seed=SEED)}
            return found.get(replica) == 4 or None

        holders = {}
        for system in (SYSTEM_A, SYSTEM_B):
            first = ask(system + [1])
            assert first["cached_blocks"] == 0, first
            holders[tuple(system)] = first["replica"]
            eventually(lambda: held_by(system, first["replica"]), 120, pipeline)

        for system in (SYSTEM_A, SYSTEM_B):
            holder = holders[tuple(system)]
            answers = [ask(system + [7, i]) for i in range(12)]
            assert Counter(a["replica"] for a in answers) == Counter({holder: 12}), answers
            assert all(a["cached_blocks"] == 4 for a in answers), answers

        cold = Counter(ask([900_000 + 37 * i + j for j in range(BS + 1)])["replica"] for i in range(24))
        assert len(cold) == 2, f"prompts nobody holds all went to one replica: {cold}"
        pipeline.check_alive()

        # a view that cannot be read: the same deployment still serves every request, Ray's way
        blind = engine.options(request_router_config=RequestRouterConfig(
            request_router_class="kvbus.client.ray_serve.KvbusRequestRouter",
            request_router_kwargs={"view_url": f"redis://127.0.0.1:{free_port()}/0", "block_size": BS,
                                   "hash_seed": SEED}))
        handle = serve.run(blind.bind(test_settings.to_env(), BS, SEED), name=f"blind{run}", route_prefix=None)
        served = Counter(ask(SYSTEM_A + [9, i])["replica"] for i in range(12))
        assert len(served) == 2, f"with the view unreachable, requests did not spread over both replicas: {served}"
    finally:
        pipeline.stop()


def test_the_router_is_the_class_ray_loads() -> None:
    from ray.serve.request_router import RequestRouter

    assert issubclass(KvbusRequestRouter, RequestRouter)


@pytest.mark.skipif(os.environ.get("KVBUS_ENGINE_TESTS") == "0", reason="KVBUS_ENGINE_TESTS=0")
def test_two_real_vllm_engines_behind_the_router_hit_their_caches(test_settings, tmp_path, ray_local) -> None:
    """examples/ray_serve_vllm.py with two vLLM engines (vLLM for CPUs, the tiny model): requests sharing
    a prefix go to the engine that cached it, and that engine's cached_tokens show the hits."""
    from examples.ray_serve_vllm import deployment
    from kvbus.infra import vllm_engine
    from kvbus.infra.vllm_engine import EngineSpec
    from tests.vllm_server import MODEL_DIR

    python = vllm_engine.ensure()
    run = uuid.uuid4().hex[:8]
    prefix = f"rayv{run}:"
    block = 32
    spec = EngineSpec(MODEL_DIR, 0, 0, 0, seed=SEED, block_size=block)
    pipeline = Pipeline(test_settings, tmp_path)
    try:
        pipeline.start("sink", "sink", "--group", f"sink-{run}", "--prefix", prefix)
        pipeline.start("worker", "worker", "--app-id", f"rayv-{run}", "--workdir", str(tmp_path))
        router = {"view_url": test_settings.redis_url, "prefix": prefix, "block_size": block, "algo": "sha256",
                  "hash_seed": SEED, "status_every": 0.0}
        engines = deployment(router, 2, ray_actor_options={"num_cpus": 0}, max_ongoing_requests=8)
        handle = serve.run(engines.bind(spec.engine_args(), str(python), spec.environment(), test_settings.to_env()),
                           name=f"rayv{run}", route_prefix=None)
        view = ViewClient(test_settings.redis_url, prefix)
        system = [300 + i for i in range(3 * block)]

        def ask(tokens: list[int]) -> tuple[str, int]:
            answer = handle.remote({"model": spec.served_name, "prompt": tokens, "max_tokens": 2}).result(timeout_s=120)
            return answer["replica"], (answer["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0

        holder, cached = ask(system + [1, 2])
        assert cached == 0

        def held():
            """the view lists the first engine as holding the system prompt's three blocks"""
            found = {m.replica: m.matched for m in view.lookup(tokens=system, block_size=block, seed=SEED)}
            return found.get(holder) == 3 or None

        eventually(held, 120, pipeline)
        answers = [ask(system + [7, i]) for i in range(6)]
        assert answers == [(holder, 3 * block)] * 6, answers
        print(f"two vLLM engines behind Ray Serve: 6 of 6 requests to {holder}, {3 * block} cached tokens each")
    finally:
        serve.delete(f"rayv{run}")
        pipeline.stop()
