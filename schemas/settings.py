"""Connection settings every kvbus command honours, from the environment.

| variable | default | meaning |
|---|---|---|
| ``KVBUS_BOOTSTRAP`` | ``127.0.0.1:9092`` | Kafka bootstrap servers (comma-separated) |
| ``KVBUS_REGISTRY_URL`` | ``http://127.0.0.1:8081/apis/ccompat/v7`` | Confluent-compatible schema registry |
| ``KVBUS_REDIS_URL`` | ``redis://127.0.0.1:6379/0`` | Redis holding the residency view |
| ``KVBUS_PARTITIONS`` | ``4`` | partitions of kvbus topics (Faust needs them co-partitioned) |
| ``KVBUS_MAX_RECORD_BYTES`` | ``900000`` | largest raw EventBatch value produced; larger engine batches are split |
| ``KVBUS_TOPIC_*`` | see ``kvbus.schemas.topics`` | topic names |
| ``KVBUS_KAFKA_*``, ``KVBUS_REDIS_USERNAME`` / ``..._PASSWORD`` / ``..._SSL_CA``, ``KVBUS_REGISTRY_USERNAME`` / ... | unset: open | how to authenticate: ``kvbus.schemas.security`` |
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

from kvbus.schemas.env import COUNT, TEXT, read
from kvbus.schemas.security import Security
from kvbus.schemas.topics import Topics

DEFAULT_BOOTSTRAP = "127.0.0.1:9092"
DEFAULT_REGISTRY_URL = "http://127.0.0.1:8081/apis/ccompat/v7"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
DEFAULT_PARTITIONS = 4
DEFAULT_MAX_RECORD_BYTES = 900_000
"""Largest EventBatch value the producers write as one Kafka record: a little under librdkafka's
``message.max.bytes`` (1,000,000; not overridden by kvbus) and the broker's default
``max.message.bytes`` (1,048,588), leaving room for the key and the record framing."""


KAFKA_LOGGER = logging.getLogger("kvbus.kafka")
"""Where librdkafka's own log lines go (:meth:`Settings.kafka`)."""


def client_conf(kafka: "str | Mapping[str, Any]") -> dict[str, Any]:
    """A confluent-kafka base configuration from ``kafka``: a bootstrap string (an open cluster) or
    a configuration from :meth:`Settings.kafka` (bootstrap servers and security properties)."""
    return {"bootstrap.servers": kafka} if isinstance(kafka, str) else dict(kafka)


@dataclass(frozen=True)
class Settings:
    """Where the services are and how topics are named."""

    bootstrap: str = DEFAULT_BOOTSTRAP
    """Kafka bootstrap servers, comma-separated host:port."""
    registry_url: str = DEFAULT_REGISTRY_URL
    """Schema registry base URL (Confluent API)."""
    redis_url: str = DEFAULT_REDIS_URL
    """Redis URL of the residency view."""
    partitions: int = DEFAULT_PARTITIONS
    """Partitions of every kvbus topic."""
    topics: Topics = field(default_factory=Topics)
    """Topic names."""
    max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES
    """Largest raw EventBatch value (bytes, Confluent header included) produced as one record;
    an engine batch whose value is larger is produced as several records (``first_index``)."""
    security: Security = field(default_factory=Security)
    """How to authenticate to Kafka, Redis and the registry (``kvbus.schemas.security``; default: open)."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "Settings":
        """Settings from KVBUS_* variables (of ``environ``, default the process's), defaults for the
        unset or blank ones; :class:`~kvbus.schemas.env.SettingError` names a malformed one."""
        env = os.environ if environ is None else environ
        return cls(
            bootstrap=read(env, "KVBUS_BOOTSTRAP", TEXT, DEFAULT_BOOTSTRAP),
            registry_url=read(env, "KVBUS_REGISTRY_URL", TEXT, DEFAULT_REGISTRY_URL),
            redis_url=read(env, "KVBUS_REDIS_URL", TEXT, DEFAULT_REDIS_URL),
            partitions=read(env, "KVBUS_PARTITIONS", COUNT, DEFAULT_PARTITIONS),
            topics=Topics.from_env(env),
            max_record_bytes=read(env, "KVBUS_MAX_RECORD_BYTES", COUNT, DEFAULT_MAX_RECORD_BYTES),
            security=Security.from_env(env),
        )

    def kafka(self, **conf: Any) -> dict[str, Any]:
        """A confluent-kafka client configuration: the bootstrap servers, librdkafka's log lines sent
        to the ``kvbus.kafka`` logger (so they take the process's log format, not librdkafka's own
        stderr lines; served when the client is polled), ``conf`` (the client's own properties) and
        the security properties (``KVBUS_KAFKA_*``; the properties file last)."""
        return {"bootstrap.servers": self.bootstrap, "logger": KAFKA_LOGGER, **conf,
                **self.security.kafka.librdkafka()}

    def redis_kwargs(self) -> dict[str, Any]:
        """redis-py keyword arguments for :attr:`redis_url` (credentials, TLS CA)."""
        return self.security.redis.client_kwargs(self.redis_url)

    def to_env(self) -> dict[str, str]:
        """The ``KVBUS_*`` variables that make :meth:`from_env` in a child process return these
        settings (lay them over ``os.environ`` when starting a kvbus subcommand)."""
        t = self.topics
        return {
            "KVBUS_BOOTSTRAP": self.bootstrap,
            "KVBUS_REGISTRY_URL": self.registry_url,
            "KVBUS_REDIS_URL": self.redis_url,
            "KVBUS_PARTITIONS": str(self.partitions),
            "KVBUS_MAX_RECORD_BYTES": str(self.max_record_bytes),
            "KVBUS_TOPIC_RAW": t.raw,
            "KVBUS_TOPIC_BLOCKS": t.blocks,
            "KVBUS_TOPIC_INCOMPLETE": t.incomplete,
            "KVBUS_TOPIC_DLQ": t.dlq,
            "KVBUS_TOPIC_SNAPSHOTS": t.snapshots,
            **self.security.to_env(),
        }
