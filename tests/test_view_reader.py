"""``ViewClient`` as :class:`kvbus.sinks.view.reader.ViewReader`, opened from a URL as ``kvbus top``, the demo
and routers open it: summary, size, staleness and status on one Redis, one Valkey and a Redis Cluster,
against the in-memory model of the same events (tests/memory_store.py). The store contract suite
(tests/test_sink_store_contract.py) reads every backend through its ``reader()`` too."""
from __future__ import annotations

import time
import uuid
from typing import Iterator

import pytest

from kvbus.client import ViewClient
from kvbus.schemas.events import AllBlocksCleared, BlockEvent, BlockStored, canonical_hash
from tests.memory_store import InMemoryStore
from tests.view_backends import KINDS, view_server, writer

H = [canonical_hash(i * 31337 + 5) for i in range(10)]


def ev(replica: str, dp: int, seq: int, event, topic: str = "kvbus.blocks", ts: float | None = None):
    return (topic, BlockEvent(replica=replica, dp_rank=dp, epoch=1, seq=seq, index=0,
                              ts=time.time() if ts is None else ts, event=event))


@pytest.fixture(scope="module", params=KINDS)
def backend(request) -> Iterator[tuple[str, object]]:
    """(URL, a client the view's writer uses there)."""
    with view_server(request.param) as server:
        yield server


def test_the_reader_answers_what_the_model_holds(backend):
    url, client = backend
    prefix = f"v{uuid.uuid4().hex[:8]}:"
    reader = ViewClient(url, prefix)
    assert reader.summary() == {} and reader.stale() == {}
    assert reader.size() == {"entries": 0, "blocks": 0, "holders": 0}
    assert reader.status().state == "missing"
    store, model = writer(client, prefix), InMemoryStore()
    now = time.time()
    records = [
        ev("a", 0, 0, BlockStored(block_hashes=H[:4], medium="GPU")),
        ev("a", 0, 1, BlockStored(block_hashes=H[:6], medium="cpu")),
        ev("a", 0, 2, BlockStored(block_hashes=H[:2], medium="CPU", ownership="kvcr"), "kvbus.blocks.kvcr"),
        ev("b", 0, 0, BlockStored(block_hashes=H[:3], medium="GPU", group_idx=1)),
        ev("b", 1, 0, BlockStored(block_hashes=H[:1], medium=None)),
        ev("c", 0, 0, BlockStored(block_hashes=H[:1], medium="GPU")),
        ev("old", 0, 0, BlockStored(block_hashes=H[7:9], medium="GPU"), ts=now - 600),
    ]
    for s in (store, model):
        s.apply(records)
    expected = {"a": {"CPU": 6, "CPU@kvcr": 2, "GPU": 4}, "b#0": {"GPU/g1": 3}, "b#1": {"GPU": 1}, "c": {"GPU": 1},
                "old": {"GPU": 2}}
    assert reader.summary() == model.summary() == expected
    assert reader.size() == model.size() == {"entries": 19, "blocks": 8, "holders": 5}
    assert reader.status().state == "ready"
    for s in (store, model):
        assert s.expire_stale(300, now) == ["old#0"]
        s.apply([ev("c", 0, 1, AllBlocksCleared())])
    assert "c" not in reader.summary() and "old" not in reader.summary()
    assert reader.summary() == model.summary()
    assert set(reader.stale()) == set(model.stale()) == {"old#0"}
    assert reader.size() == model.size()
    assert reader.size(exact=False)["entries"] == model.size()["entries"]
    reader.close()
