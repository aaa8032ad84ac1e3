"""Options of the sink stage (besides the shared :class:`kvbus.schemas.settings.Settings`).

``kvbus sink`` flags default to these variables; :class:`SinkConfig` is what the sink runs with.

| variable | default | meaning |
|---|---|---|
| ``KVBUS_SINK_GROUP`` | ``kvbus-sink`` | Kafka consumer group of the sinks writing one view |
| ``KVBUS_SINK_PREFIX`` | ``kvbus:`` | Redis key prefix of the view |
| ``KVBUS_SINK_STALE_AFTER`` | ``300`` | seconds without events or heartbeat before a holder is expired; 0 = never |
| ``KVBUS_SINK_EXPIRE_EVERY`` | ``5`` | seconds between staleness checks |
| ``KVBUS_SINK_BATCH`` | ``2000`` | records per poll/apply batch |
| ``KVBUS_SINK_COMMIT_EVERY`` | ``0.5`` | seconds between offset commits to Kafka while records flow (lag monitoring only) |
| ``KVBUS_SINK_SESSION_TIMEOUT`` | ``10`` | seconds before a dead sink's partitions move to another sink |
| ``KVBUS_SINK_INSTANCE_ID`` | unset | static group membership (``group.instance.id``): a sink restarted under the same id takes its partitions back at once |
| ``KVBUS_SINK_SNAPSHOT_EVERY`` | ``300`` | seconds between snapshots of the view to Kafka; 0 = none |
| ``KVBUS_SINK_METRICS_PORT`` | ``0`` | port of ``/metrics``, ``/healthz`` and ``/readyz`` (0: no endpoint) |
| ``KVBUS_SINK_READY_LAG`` | ``20000`` | ``/readyz`` answers 503 while this sink's partitions lag more records than this |
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

from kvbus.schemas.env import COUNT, PORT, SECONDS, TEXT, read


@dataclass(frozen=True)
class SinkConfig:
    """How one sink runs; every field has a ``KVBUS_SINK_*`` variable (module doc)."""

    group: str = "kvbus-sink"
    """Kafka consumer group: the sinks of one view share it and split the partitions."""
    prefix: str = "kvbus:"
    """Redis key prefix of the view."""
    stale_after: float = 300.0
    """Seconds without events or heartbeat after which a holder is expired (0 = never)."""
    expire_every: float = 5.0
    """Seconds between staleness checks (run only when caught up)."""
    batch: int = 2000
    """Records per poll and apply batch."""
    poll_timeout: float = 0.5
    """Seconds a poll waits when no record is ready."""
    commit_every: float = 0.5
    """Seconds between offset commits while records keep coming (at once when the stream goes quiet).
    Where a sink resumes is the view's own offsets; commits serve lag monitoring only, so committing
    after every small batch would buy nothing but an OffsetCommit request per batch."""
    session_timeout: float = 10.0
    """Consumer-group session timeout, seconds: how long a killed sink's partitions wait before
    another sink (or its restart) takes them. Kafka's own default is 45 s (docs/performance.md,
    "Tuning values")."""
    instance_id: str | None = None
    """Static group membership (Kafka's ``group.instance.id``), one id per sink process, unique in the
    group: a sink restarted under its id gets its partitions back at once instead of after the session
    timeout (figures: docs/performance.md, "Tuning values"). None: dynamic membership."""
    snapshot_every: float = 300.0
    """Seconds between snapshots of the view to the snapshot topic (one sink of the group takes
    each); 0 = none. The block topics must retain more than this."""
    metrics_port: int = 0
    """Port of the HTTP endpoint (``/metrics``, ``/healthz``, ``/readyz``); 0 disables it."""
    ready_lag: int = 20_000
    """``/readyz`` answers 503 while the records this sink has yet to read on its partitions (summed)
    exceed this: ten batches of the default size, a fraction of a second of the sink's work. A sink
    restarted on a backlog, or one that cannot keep up, is not ready until it has caught up."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "SinkConfig":
        """Options from KVBUS_SINK_* (of ``environ``, default the process's), defaults for the unset or
        blank ones; :class:`~kvbus.schemas.env.SettingError` names a malformed one."""
        env = os.environ if environ is None else environ
        return cls(
            group=read(env, "KVBUS_SINK_GROUP", TEXT, cls.group),
            prefix=read(env, "KVBUS_SINK_PREFIX", TEXT, cls.prefix),
            stale_after=read(env, "KVBUS_SINK_STALE_AFTER", SECONDS, cls.stale_after),
            expire_every=read(env, "KVBUS_SINK_EXPIRE_EVERY", SECONDS, cls.expire_every),
            batch=read(env, "KVBUS_SINK_BATCH", COUNT, cls.batch),
            commit_every=read(env, "KVBUS_SINK_COMMIT_EVERY", SECONDS, cls.commit_every),
            session_timeout=read(env, "KVBUS_SINK_SESSION_TIMEOUT", SECONDS, cls.session_timeout),
            instance_id=read(env, "KVBUS_SINK_INSTANCE_ID", TEXT, None),
            snapshot_every=read(env, "KVBUS_SINK_SNAPSHOT_EVERY", SECONDS, cls.snapshot_every),
            metrics_port=read(env, "KVBUS_SINK_METRICS_PORT", PORT, cls.metrics_port),
            ready_lag=read(env, "KVBUS_SINK_READY_LAG", COUNT, cls.ready_lag),
        )
