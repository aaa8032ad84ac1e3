"""Options of the streams stage (besides the shared :class:`kvbus.schemas.settings.Settings`).

An object handed to :func:`kvbus.streams.agents.build`: ``kvbus worker`` lays its flags over
:meth:`StreamsOptions.from_env`, ``python -m kvbus.streams worker`` uses the variables alone.

| variable | default | meaning |
|---|---|---|
| ``KVBUS_STREAMS_APP_ID`` | ``kvbus-streams`` | Faust app id = consumer group and changelog topic prefix |
| ``KVBUS_STREAMS_WINDOW`` | ``5.0`` | seconds a partial aggregate waits for the other workers |
| ``KVBUS_STREAMS_SWEEP`` | ``0.5`` | seconds between expiry sweeps |
| ``KVBUS_STREAMS_METRICS_PORT`` | ``0`` | port of ``/metrics``, ``/healthz`` and ``/readyz`` (0: no endpoint) |
| ``KVBUS_STREAMS_WEB_PORT`` | unset | Faust's web server port; unset: web disabled |
| ``KVBUS_STREAMS_WORKDIR`` | ``.`` | directory for Faust's data directory |
| ``KVBUS_STREAMS_DATADIR`` | ``<workdir>/<app id>-data`` | Faust data directory (one per worker process) |
| ``KVBUS_STREAMS_STORE`` | ``memory://`` | table store: ``memory://`` or ``rocksdb://`` |
| ``KVBUS_REPLICATION`` | ``1`` | replication factor of changelog and tier topics |
| ``KVBUS_STREAMS_STANDBY_REPLICAS`` | ``0`` | Faust standby replicas of the table |
| ``KVBUS_STREAMS_SESSION_TIMEOUT`` | ``10`` | seconds before a dead worker's partitions move |
| ``KVBUS_STREAMS_BATCH`` | ``2000`` | raw records taken per processing batch |
| ``KVBUS_STREAMS_BATCH_WITHIN`` | ``0.002`` | seconds to wait for a batch to fill (an idle record waits up to this long) |
| ``KVBUS_STREAMS_COMMIT_INTERVAL`` | ``1.0`` | seconds between offset commits |
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional

from kvbus.schemas.env import COUNT, NATURAL, PORT, SECONDS, TEXT, read


@dataclass(frozen=True)
class StreamsOptions:
    """How one streams worker runs; every field has a ``KVBUS_*`` variable (module doc)."""

    app_id: str = "kvbus-streams"
    """Faust app id: consumer group id and prefix of the changelog topic."""
    window: float = 5.0
    """Seconds a partial aggregate waits for the remaining workers before it is Incomplete."""
    sweep: float = 0.5
    """Seconds between expiry sweeps (an aggregate expires at most this late)."""
    metrics_port: int = 0
    """Port of the HTTP endpoint (``/metrics``, ``/healthz``, ``/readyz``); 0 disables it."""
    web_port: Optional[int] = None
    """Port of Faust's own web server; None disables it."""
    workdir: str = "."
    """Directory that holds the data directory."""
    datadir: Optional[str] = None
    """Faust data directory (RocksDB files); default ``<workdir>/<app_id>-data``."""
    store: str = "memory://"
    """Table store URL: memory:// (rebuilt from the changelog) or rocksdb:// (local files)."""
    replication: int = 1
    """Replication factor of the changelog topic and of tier topics this stage creates."""
    standby_replicas: int = 0
    """Faust standby replicas of the state table (useful with rocksdb://)."""
    session_timeout: float = 10.0
    """Consumer-group session timeout: how fast a killed worker's partitions move."""
    batch: int = 2000
    """Maximum raw records per processing batch."""
    batch_within: float = 0.002
    """Seconds to wait for a batch to fill before processing what arrived: the latency an idle
    worker adds (Faust's take_events waits this long, then processes what is buffered). A positive
    number of seconds: smaller values answer sooner and cost more CPU per record (measured trade-off:
    docs/performance.md, "Tuning values")."""
    commit_interval: float = 1.0
    """Seconds between offset commits (replay after a crash is at most about this long)."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "StreamsOptions":
        """Options from KVBUS_STREAMS_* and KVBUS_REPLICATION (of ``environ``, default the process's),
        defaults for the unset or blank ones; :class:`~kvbus.schemas.env.SettingError` names a malformed one."""
        env = os.environ if environ is None else environ
        return cls(
            app_id=read(env, "KVBUS_STREAMS_APP_ID", TEXT, cls.app_id),
            window=read(env, "KVBUS_STREAMS_WINDOW", SECONDS, cls.window),
            sweep=read(env, "KVBUS_STREAMS_SWEEP", SECONDS, cls.sweep),
            metrics_port=read(env, "KVBUS_STREAMS_METRICS_PORT", PORT, cls.metrics_port),
            web_port=read(env, "KVBUS_STREAMS_WEB_PORT", PORT, None),
            workdir=read(env, "KVBUS_STREAMS_WORKDIR", TEXT, cls.workdir),
            datadir=read(env, "KVBUS_STREAMS_DATADIR", TEXT, None),
            store=read(env, "KVBUS_STREAMS_STORE", TEXT, cls.store),
            replication=read(env, "KVBUS_REPLICATION", COUNT, cls.replication),
            standby_replicas=read(env, "KVBUS_STREAMS_STANDBY_REPLICAS", NATURAL, cls.standby_replicas),
            session_timeout=read(env, "KVBUS_STREAMS_SESSION_TIMEOUT", SECONDS, cls.session_timeout),
            batch=read(env, "KVBUS_STREAMS_BATCH", COUNT, cls.batch),
            batch_within=read(env, "KVBUS_STREAMS_BATCH_WITHIN", SECONDS, cls.batch_within),
            commit_interval=read(env, "KVBUS_STREAMS_COMMIT_INTERVAL", SECONDS, cls.commit_interval),
        )

    @property
    def data_dir(self) -> Path:
        """The Faust data directory to use."""
        return Path(self.datadir) if self.datadir else Path(self.workdir) / f"{self.app_id}-data"
