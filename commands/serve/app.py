"""The HTTP service of ``kvbus serve`` (aiohttp): the query API, probes and metrics on one port.

| path | answer |
|---|---|
| ``POST /query`` | ``{tenant: {instance: {"longest_matched", "GPU", "CPU", "DISK", ..., "DP"}}}`` for ``token_ids`` |
| ``POST /query_by_hash`` | the same for ``seq_hashes`` |
| ``GET /healthz`` | ``200 ok`` while the process serves HTTP |
| ``GET /readyz`` | 200 while the view's status is ``ready``, else 503 with the reason (:mod:`kvbus.runtime.probes`) |
| ``GET /metrics`` | the Prometheus exposition of :class:`kvbus.serve.metrics.ServeMetrics` |

Errors are JSON ``{"error": "...", "field": ...}``: 400 for a request the API cannot answer (``field``
names the request field), 413 for a body over the limit, 404 / 405 for other paths and methods, 503
while the view cannot be read (Redis down, no function library, a view of another layout), 500 for a
fault of the server (logged with its traceback).

Lookups call Redis through redis-py, which blocks: they run on a thread pool (``threads``) so the
event loop keeps reading requests and answering probes meanwhile; with ``threads=0`` they run on the
loop itself (docs/benchmarks.md has both measured).
"""
from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Awaitable, Callable

import msgspec
import redis
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvbus.client import BY_NAME, FunctionsMissing, LayoutMismatch, Shuffle, ViewClient
from kvbus.runtime.probes import Readiness
from kvbus.schemas.lookup import READY
from kvbus.serve.metrics import ServeMetrics
from kvbus.serve.query import BadRequest, Hashing, answer, ask, parse, parse_report, predict, route
from kvbus.serve.serve_config import ServeConfig

log = logging.getLogger("kvbus.serve")

PATHS = ("/query", "/query_by_hash", "/route", "/predict", "/load", "/healthz", "/readyz", "/metrics")
"""The paths the service answers; metrics label any other as ``other``."""
VIEW_DOWN = (redis.RedisError, OSError, FunctionsMissing, LayoutMismatch)
"""Errors of reading the view: answered 503."""

_encode = msgspec.json.Encoder().encode


def json_response(body: Any, status: int = 200) -> web.Response:
    """``body`` as a JSON answer."""
    return web.Response(body=_encode(body), status=status, content_type="application/json")


def error_response(status: int, message: str, field: str | None = None) -> web.Response:
    """An error answer: ``{"error": message, "field": field}``."""
    return json_response({"error": message, "field": field}, status)


