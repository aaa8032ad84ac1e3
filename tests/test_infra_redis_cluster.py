"""``infra/stack up --redis-cluster 3`` (its Python API, ``stack.up_redis_cluster``): three masters
and three replicas on loopback in a state directory and on ports of the test's own, ready by
CLUSTER INFO, shown by ``status``, stopped by ``down`` (saved pids)."""
from __future__ import annotations

import redis

from kvbus.infra import redis_cluster, stack
from kvbus.infra.procs import port_open


def test_up_status_down_a_three_master_cluster(tmp_path, monkeypatch):
    base = redis_cluster.free_base_port(3)
    monkeypatch.setenv("KVBUS_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("KVBUS_REDIS_CLUSTER_PORT", str(base))
    try:
        info = stack.up_redis_cluster(3, timeout=60)
        ports = list(range(base, base + 6))
        assert info["url"] == f"redis+cluster://127.0.0.1:{base},127.0.0.1:{base + 1},127.0.0.1:{base + 2}/0"
        roles = []
        for p in ports:
            r = redis.Redis(port=p)
            ci = r.cluster("INFO")
            assert ci["cluster_state"] == "ok" and ci["cluster_slots_assigned"] == "16384"
            assert ci["cluster_size"] == "3" and ci["cluster_known_nodes"] == "6"
            roles.append(r.info("replication")["role"])
            r.close()
        assert sorted(roles) == ["master"] * 3 + ["slave"] * 3
        assert stack.up_redis_cluster(3)["url"] == info["url"], "idempotent"
        st = stack.status()
        nodes = {k: v for k, v in st["services"].items() if k.startswith("redis-cluster-")}
        assert len(nodes) == 6 and all(v["running"] and v["ready"] for v in nodes.values())
        assert st["redis_url"] == info["url"]
    finally:
        res = stack.down()
    assert {k: v for k, v in res.items() if k.startswith("redis-cluster-")} == \
        {f"redis-cluster-{p}": "stopped" for p in range(base, base + 6)}
    assert not any(port_open("127.0.0.1", p) for p in range(base, base + 6))
