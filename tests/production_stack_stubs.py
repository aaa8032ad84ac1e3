"""Stand-ins for the objects vLLM production-stack's router hands a routing logic, field for field.

production-stack's router is not on PyPI (PyPI's ``vllm-router`` is a different, Rust router that
shares the import name ``vllm_router`` but has no ``vllm_router.routers``), and its repository's
package needs Python 3.12, so the tests build these values themselves, with the fields and
defaults of ``src/vllm_router/service_discovery.py`` (``EndpointInfo``, ``ModelInfo``) and
``src/vllm_router/stats/`` (``EngineStats``, ``RequestStats``). The request is a real Starlette
request (production-stack's FastAPI requests are Starlette's), its body read the way
production-stack's request service reads it before it routes (:func:`read_request`).
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request


@dataclass
class ModelInfo:
    """A model an engine serves, from its ``/v1/models``: an adapter has a ``parent``, and vLLM
    reports its path as ``root``."""

    id: str
    object: str = "model"
    created: int = 0
    owned_by: str = "vllm"
    root: str | None = None
    parent: str | None = None
    is_adapter: bool = False
    extra_fields: dict[str, Any] | None = None


@dataclass
class EndpointInfo:
    """One engine endpoint as service discovery reports it."""

    url: str
    model_names: list[str]
    Id: str = ""
    added_timestamp: float = field(default_factory=time.time)
    model_label: str = "default"
    sleep: bool = False
    healthy: bool = True
    pod_name: str | None = None
    service_name: str | None = None
    namespace: str | None = None
    model_info: dict[str, ModelInfo] | None = None


@dataclass
class EngineStats:
    """What the router scrapes from an engine's ``/metrics``."""

    num_running_requests: int = 0
    num_queuing_requests: int = 0
    gpu_prefix_cache_hit_rate: float = 0.0
    gpu_prefix_cache_hits_total: int = 0
    gpu_prefix_cache_queries_total: int = 0
    gpu_cache_usage_perc: float = 0.0


@dataclass
class RequestStats:
    """What the router counts of its own requests to an engine."""

    qps: float = 0.0
    ttft: float = 0.0
    in_prefill_requests: int = 0
    in_decoding_requests: int = 0
    finished_requests: int = 0
    uptime: int = 0
    avg_decoding_length: float = 0.0
    avg_latency: float = 0.0
    avg_itl: float = -1.0
    num_swapped_requests: int = 0


def read_request(body: dict | bytes, path: str = "/v1/completions",
                 content_type: str = "application/json") -> Request:
    """A Starlette request for ``body`` (a dict is sent as JSON) whose body has been read with
    ``await request.body()``, as production-stack's request service does before routing."""
    raw = json.dumps(body).encode() if isinstance(body, dict) else body

    async def receive() -> dict:
        return {"type": "http.request", "body": raw, "more_body": False}

    async def read() -> Request:
        scope = {"type": "http", "method": "POST", "path": path, "query_string": b"",
                 "headers": [(b"content-type", content_type.encode()), (b"content-length", str(len(raw)).encode())]}
        request = Request(scope, receive)
        assert await request.body() == raw
        return request

    return asyncio.run(read())
