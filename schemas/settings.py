"""Connection settings every kvbus command honours, from the environment.

| variable | default | meaning |
|---|---|---|
| ``KVBUS_BOOTSTRAP`` | ``127.0.0.1:9092`` | Kafka bootstrap servers (comma-separated) |
| ``KVBUS_REGISTRY_URL`` | ``http://127.0.0.1:8081/apis/ccompat/v7`` | Confluent-compatible schema registry |
| ``KVBUS_REDIS_URL`` | ``redis://127.0.0.1:6379/0`` | Redis holding the residency view |
| ``KVBUS_PARTITIONS`` | ``4`` | partitions of kvbus topics (Faust needs them co-partitioned) |
| ``KVBUS_TOPIC_*`` | see ``schemas.topics`` | topic names |
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from schemas.topics import Topics

DEFAULT_BOOTSTRAP = "127.0.0.1:9092"
DEFAULT_REGISTRY_URL = "http://127.0.0.1:8081/apis/ccompat/v7"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
DEFAULT_PARTITIONS = 4


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

    @classmethod
    def from_env(cls) -> "Settings":
        """Settings from KVBUS_* variables, defaults for the rest."""
        env = os.environ
        return cls(
            bootstrap=env.get("KVBUS_BOOTSTRAP", DEFAULT_BOOTSTRAP),
            registry_url=env.get("KVBUS_REGISTRY_URL", DEFAULT_REGISTRY_URL),
            redis_url=env.get("KVBUS_REDIS_URL", DEFAULT_REDIS_URL),
            partitions=int(env.get("KVBUS_PARTITIONS", DEFAULT_PARTITIONS)),
            topics=Topics.from_env(),
        )
