"""Connection settings every kvbus command honours, from the environment.

Each is declared once on :class:`Settings` (:func:`kvbus.runtime.env.setting`): its ``KVBUS_*``
variable, its default and its meaning; topic names are :class:`kvbus.schemas.topics.Topics`', the
security settings :mod:`kvbus.runtime.security`'s. Every setting with its default: docs/configuration.md.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

from kvbus.runtime.env import COUNT, NATURAL, SECONDS, SWITCH, TEXT, load, setting, to_env as declared_env
from kvbus.runtime.security import Security
from kvbus.schemas.topics import Topics

DEFAULT_BOOTSTRAP = "127.0.0.1:9092"
DEFAULT_REGISTRY_URL = "http://127.0.0.1:8081/apis/ccompat/v7"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
DEFAULT_PARTITIONS = 4
DEFAULT_MALLOC_TRIM_INTERVAL = 60.0
"""Seconds between two trims of the C allocator (:mod:`kvbus.runtime.allocator`): a trim takes 0.1-0.3 ms
in a worker, sink or bridge at 500 events/s, and gives back what the minute freed (docs/benchmarks.md, "Soak")."""
DEFAULT_MALLOC_MMAP_THRESHOLD = 256 * 1024
"""Bytes from which the C allocator maps a block on its own (:func:`kvbus.runtime.allocator.fix_mmap_threshold`):
above librdkafka's and Faust's everyday buffers, below the fetch and rebalance buffers whose freed space
would otherwise stay in the arenas (docs/benchmarks.md, "Soak")."""
DEFAULT_MALLOC_ARENA_MAX = 0
"""Largest number of glibc malloc arenas (:func:`kvbus.runtime.allocator.cap_arenas`); 0: glibc's own limit."""
DEFAULT_MAX_RECORD_BYTES = 900_000
"""Largest EventBatch value the producers write as one Kafka record: a little under librdkafka's
``message.max.bytes`` (1,000,000; not overridden by kvbus) and the broker's default
``max.message.bytes`` (1,048,588), leaving room for the key and the record framing."""


KAFKA_LOGGER = logging.getLogger("kvbus.kafka")
"""Where librdkafka's own log lines go (:meth:`Settings.kafka`)."""


@dataclass(frozen=True)
class Settings:
    """Where the services are, how topics are named, and how a long-running process keeps its memory."""

    bootstrap: str = setting("KVBUS_BOOTSTRAP", TEXT, DEFAULT_BOOTSTRAP,
                             "Kafka bootstrap servers, comma-separated host:port")
    registry_url: str = setting("KVBUS_REGISTRY_URL", TEXT, DEFAULT_REGISTRY_URL,
                                "base URL of the Confluent-compatible schema registry")
    redis_url: str = setting("KVBUS_REDIS_URL", TEXT, DEFAULT_REDIS_URL,
                             "Redis holding the residency view: redis://, rediss:// (TLS), or "
                             "redis+cluster://host:port,host:port for a Redis Cluster")
    partitions: int = setting("KVBUS_PARTITIONS", COUNT, DEFAULT_PARTITIONS,
                              "partitions of every kvbus topic (the workers need them co-partitioned)")
    topics: Topics = field(default_factory=Topics)
    """Topic names (``KVBUS_TOPIC_*``)."""
    max_record_bytes: int = setting(
        "KVBUS_MAX_RECORD_BYTES", COUNT, DEFAULT_MAX_RECORD_BYTES,
        "largest raw EventBatch value (bytes, Confluent header included) the bridge and the in-process publisher "
        "produce as one record; a larger engine batch is produced as several records. Keep it under the "
        "producer's message.max.bytes and the topic's max.message.bytes")
    keep_token_ids: bool = setting(
        "KVBUS_KEEP_TOKEN_IDS", SWITCH, False,
        "keep the prompt's token ids (BlockStored token_ids, lookahead_token_ids, token_id_pairs) in the records "
        "the bridges and the in-process publisher write to the raw topic, for analytics that need them; off: "
        "they are dropped while the engine's batch is decoded (no stage reads them: the block hashes commit to "
        "the tokens), so the bus holds no prompt text")
    malloc_trim_interval: float = setting(
        "KVBUS_MALLOC_TRIM_INTERVAL", SECONDS, DEFAULT_MALLOC_TRIM_INTERVAL,
        "seconds between two calls of glibc's malloc_trim in the bridge, worker, sink and serve processes, "
        "giving the C allocator's whole free pages back to the system (those freed after rebalances and "
        "broker outages would stay resident otherwise; 0: never)")
    malloc_mmap_threshold: int = setting(
        "KVBUS_MALLOC_MMAP_THRESHOLD", NATURAL, DEFAULT_MALLOC_MMAP_THRESHOLD,
        "bytes from which glibc's malloc maps a block on its own and unmaps it when freed, in the bridge, worker, "
        "sink and serve processes (a fixed threshold: glibc's own rises to the largest block freed, and the "
        "space of large buffers freed later stays in its arenas; 0: glibc's own)")
    malloc_arena_max: int = setting(
        "KVBUS_MALLOC_ARENA_MAX", NATURAL, DEFAULT_MALLOC_ARENA_MAX,
        "largest number of glibc malloc arenas in the bridge, worker, sink and serve processes: their threads "
        "(a dozen of librdkafka's or more) share them and reuse each other's free space (0: glibc's own limit, "
        "eight per core)")
    compiled_codec: bool = setting(
        "KVBUS_COMPILED_CODEC", SWITCH, True,
        "run the Avro codec's compiled build (Cython, made by ./dev setup in the checkout's build/codec) when it is "
        "a build of exactly the codec the schemas make now; off, or without such a build: the generated Python, "
        "which encodes and decodes the same bytes")
    security: Security = field(default_factory=Security)
    """How to authenticate to Kafka, Redis and the registry (``kvbus.runtime.security``; default: open)."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "Settings":
        """Settings from KVBUS_* variables (of ``environ``, default the process's), defaults for the
        unset or blank ones; :class:`~kvbus.runtime.env.SettingError` names a malformed one."""
        env = os.environ if environ is None else environ
        return load(cls, env, topics=Topics.from_env(env), security=Security.from_env(env))

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
        return {**declared_env(self), **declared_env(self.topics), **self.security.to_env()}
