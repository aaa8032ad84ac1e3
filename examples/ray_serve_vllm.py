"""A Ray Serve deployment of vLLM engines routed by kvbus's view (docs/client.md, "Ray Serve").

Each replica starts a vLLM OpenAI server with KV events on ZMQ and a kvbus bridge that publishes them
under the replica's Ray replica id, the name :class:`kvbus.client.ray_serve.KvbusRequestRouter` looks
up; requests (OpenAI completion bodies with token-id prompts) go to the replica holding the longest
prefix of their prompt. Run it with::

    KVBUS_BOOTSTRAP=... KVBUS_REGISTRY_URL=... serve run examples.ray_serve_vllm:app model=/models/llama

``tests/test_ray_serve.py`` runs it with two engines of a tiny model.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VllmReplica:
    """One vLLM engine and its kvbus bridge, both children of this replica (stopped with it).

    ``engine_args``: the vLLM server's arguments (``--model ...``) without its port and KV events,
    which the replica chooses; ``engine_python``: the Python that has vLLM (default: this one);
    ``engine_env``: variables for the engine. ``view_env``: the kvbus settings of the bridge (Kafka,
    registry, topics: ``KVBUS_*``); default: this process's."""

    def __init__(self, engine_args: list[str], engine_python: str | None = None,
                 engine_env: dict[str, str] | None = None, view_env: dict[str, str] | None = None,
                 start_timeout: float = 600.0) -> None:
        self.replica = serve.get_replica_context().replica_id.unique_id
        port, events, replay = _free_port(), _free_port(), _free_port()
        kv_events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{events}",
                     "replay_endpoint": f"tcp://*:{replay}", "topic": "kv-events"}
        self.url = f"http://127.0.0.1:{port}"
        self.engine = subprocess.Popen(
            [engine_python or sys.executable, "-m", "vllm.entrypoints.openai.api_server", *engine_args,
             "--host", "127.0.0.1", "--port", str(port), "--kv-events-config", json.dumps(kv_events)],
            env={**os.environ, **(engine_env or {})}, start_new_session=True)
        self.bridge = subprocess.Popen(
            [sys.executable, "-m", "kvbus", "bridge", "--endpoint", f"tcp://127.0.0.1:{events}",
             "--replay-endpoint", f"tcp://127.0.0.1:{replay}", "--replica", self.replica],
            env={**os.environ, **(view_env or {})}, start_new_session=True)
        deadline = time.monotonic() + start_timeout
        while True:
            if self.engine.poll() is not None:
                raise RuntimeError(f"the engine exited with {self.engine.returncode}")
            try:
                urllib.request.urlopen(f"{self.url}/v1/models", timeout=2).read()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the engine did not start within {start_timeout:.0f}s") from None
                time.sleep(1)

    def __call__(self, body: dict[str, Any]) -> dict[str, Any]:
        """Complete an OpenAI completions ``body`` on this replica's engine; the engine's answer, with
        ``replica`` added (which replica served it)."""
        req = urllib.request.Request(f"{self.url}/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            answer = json.loads(r.read())
        answer["replica"] = self.replica
        return answer

    def __del__(self) -> None:
        for proc in (getattr(self, "bridge", None), getattr(self, "engine", None)):
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)


def deployment(router_kwargs: dict[str, Any], num_replicas: int = 2, **options: Any) -> Any:
    """:class:`VllmReplica` as a deployment of ``num_replicas`` routed by kvbus (``router_kwargs``:
    :meth:`kvbus.client.ray_serve.KvbusRequestRouter.initialize_state`'s keywords)."""
    return serve.deployment(
        VllmReplica, num_replicas=num_replicas,
        request_router_config=RequestRouterConfig(
            request_router_class="kvbus.client.ray_serve.KvbusRequestRouter", request_router_kwargs=router_kwargs),
        **options)


def app_builder(args: dict[str, str]) -> Any:
    """``serve run examples.ray_serve_vllm:app model=DIR [block_size=16 algo=sha256 hash_seed=0 replicas=2]``."""
    block_size = args.get("block_size", "16")
    router = {"block_size": int(block_size), "algo": args.get("algo", "sha256"),
              "hash_seed": args.get("hash_seed", "0")}
    engine = ["--model", args["model"], "--block-size", block_size, "--prefix-caching-hash-algo", router["algo"]]
    return deployment(router, int(args.get("replicas", "2"))).bind(
        engine, engine_env={"PYTHONHASHSEED": router["hash_seed"]})


app = app_builder
