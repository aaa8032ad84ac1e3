"""Default topic names and the naming rule of per-tier topics.

| topic | content | key |
|---|---|---|
| ``kvbus.raw`` | EventBatch as bridges produce them | ``<replica>#<dp_rank>`` |
| ``kvbus.blocks`` | consolidated BlockEvent, framework-owned (ownership null): block layout 1 | same |
| ``kvbus.blocks.<ownership>`` | consolidated BlockEvent of one secondary tier: block layout 1 | same |
| ``kvbus.blocks-packed`` | consolidated BlockEvents: one engine batch's events of one holder, framework-owned | same |
| ``kvbus.blocks-packed.<ownership>`` | the same for one secondary tier | same |
| ``kvbus.incomplete`` | Incomplete: events not all workers reported in time | same |
| ``kvbus.dlq`` | DeadLetter: input a stage rejected | source |
| ``kvbus.snapshots`` | ViewSnapshot: the view saved by the sinks (compacted) | holder, ``""`` for a manifest |

Each name can be overridden by its ``KVBUS_TOPIC_*`` variable (:class:`Topics`).

**Block layouts.** The consolidated events come in two layouts, each with its own topics: layout 1, a
``BlockEvent`` record per event (``kvbus.blocks*``, what kvbus 0.1 write), and layout 2, a
``BlockEvents`` record per engine batch, holder and topic (``kvbus.blocks-packed*``, the default). A holder's
events have one position order per tier whichever layout carries them: :meth:`Topics.track` names it
by the layout 1 topic.

How each topic must be configured on the cluster (partitions, replicas, ``cleanup.policy``,
``retention.ms``, ``max.message.bytes``, ``min.insync.replicas``) is declared here too
(:func:`topic_specs`): the development stack creates the topics from it, the sinks the snapshot
topic, the worker the tier topics, all through :func:`kvbus.runtime.kafka_clients.ensure_topics`, and
the Kubernetes ``KafkaTopic`` resources are generated from it.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Mapping

from kvbus.runtime.env import TEXT, load, setting

_ILLEGAL = re.compile(r"[^a-zA-Z0-9._-]")

RECOVERY_GROUP_PREFIX = "kvbus-recovery-"
"""Consumer groups a bridge makes up (``<prefix><uuid>``) to read the tail of the raw topic at start
(producers/recovery.py); it commits nothing. Also what a deployment's ACLs grant (a prefixed ACL)."""
REBUILD_GROUP_PREFIX = "kvbus-rebuild-"
"""Consumer groups a sink makes up to read the snapshot topic (sinks/snapshot.py); commits nothing."""
REPORT_GROUP_PREFIX = "kvbus-report-"
"""Consumer groups ``kvbus report`` makes up to read the topics (analytics/reader.py); commits nothing."""

RETENTION_MS = 7 * 24 * 3600 * 1000
"""``retention.ms`` of the record topics (raw, blocks and the tier topics, incomplete, dlq): 7 days,
Kafka's default, stated so that a cluster whose default is shorter does not drop what kvbus needs:
the block topics must retain more than the sinks' snapshot period (``KVBUS_SINK_SNAPSHOT_EVERY``,
default 300 s) for a lost view to be rebuilt exactly, and the raw topic what the workers have not
consumed yet (an outage of the workers longer than this loses events)."""
MAX_MESSAGE_BYTES = 1_048_588
"""``max.message.bytes`` of the record topics: Kafka's default. The producers keep a value under
``KVBUS_MAX_RECORD_BYTES`` (default 900,000) and split larger engine batches."""
SNAPSHOT_MAX_RECORD_BYTES = 64 << 20
"""Largest record of the snapshot topic: one holder's state (8 bytes per block and tier: 8 M blocks)."""
SNAPSHOT_MAX_MESSAGE_BYTES = SNAPSHOT_MAX_RECORD_BYTES + 65536
"""``max.message.bytes`` of the snapshot topic: its largest record and room for the key and framing."""
SNAPSHOT_PARTITIONS = 1
"""The snapshot topic is one ordered log: a manifest follows the holder records it names."""


def min_insync(replicas: int) -> int:
    """``min.insync.replicas`` for a replication factor: 2 when it is 3 or more, else 1."""
    return 2 if replicas >= 3 else 1


def record_topic_config(replicas: int) -> dict[str, str]:
    """Kafka topic configuration of a record topic (raw, blocks, a tier topic, incomplete, dlq) replicated
    ``replicas`` times: deleted after :data:`RETENTION_MS`, records up to :data:`MAX_MESSAGE_BYTES`."""
    return {"cleanup.policy": "delete", "retention.ms": str(RETENTION_MS),
            "max.message.bytes": str(MAX_MESSAGE_BYTES), "min.insync.replicas": str(min_insync(replicas))}


def snapshot_topic_config(replicas: int) -> dict[str, str]:
    """Kafka topic configuration of the snapshot topic: compacted (the latest record per key is kept,
    so it holds one snapshot however long the service runs), records up to :data:`SNAPSHOT_MAX_RECORD_BYTES`."""
    return {"cleanup.policy": "compact", "max.message.bytes": str(SNAPSHOT_MAX_MESSAGE_BYTES),
            "min.insync.replicas": str(min_insync(replicas))}


