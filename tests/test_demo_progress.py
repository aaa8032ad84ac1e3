"""Reading the stages' counters from their Prometheus endpoints (kvbus.demo_progress.scrape_all)."""
from __future__ import annotations

import socket
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from threading import Thread

from prometheus_client import CollectorRegistry, Counter, generate_latest

from kvbus.demo_progress import scrape, scrape_all


def serve(registry: CollectorRegistry) -> tuple[ThreadingHTTPServer, list[str]]:
    """A /metrics endpoint of ``registry`` on a free port, and the paths it was asked for."""
    asked: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            asked.append(self.path)
            body = generate_latest(registry)
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    Thread(target=server.serve_forever, daemon=True).start()
    return server, asked


def test_several_counters_come_from_one_scrape_each_summed_over_its_labels() -> None:
    r = CollectorRegistry()
    consolidated = Counter("kvbus_streams_consolidated", "c", registry=r)
    passthrough = Counter("kvbus_streams_passthrough", "p", registry=r)
    dead = Counter("kvbus_streams_dead_letters", "d", ["reason"], registry=r)
    consolidated.inc(3)
    passthrough.inc(4)
    dead.labels("decode").inc(1)
    dead.labels("invariant").inc(2)
    server, asked = serve(r)
    try:
        port = server.server_address[1]
        got = scrape_all(port, (r"kvbus_streams_(consolidated|passthrough)_total", r"kvbus_streams_dead_letters_total",
                                r"kvbus_streams_nothing_total"))
        assert got == [7.0, 3.0, 0.0]
        assert asked == ["/metrics"], f"one request for three counters, asked {asked}"
        assert scrape(port, r"kvbus_streams_passthrough_total") == 4.0
    finally:
        server.shutdown()


def test_an_endpoint_that_does_not_answer_reads_zero_for_every_counter() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed when the block ends: nothing listens there
    assert scrape_all(port, ("a_total", "b_total")) == [0.0, 0.0]
