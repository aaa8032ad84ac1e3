"""Shared load (kvbus.client.load, ``ViewClient.load`` / ``lookup_with_load``): several routers report the
requests they route to the view's Redis and every router reads the same sums, on one Redis, one Valkey and a
Redis Cluster; a router killed mid-request stops counting once its lease runs out; a Redis restarted empty
is filled again by the routers' next reports; a sink's wipe keeps the load."""
from __future__ import annotations

import logging
import subprocess
import sys
import time
import uuid
from typing import Callable, Iterator

import pytest

from kvbus.client import Load, LoadReporter, ViewClient
from kvbus.infra.scratch_redis import RedisServer
from kvbus.schemas import lookup
from kvbus.schemas.events import BlockEvent, BlockStored, canonical_hash
from tests.view_backends import KINDS, view_server, writer

CHAIN = [canonical_hash(i + 7001) for i in range(4)]


def wait_until(what: str, ok: Callable[[], bool], seen: Callable[[], object], timeout: float = 20.0) -> None:
    """Poll ``ok`` until it holds; else fail saying ``what`` was waited for and what ``seen`` gives now."""
    deadline = time.monotonic() + timeout
    while not ok():
        if time.monotonic() > deadline:
            pytest.fail(f"waited {timeout:.0f} s for {what}; saw {seen()!r}")
        time.sleep(0.05)


@pytest.fixture(scope="module", params=KINDS)
def backend(request) -> Iterator[tuple[str, object]]:
    """(URL, a client the view's writer uses there)."""
    with view_server(request.param) as server:
        yield server


def test_every_router_reads_the_sum_of_every_routers_reports(backend):
    url, client = backend
    prefix = f"l{uuid.uuid4().hex[:8]}:"
    store = writer(client, prefix)
    store.apply([("kvbus.blocks", BlockEvent(replica=r, dp_rank=0, epoch=1, seq=0, index=0, ts=time.time(),
                                             event=BlockStored(block_hashes=CHAIN[:n], medium="GPU")))
                 for r, n in (("a", 4), ("b", 2))])
    one, two = ViewClient(url, prefix), ViewClient(url, prefix)
    r1, r2 = LoadReporter(one, "router-1"), LoadReporter(two, "router-2")
    r1.started("a", 100)
    r1.started("a", 50)
    r2.started("a", 10)
    r2.started("b", 20)
    want = {"a": Load(3, 160), "b": Load(1, 20)}
    assert one.load() == two.load() == want
    matches, load = two.lookup_with_load(hashes=CHAIN)
    assert [(m.replica, m.matched) for m in matches] == [("a", 4), ("b", 2)] and load == want
    assert one.lookup_with_load(hashes=[]) == ([], want)
    r1.finished("a", 100)
    with r2.request("c", 5):
        assert two.load()["c"] == Load(1, 5)
    r2.finished("b", 20)
    assert one.load() == {"a": Load(2, 60)}
    # a sink's wipe (a rebuild) leaves the routers' load alone
    store.wipe()
    assert two.load() == {"a": Load(2, 60)}


ROUTER = """
import sys, time
from kvbus.client import LoadReporter, ViewClient
reporter = LoadReporter(ViewClient(sys.argv[1], sys.argv[2]), "doomed", lease=float(sys.argv[3]))
reporter.started("a", 1000)
print("routed", flush=True)
time.sleep(600)  # mid-request when it is killed
"""


def test_a_router_killed_mid_request_stops_counting_when_its_lease_runs_out():
    with RedisServer() as srv:
        prefix = f"l{uuid.uuid4().hex[:8]}:"
        view = ViewClient(srv.url, prefix)
        alive = LoadReporter(view, "alive", lease=60)
        alive.started("a", 10)
        proc = subprocess.Popen([sys.executable, "-c", ROUTER, srv.url, prefix, "1.5"], stdout=subprocess.PIPE,
                                text=True)
        try:
            assert proc.stdout.readline().strip() == "routed"
            assert view.load() == {"a": Load(2, 1010)}
            proc.kill()
            proc.wait(10)
        finally:
            proc.kill()
        wait_until("the killed router's lease to run out", lambda: view.load() == {"a": Load(1, 10)}, view.load)
        # its fields stay until a router forgets them; then only the live router's are left
        assert view.forget_routers(older_than=0) == 3
        assert view.load() == {"a": Load(1, 10)}
        assert view.forget_routers(older_than=0) == 0


def test_a_redis_restarted_empty_is_filled_again_by_the_next_reports(caplog):
    with RedisServer() as srv:
        prefix = f"l{uuid.uuid4().hex[:8]}:"
        view = ViewClient(srv.url, prefix, socket_timeout=2, socket_connect_timeout=2)
        reporter = LoadReporter(view, "r")
        reporter.started("a", 10)
        reporter.started("b", 20)
        srv.kill()
        with caplog.at_level(logging.WARNING, logger="kvbus.client.load"):
            reporter.started("a", 30)  # Redis down: no raise, one warning
            reporter.finished("b", 20)
        assert [r.message for r in caplog.records if "not reported" in r.message] != []
        srv.start()
        assert view.load() == {}, "the restarted server has no persistence"
        reporter.started("c", 1)  # the first report after a failure writes the whole book again
        assert view.load() == {"a": Load(2, 40), "c": Load(1, 1)}


def test_load_fields_and_their_sums():
    now = 1_000_000
    req, tok = lookup.load_fields("r1", "a#0")
    raw = {b"r1": str(now + 1).encode(), req.encode(): b"2", tok.encode(): b"300",
           b"r2": str(now - 1).encode(), b"r2\0a#0": b"5", b"r2\0a#0\0t": b"9",
           b"r3": str(now + 5).encode(), b"r3\0b": b"-1", b"r3\0b\0t": b"0"}
    assert lookup.parse_load(raw, now) == {"a#0": Load(2, 300)}, "r2's lease ran out; r3's sum below 0 is 0"
    assert sorted(lookup.expired_fields(raw, now)) == [b"r2", b"r2\0a#0", b"r2\0a#0\0t"]
    for bad in ("", "x\0y"):
        with pytest.raises(ValueError):
            lookup.load_fields(bad, "a")
        with pytest.raises(ValueError):
            lookup.load_fields("r", bad)