@dataclass(frozen=True)
class TopicSpec:
    """How one kvbus topic is created on the cluster."""

    name: str
    """Kafka topic name."""
    partitions: int
    """Partition count (``KVBUS_PARTITIONS`` for the co-partitioned record topics, 1 for snapshots)."""
    replicas: int
    """Replication factor."""
    config: Mapping[str, str] = field(default_factory=dict)
    """Topic configuration (``cleanup.policy``, ``retention.ms``, ``max.message.bytes``, ``min.insync.replicas``)."""


@dataclass(frozen=True)
class Topics:
    """The topic names one deployment uses."""

    raw: str = setting("KVBUS_TOPIC_RAW", TEXT, "kvbus.raw", "topic of the engine batches as bridges produce them")
    blocks: str = setting("KVBUS_TOPIC_BLOCKS", TEXT, "kvbus.blocks",
                          "topic of the consolidated framework-owned events; tier topics are <blocks>.<ownership>")
    packed: str = setting("KVBUS_TOPIC_PACKED", TEXT, None,
                          "topic of the consolidated framework-owned events, a BlockEvents record per engine batch "
                          "and holder (block layout 2); tier topics are <packed>.<ownership>",
                          shown="<blocks>-packed")
    incomplete: str = setting("KVBUS_TOPIC_INCOMPLETE", TEXT, "kvbus.incomplete",
                              "topic of the events that not every worker reported within the window")
    dlq: str = setting("KVBUS_TOPIC_DLQ", TEXT, "kvbus.dlq", "dead-letter topic of every stage")
    snapshots: str = setting("KVBUS_TOPIC_SNAPSHOTS", TEXT, "kvbus.snapshots",
                             "topic of the snapshots of the residency view (compacted; the sinks write and read it)")

    def __post_init__(self) -> None:
        if self.packed is None:  # derived from blocks: a deployment (or a test) naming its blocks names both
            object.__setattr__(self, "packed", f"{self.blocks}-packed")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "Topics":
        """Defaults overridden by KVBUS_TOPIC_* variables (of ``environ``, default the process's;
        blank: the default)."""
        return load(cls, environ)

    def for_ownership(self, ownership: str | None, packed: bool = False) -> str:
        """Topic of consolidated events of a tier: ``blocks`` for None, else ``blocks.<ownership>``
        with characters Kafka does not allow replaced by ``_``; ``packed``: the same under ``packed``."""
        if ownership is None:
            return self.packed if packed else self.blocks
        return self.tier_prefix(packed) + _ILLEGAL.sub("_", ownership)

    def tier_prefix(self, packed: bool = False) -> str:
        """What every tier topic of a block layout starts with: ``blocks.`` (layout 1), ``packed.`` (layout 2,
        ``packed``); what a prefixed ACL on the tier topics names."""
        return (self.packed if packed else self.blocks) + "."

    def blocks_pattern(self) -> str:
        """Regex subscription (librdkafka ``^`` form) matching the framework and all tier topics of both
        block layouts."""
        return f"^({self.layout_pattern(False)}|{self.layout_pattern(True)})$"

    def layout_pattern(self, packed: bool) -> str:
        """Regex matching, as a whole (Java's ``matches``, Python's ``fullmatch``: no anchors), the framework
        and all tier topics of one block layout (``packed``: layout 2), e.g. a Flink table's ``topic-pattern``."""
        return re.escape(self.for_ownership(None, packed)) + r"(\..+)?"

    def is_packed(self, topic: str) -> bool:
        """Whether ``topic`` is a block topic of layout 2 (``packed`` or ``packed.<ownership>``)."""
        return topic == self.packed or topic.startswith(self.tier_prefix(packed=True))

    def packed_of(self, topic: str) -> str:
        """The layout 2 topic of a layout 1 block topic (``blocks.<ownership>`` -> ``packed.<ownership>``)."""
        return self.packed + topic[len(self.blocks):]

    def track(self, topic: str) -> str:
        """The name of the position order a block topic's events follow: the layout 1 topic of its tier
        (``packed.<ownership>`` -> ``blocks.<ownership>``; a layout 1 topic is its own)."""
        if self.is_packed(topic):
            return self.blocks + topic[len(self.packed):]
        return topic


def record_spec(name: str, partitions: int, replicas: int) -> TopicSpec:
    """The declaration of a record topic (raw, blocks, a tier topic, incomplete, dlq): :func:`record_topic_config`."""
    return TopicSpec(name, partitions, replicas, record_topic_config(replicas))


def snapshot_spec(name: str, replicas: int) -> TopicSpec:
    """The declaration of the snapshot topic: one partition (one ordered log), :func:`snapshot_topic_config`."""
    return TopicSpec(name, SNAPSHOT_PARTITIONS, replicas, snapshot_topic_config(replicas))


def topic_specs(topics: Topics, partitions: int, replicas: int) -> tuple[TopicSpec, ...]:
    """Every topic a deployment declares up front, with ``partitions`` (``KVBUS_PARTITIONS``) and
    ``replicas`` (``KVBUS_REPLICATION``): raw, blocks, packed, incomplete, dlq, snapshots. Tier topics
    (``<blocks>.<ownership>``, ``<packed>.<ownership>``) are created by the worker on a tier's first event
    (:func:`record_spec`).
    They are created by :func:`kvbus.runtime.kafka_clients.ensure_topics`."""
    return (*(record_spec(name, partitions, replicas) for name in (topics.raw, topics.blocks, topics.packed,
                                                                   topics.incomplete, topics.dlq)),
            snapshot_spec(topics.snapshots, replicas))
