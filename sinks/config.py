"""Options of the sink stage (besides the shared :class:`kvbus.runtime.settings.Settings`).

Each field is declared once (:func:`kvbus.runtime.env.setting`): its ``KVBUS_SINK_*`` variable, its
``kvbus sink`` flag, its default and its meaning; :class:`SinkConfig` is what the sink runs with.
Every option with its default: docs/configuration.md.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from kvbus.runtime.env import COUNT, PORT, SECONDS, TEXT, load, setting
from kvbus.schemas.lookup import DEFAULT_PREFIX


@dataclass(frozen=True)
class SinkConfig:
    """How one sink runs."""

    group: str = setting("KVBUS_SINK_GROUP", TEXT, "kvbus-sink",
                         "Kafka consumer group: the sinks of one view share it and split the partitions",
                         flag="--group")
    prefix: str = setting("KVBUS_SINK_PREFIX", TEXT, DEFAULT_PREFIX, "Redis key prefix of the view", flag="--prefix")
    stale_after: float = setting("KVBUS_SINK_STALE_AFTER", SECONDS, 300.0,
                                 "expire holders with no event or heartbeat for this many seconds; 0 = never",
                                 flag="--stale-after")
    expire_every: float = setting("KVBUS_SINK_EXPIRE_EVERY", SECONDS, 5.0,
                                  "seconds between staleness checks (run only when caught up)", flag="--expire-every")
    batch: int = setting("KVBUS_SINK_BATCH", COUNT, 2000, "records per poll and apply batch", flag="--batch")
    poll_timeout: float = 0.5
    """Seconds a poll waits when no record is ready (internal, not a setting)."""
    commit_every: float = setting(
        "KVBUS_SINK_COMMIT_EVERY", SECONDS, 0.5,
        "seconds between offset commits to Kafka while records keep coming (at once when the stream goes "
        "quiet); where a sink resumes is the view's own offsets, so commits serve lag monitoring only",
        flag="--commit-every")
    session_timeout: float = setting(
        "KVBUS_SINK_SESSION_TIMEOUT", SECONDS, 10.0,
        "consumer-group session timeout: seconds before a dead sink's partitions move to another sink (Kafka's "
        "own default is 45)", flag="--session-timeout")
    instance_id: str | None = setting(
        "KVBUS_SINK_INSTANCE_ID", TEXT, None,
        "static group membership (group.instance.id), one id per sink, unique in the group: a sink restarted "
        "under its id takes its partitions back at once instead of after the session timeout; unset: dynamic "
        "membership", flag="--instance-id")
    snapshot_every: float = setting(
        "KVBUS_SINK_SNAPSHOT_EVERY", SECONDS, 300.0,
        "seconds between snapshots of the view to the snapshot topic, taken by one sink of the group; 0 = none. "
        "The block topics must retain more than this for a lost view to be rebuilt exactly", flag="--snapshot-every")
    metrics_port: int = setting("KVBUS_SINK_METRICS_PORT", PORT, 0,
                                "serve /metrics (Prometheus), /healthz and /readyz on this port; 0 = off",
                                flag="--metrics-port")
    ready_lag: int = setting(
        "KVBUS_SINK_READY_LAG", COUNT, 20_000,
        "/readyz answers 503 while this sink's partitions lag more records than this (summed): a sink restarted "
        "on a backlog, or one that cannot keep up, is not ready until it has caught up", flag="--ready-lag")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "SinkConfig":
        """Options from KVBUS_SINK_* (of ``environ``, default the process's), defaults for the unset or
        blank ones; :class:`~kvbus.runtime.env.SettingError` names a malformed one."""
        return load(cls, environ)
