"""Idempotent Kafka topic creation with ``confluent_kafka.admin.AdminClient``.

Reusable by other components, e.g. for ``kvbus.blocks.<ownership>`` topics::

    from kvbus.infra.topics import ensure_topics
    ensure_topics("127.0.0.1:9092", ["kvbus.blocks.alice"], partitions=4, replication=1)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from typing import Any

from kvbus.schemas.settings import DEFAULT_PARTITIONS
from kvbus.schemas.topics import min_insync, record_topic_config

from .settings import kvbus_settings, topic_names

log = logging.getLogger("infra")

# librdkafka chatter (connection refused while brokers start, ...) is dropped
_QUIET = logging.getLogger("infra.librdkafka.quiet")
_QUIET.propagate = False
_QUIET.addHandler(logging.NullHandler())
_QUIET.setLevel(logging.CRITICAL + 1)


def _admin_module() -> Any:
    try:
        from confluent_kafka import KafkaError, KafkaException, admin  # noqa: F401
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise RuntimeError(
            "confluent_kafka is not importable; install it into the venv: .venv/bin/pip install 'confluent-kafka[avro]'"
        ) from exc
    return admin


def require_client() -> None:
    """Fail early, with an install hint, if confluent_kafka is missing."""
    _admin_module()


def admin_client(bootstrap: str, **extra: Any) -> Any:
    """An ``AdminClient`` for ``bootstrap`` whose librdkafka logs are silenced."""
    admin = _admin_module()
    conf: dict[str, Any] = {
        "bootstrap.servers": bootstrap,
        "logger": _QUIET,
        "socket.connection.setup.timeout.ms": 3000,
    }
    conf.update(extra)
    return admin.AdminClient(conf)


def default_min_insync(replication: int) -> int:
    """``min.insync.replicas`` for a replication factor: 2 when RF >= 3, else 1
    (:func:`kvbus.schemas.topics.min_insync`)."""
    return min_insync(replication)


def ensure_topics(
    bootstrap: str,
    names: Iterable[str],
    partitions: int = DEFAULT_PARTITIONS,
    replication: int = 1,
    config: Mapping[str, str] | None = None,
    timeout: float = 30.0,
    client_conf: Mapping[str, Any] | None = None,
) -> list[str]:
    """Create the missing topics among ``names``; existing topics are left untouched.
    ``client_conf``: more admin client properties (credentials of a secured cluster).

    ``config`` defaults to ``{"min.insync.replicas": default_min_insync(replication)}``.
    Waits until every requested topic has a leader for each partition.
    Returns the names that were created by this call.
    """
    from confluent_kafka import KafkaError, KafkaException

    admin_mod = _admin_module()
    wanted = list(dict.fromkeys(names))
    if not wanted:
        return []
    cfg = {"min.insync.replicas": str(default_min_insync(replication))}
    if config:
        cfg.update({k: str(v) for k, v in config.items()})
    client = admin_client(bootstrap, **(client_conf or {}))
    md = client.list_topics(timeout=timeout)
    missing = [n for n in wanted if n not in md.topics or md.topics[n].error is not None]
    created: list[str] = []
    if missing:
        new = [admin_mod.NewTopic(n, num_partitions=partitions, replication_factor=replication, config=cfg)
               for n in missing]
        futures = client.create_topics(new, operation_timeout=timeout, request_timeout=timeout)
        for name, fut in futures.items():
            try:
                fut.result(timeout=timeout)
                created.append(name)
            except KafkaException as exc:
                err = exc.args[0] if exc.args else None
                if isinstance(err, KafkaError) and err.code() == KafkaError.TOPIC_ALREADY_EXISTS:
                    continue
                raise
    _wait_for_leaders(client, wanted, timeout)
    if created:
        log.info("created topics %s (partitions=%d, replication=%d)", ", ".join(created), partitions, replication)
    return created


def _wait_for_leaders(client: Any, names: list[str], timeout: float) -> None:
    """Block until metadata shows every topic in ``names`` with a leader on each partition."""
    deadline = time.monotonic() + timeout
    pending = list(names)
    while True:
        md = client.list_topics(timeout=max(1.0, deadline - time.monotonic()))
        pending = [
            n
            for n in names
            if n not in md.topics
            or md.topics[n].error is not None
            or not md.topics[n].partitions
            or any(p.leader < 0 for p in md.topics[n].partitions.values())
        ]
        if not pending:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"topics without leaders after {timeout:.0f}s: {', '.join(pending)}")
        time.sleep(0.2)


def kvbus_topics() -> list[str]:
    """The four kvbus topic names (``KVBUS_TOPIC_*`` or defaults)."""
    return list(topic_names().values())


def ensure_kvbus_topics(bootstrap: str, replication: int, client_conf: Mapping[str, Any] | None = None) -> list[str]:
    """Create the kvbus topics with ``$KVBUS_PARTITIONS`` (default 4) partitions and the record topics'
    configuration (:func:`kvbus.schemas.topics.record_topic_config`; ``client_conf``: see :func:`ensure_topics`)."""
    return ensure_topics(bootstrap, kvbus_topics(), partitions=kvbus_settings().partitions, replication=replication,
                         config=record_topic_config(replication), client_conf=client_conf)
