"""Registry requests of ``kvbus schemas`` (``kvbus.schemas.registry``) are tried again when the
connection closes unanswered, as Apicurio now and then leaves one: a local HTTP server that closes
its first connections without a word stands in for that transport fault, which the real registry
cannot be made to show on demand (the registration itself runs against the real registry in
tests/test_schema_evolution.py)."""
from __future__ import annotations

import http.client
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Iterator

import pytest

from kvbus.schemas import registry


class _DropsFirst(BaseHTTPRequestHandler):
    """Closes the first ``server.drops`` connections unanswered, then answers ``{"id": 7}``."""

    def do_POST(self) -> None:  # noqa: N802 - http.server's naming
        self.rfile.read(int(self.headers["Content-Length"]))
        self.server.seen += 1
        if self.server.seen <= self.server.drops:
            self.close_connection = True
            return
        body = json.dumps({"id": 7}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def server(monkeypatch) -> Iterator[ThreadingHTTPServer]:
    monkeypatch.setattr(registry, "RETRY_WAIT_S", 0.01)
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _DropsFirst)
    srv.seen, srv.drops = 0, 0
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv
    srv.shutdown()
    srv.server_close()


def _url(srv: ThreadingHTTPServer) -> str:
    return f"http://127.0.0.1:{srv.server_address[1]}/apis/ccompat/v7"


def test_a_registration_closed_unanswered_is_sent_again(server) -> None:
    server.drops = registry.REQUEST_TRIES - 1
    assert registry.register_schema(_url(server), "t-value", '"string"') == 7
    assert server.seen == registry.REQUEST_TRIES


def test_a_registry_that_never_answers_raises_after_the_last_try(server) -> None:
    server.drops = registry.REQUEST_TRIES
    with pytest.raises(http.client.RemoteDisconnected):
        registry.register_schema(_url(server), "t-value", '"string"')
    assert server.seen == registry.REQUEST_TRIES
