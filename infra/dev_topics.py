"""The development stack's topics, created as declared (:mod:`kvbus.schemas.topics`) through the one
topic-creation site, :func:`kvbus.runtime.kafka_clients.ensure_topics`; and record topics by name for
tests and benchmarks::

    from kvbus.infra.dev_topics import ensure_topics
    ensure_topics("127.0.0.1:9092", ["kvbus.blocks.alice"], partitions=4, replication=1)
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Any

from kvbus.runtime.settings import DEFAULT_PARTITIONS
from kvbus.schemas.topics import record_spec, topic_specs

from .stack_env import kvbus_settings, topic_names

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


def ensure_topics(
    bootstrap: str,
    names: Iterable[str],
    partitions: int = DEFAULT_PARTITIONS,
    replication: int = 1,
    config: Mapping[str, str] | None = None,
    timeout: float = 30.0,
    client_conf: Mapping[str, Any] | None = None,
) -> list[str]:
    """Create the missing topics among ``names`` as record topics (:func:`kvbus.schemas.topics.record_spec`),
    ``config`` laid over their configuration; existing topics are left untouched. ``client_conf``: more
    admin client properties (credentials of a secured cluster). Waits until every requested topic has
    a leader for each partition; returns the names created by this call."""
    from kvbus.runtime import kafka_clients

    extra = {k: str(v) for k, v in (config or {}).items()}
    specs = [replace(spec, config={**spec.config, **extra}) for spec in (record_spec(n, partitions, replication)
                                                                          for n in names)]
    return kafka_clients.ensure_topics(admin_client(bootstrap, **(client_conf or {})), specs, timeout)


def kvbus_topics() -> list[str]:
    """The kvbus record topic names (``KVBUS_TOPIC_*`` or defaults; :func:`~kvbus.infra.stack_env.topic_names`)."""
    return list(topic_names().values())


def ensure_kvbus_topics(bootstrap: str, replication: int, client_conf: Mapping[str, Any] | None = None) -> list[str]:
    """Create every topic a deployment declares up front (:func:`kvbus.schemas.topics.topic_specs`: the
    record topics with ``$KVBUS_PARTITIONS`` partitions, the compacted snapshot topic), replicated
    ``replication`` times; ``client_conf``: see :func:`ensure_topics`."""
    from kvbus.runtime import kafka_clients

    settings = kvbus_settings()
    specs = topic_specs(settings.topics, settings.partitions, replication)
    return kafka_clients.ensure_topics(admin_client(bootstrap, **(client_conf or {})), specs)
