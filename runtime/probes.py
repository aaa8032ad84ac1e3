"""Health and readiness endpoints beside ``/metrics``, on each stage's metrics port.

| path | answer |
|---|---|
| ``/healthz`` | ``200 ok`` while the process serves HTTP (liveness: restart the process when it does not answer) |
| ``/readyz`` | ``200 {"ready": true}`` when every check of the stage passes, else ``503`` with the reasons |
| anything else | the stage's registry (``/metrics``) and the process's own metrics, as prometheus_client serves them |

A check is a function returning None (fine) or the reason the stage is not ready, one sentence; a
check that raises counts as not ready, with the error as its reason. What each stage checks is in
its CLI module (the bridge: the engine socket and the producer; the worker: its partitions and
recovery; the sink: the view's state and its lag).

Hand-written on purpose, in a few lines: prometheus_client serves one WSGI app per port and has no
routes of its own; this module puts the two paths in front of its app and serves the three with
its threaded server (``prometheus_client.exposition.ThreadingWSGIServer``).
"""
from __future__ import annotations

import json
import threading
from typing import Any, Callable, Iterable
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

from kvbus.runtime import allocator

Check = Callable[[], "str | None"]
"""None when the condition holds, else why the stage is not ready."""


class Readiness:
    """The checks a stage's ``/readyz`` runs, in order; more can be added while the stage starts."""

    def __init__(self, checks: Iterable[Check] = (), starting: str | None = None) -> None:
        self._checks: list[Check] = list(checks)
        self.starting = starting
        """What the stage waits for while it starts (``/readyz``: "starting: waiting for <this>"),
        None once it runs and its checks decide."""

    def add(self, check: Check) -> None:
        """Run ``check`` too from now on."""
        self._checks.append(check)

    def reasons(self) -> list[str]:
        """Why the stage is not ready (empty: ready)."""
        starting = self.starting
        if starting is not None:
            return [f"starting: waiting for {starting}"]
        out = []
        for check in list(self._checks):
            try:
                reason = check()
            except Exception as exc:  # noqa: BLE001 - a failing check means "not ready", with its error
                reason = f"readiness check failed: {type(exc).__name__}: {exc}"
            if reason:
                out.append(reason)
        return out

    def answer(self) -> tuple[bool, bytes]:
        """``/readyz``'s answer: (ready, the JSON body ``{"ready": true}`` or ``{"ready": false,
        "reasons": [...]}`` with its newline); HTTP 200 when ready, else 503."""
        reasons = self.reasons()
        body = {"ready": not reasons, **({"reasons": reasons} if reasons else {})}
        return not reasons, json.dumps(body).encode() + b"\n"


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """No line per request (probes come every few seconds)."""


def probe_app(registry: CollectorRegistry, readiness: Readiness) -> Callable:
    """The WSGI app: ``/healthz``, ``/readyz``, and prometheus_client's app for every other path,
    serving ``registry`` with the process's own metrics added (:func:`kvbus.runtime.allocator.register`;
    once per registry)."""
    allocator.register(registry)
    metrics = make_wsgi_app(registry)

    def app(environ: dict, start_response: Callable) -> list[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == "/healthz":
            start_response("200 OK", [("Content-Type", "text/plain; charset=utf-8")])
            return [b"ok\n"]
        if path == "/readyz":
            ready, body = readiness.answer()
            start_response("200 OK" if ready else "503 Service Unavailable", [("Content-Type", "application/json")])
            return [body]
        return metrics(environ, start_response)

    return app


def serve(port: int, registry: CollectorRegistry, readiness: Readiness, addr: str = "0.0.0.0") -> WSGIServer:
    """Serve ``/metrics`` (``registry``), ``/healthz`` and ``/readyz`` (``readiness``) on
    ``addr:port`` from a daemon thread; returns the server (``shutdown()`` stops it)."""
    server = make_server(addr, port, probe_app(registry, readiness), ThreadingWSGIServer, handler_class=_Quiet)
    threading.Thread(target=server.serve_forever, name=f"probes:{port}", daemon=True).start()
    return server
