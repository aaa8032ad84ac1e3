"""Default topic names and the naming rule of per-tier topics.

| topic | content | key |
|---|---|---|
| ``kvbus.raw`` | EventBatch as bridges produce them | ``<replica>#<dp_rank>`` |
| ``kvbus.blocks`` | consolidated BlockEvent, framework-owned (ownership null) | same |
| ``kvbus.blocks.<ownership>`` | consolidated BlockEvent of one secondary tier | same |
| ``kvbus.incomplete`` | Incomplete: events not all workers reported in time | same |
| ``kvbus.dlq`` | DeadLetter: input a stage rejected | source |
| ``kvbus.snapshots`` | ViewSnapshot: the residency view saved by the sinks (compacted) | holder, ``""`` for a manifest |

Each name can be overridden by ``KVBUS_TOPIC_RAW``, ``KVBUS_TOPIC_BLOCKS``,
``KVBUS_TOPIC_INCOMPLETE``, ``KVBUS_TOPIC_DLQ``, ``KVBUS_TOPIC_SNAPSHOTS``.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Mapping

from kvbus.schemas.env import TEXT, read

_ILLEGAL = re.compile(r"[^a-zA-Z0-9._-]")

RECOVERY_GROUP_PREFIX = "kvbus-recovery-"
"""Consumer groups a bridge makes up (``<prefix><uuid>``) to read the tail of the raw topic at start
(producers/recovery.py); it commits nothing. Also what a deployment's ACLs grant (a prefixed ACL)."""
REBUILD_GROUP_PREFIX = "kvbus-rebuild-"
"""Consumer groups a sink makes up to read the snapshot topic (sinks/snapshot.py); commits nothing."""
REPORT_GROUP_PREFIX = "kvbus-report-"
"""Consumer groups ``kvbus report`` makes up to read the topics (analytics/reader.py); commits nothing."""


@dataclass(frozen=True)
class Topics:
    """The topic names one deployment uses."""

    raw: str = "kvbus.raw"
    """Engine batches as produced by bridges."""
    blocks: str = "kvbus.blocks"
    """Consolidated framework-owned events; tier topics are ``<blocks>.<ownership>``."""
    incomplete: str = "kvbus.incomplete"
    """Events that not every worker reported within the window."""
    dlq: str = "kvbus.dlq"
    """Dead letters of every stage."""
    snapshots: str = "kvbus.snapshots"
    """Snapshots of the residency view (compacted; the sinks write and read it)."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "Topics":
        """Defaults overridden by KVBUS_TOPIC_* variables (of ``environ``, default the process's;
        blank: the default)."""
        env = os.environ if environ is None else environ
        return cls(
            raw=read(env, "KVBUS_TOPIC_RAW", TEXT, cls.raw),
            blocks=read(env, "KVBUS_TOPIC_BLOCKS", TEXT, cls.blocks),
            incomplete=read(env, "KVBUS_TOPIC_INCOMPLETE", TEXT, cls.incomplete),
            dlq=read(env, "KVBUS_TOPIC_DLQ", TEXT, cls.dlq),
            snapshots=read(env, "KVBUS_TOPIC_SNAPSHOTS", TEXT, cls.snapshots),
        )

    def for_ownership(self, ownership: str | None) -> str:
        """Topic of consolidated events of a tier: ``blocks`` for None, else ``blocks.<ownership>``
        with characters Kafka does not allow replaced by ``_``."""
        if ownership is None:
            return self.blocks
        return f"{self.blocks}.{_ILLEGAL.sub('_', ownership)}"

    def blocks_pattern(self) -> str:
        """Regex subscription (librdkafka ``^`` form) matching the framework and all tier topics."""
        return "^" + re.escape(self.blocks) + r"(\..+)?$"