class Service:
    """The query service over one :class:`~kvbus.client.ViewClient`: :meth:`app` is its aiohttp app,
    :meth:`close` stops its lookup threads (the client is the caller's to close)."""

    def __init__(self, view: ViewClient, config: ServeConfig | None = None, metrics: ServeMetrics | None = None):
        self.view = view
        self.config = config = config if config is not None else ServeConfig()
        self.hashing: Hashing = config.hashing
        self.metrics = metrics or ServeMetrics()
        self.executor = (ThreadPoolExecutor(config.threads, thread_name_prefix="kvbus-serve-lookup")
                         if config.threads else None)
        self.readiness = Readiness([self.view_not_ready])

    def close(self) -> None:
        """Stop the lookup threads."""
        if self.executor is not None:
            self.executor.shutdown(wait=False, cancel_futures=True)

    async def _blocking(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on a lookup thread (on the loop with ``threads=0``)."""
        if self.executor is None:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    # -- probes -------------------------------------------------------------------

    def view_not_ready(self) -> str | None:
        """Why answers cannot be trusted now (``/readyz``), None when the view is ``ready``."""
        try:
            status = self.view.status()
        except VIEW_DOWN as e:
            return f"Redis unavailable ({type(e).__name__}: {e})"
        if status.state != READY:
            phase = f", {status.phase}" if status.phase else ""
            return f"the view is {status.state}{phase} (P status under {self.view.prefix!r})"
        return None

    async def healthz(self, request: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def readyz(self, request: web.Request) -> web.Response:
        ready, body = await self._blocking(self.readiness.answer)
        return web.Response(body=body, status=200 if ready else 503, content_type="application/json")

    async def prometheus(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    # -- queries ------------------------------------------------------------------

    async def _query(self, request: web.Request, by_hash: bool) -> web.Response:
        q = parse(await request.read(), by_hash, self.hashing)
        t0 = time.perf_counter()
        try:
            holders = await self._blocking(ask, self.view, q, self.hashing)
        except ValueError as e:  # what the client cannot hash or ask (not a view error: those are not ValueErrors)
            raise BadRequest(str(e)) from None
        self.metrics.lookup_seconds.observe(time.perf_counter() - t0)
        body = answer(q, holders)
        self.metrics.instances.observe(len(body[q.tenant]))
        return json_response(body)

    async def query(self, request: web.Request) -> web.Response:
        return await self._query(request, by_hash=False)

    async def query_by_hash(self, request: web.Request) -> web.Response:
        return await self._query(request, by_hash=True)

    async def route(self, request: web.Request) -> web.Response:
        """``POST /route``: the routing policy's choice among the request's instances (:func:`route`)."""
        body = await request.read()
        try:
            return json_response(await self._blocking(route, self.view, body, self.hashing))
        except BadRequest:
            raise
        except ValueError as e:  # what the client cannot hash or ask
            raise BadRequest(str(e)) from None

    async def predict(self, request: web.Request) -> web.Response:
        """``POST /predict``: a routed prompt's blocks, predicted on its instance (:func:`predict`)."""
        body = await request.read()
        try:
            n = await self._blocking(predict, self.view, body, self.hashing)
        except BadRequest:
            raise
        except ValueError as e:  # what the client cannot hash, a TTL out of range
            raise BadRequest(str(e)) from None
        return json_response({"predicted": n})

    # -- shared load --------------------------------------------------------------

    async def load(self, request: web.Request) -> web.Response:
        """``GET /load``: the routers' shared load, ``{"<replica>": {"requests": n, "tokens": t}}``."""
        loads = await self._blocking(self.view.load)
        return json_response({r: {"requests": x.requests, "tokens": x.tokens} for r, x in loads.items()})

    async def report(self, request: web.Request) -> web.Response:
        """``POST /load`` ``{"router": name, "lease": seconds, "load": {"<replica>": {"requests": n, "tokens":
        t}}}``: a router's whole load on the replicas it names (absolute counts), and its lease renewed."""
        router, loads, lease = parse_report(await request.read())
        await self._blocking(self.view.report, router, loads, lease)
        return json_response({"router": router, "replicas": len(loads)})

    # -- the app ------------------------------------------------------------------

    @web.middleware
    async def _observe(self, request: web.Request,
                       handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        """Count and time every request; turn every error into its JSON answer."""
        path = request.path if request.path in PATHS else "other"
        m = self.metrics
        m.in_flight.inc()
        t0 = time.perf_counter()
        kind = None
        try:
            resp = await handler(request)
        except BadRequest as e:
            kind, resp = "bad_request", json_response(e.to_json(), 400)
        except web.HTTPRequestEntityTooLarge as e:
            kind, resp = "too_large", error_response(413, f"the body is larger than {self.config.max_body} bytes "
                                                          f"(KVBUS_SERVE_MAX_BODY): {e.text}")
        except web.HTTPException as e:
            kind = "not_found" if e.status in (404, 405) else "bad_request"
            resp = error_response(e.status, f"{request.method} {request.path}: {e.reason}; the API answers "
                                            "POST /query, POST /query_by_hash, POST /route, POST /predict, "
                                            "GET and POST /load, GET /healthz, /readyz, /metrics")
        except VIEW_DOWN as e:
            log.warning("%s: the view cannot be read: %s: %s", request.path, type(e).__name__, e)
            kind, resp = "view_unavailable", error_response(503, f"the view cannot be read: {type(e).__name__}: {e}")
        except Exception as e:  # noqa: BLE001 - any other fault is the server's: 500, logged with its traceback
            log.exception("%s %s failed", request.method, request.path)
            kind, resp = "internal", error_response(500, f"internal error: {type(e).__name__}: {e}")
        finally:
            m.in_flight.dec()
        m.seconds.labels(path).observe(time.perf_counter() - t0)
        m.requests.labels(path, str(resp.status)).inc()
        if kind is not None:
            m.errors.labels(path, kind).inc()
        return resp

    def app(self) -> web.Application:
        """The aiohttp application."""
        app = web.Application(middlewares=[self._observe], client_max_size=self.config.max_body)
        app.add_routes([
            web.post("/query", self.query),
            web.post("/query_by_hash", self.query_by_hash),
            web.post("/route", self.route),
            web.post("/predict", self.predict),
            web.get("/load", self.load),
            web.post("/load", self.report),
            web.get("/healthz", self.healthz),
            web.get("/readyz", self.readyz),
            web.get("/metrics", self.prometheus),
        ])
        return app


def view_client(url: str, config: ServeConfig, **redis_kwargs: Any) -> ViewClient:
    """The service's client of the view at ``url`` under ``config.prefix``, with its tie-break."""
    tie_break = BY_NAME if config.tie_break == "name" else Shuffle()
    return ViewClient(url, config.prefix, tie_break=tie_break, **redis_kwargs)
