"""Options of the streams stage (besides the shared :class:`kvbus.runtime.settings.Settings`).

An object handed to :func:`kvbus.streams.agents.build`: ``kvbus worker`` lays its flags over
:meth:`StreamsOptions.from_env`, ``python -m kvbus.streams worker`` uses the variables alone. Each
field is declared once (:func:`kvbus.runtime.env.setting`): its ``KVBUS_STREAMS_*`` variable, its flag
where it has one, its default and its meaning. Every option with its default: docs/configuration.md.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional

from kvbus.runtime.env import COUNT, NATURAL, PORT, SECONDS, TEXT, load, one_of, setting

BLOCK_LAYOUTS = ("packed", "events")
"""Values of ``KVBUS_STREAMS_BLOCK_LAYOUT`` (:mod:`kvbus.schemas.topics`, "Block layouts")."""


@dataclass(frozen=True)
class StreamsOptions:
    """How one streams worker runs."""

    app_id: str = setting("KVBUS_STREAMS_APP_ID", TEXT, "kvbus-streams",
                          "Faust app id: the workers' consumer group and the prefix of the changelog topic",
                          flag="--app-id")
    window: float = setting("KVBUS_STREAMS_WINDOW", SECONDS, 5.0,
                            "seconds a partial aggregate waits for the other workers before it is Incomplete",
                            flag="--window")
    sweep: float = setting("KVBUS_STREAMS_SWEEP", SECONDS, 0.5,
                           "seconds between expiry sweeps (an aggregate expires at most this late)")
    metrics_port: int = setting("KVBUS_STREAMS_METRICS_PORT", PORT, 0,
                                "serve /metrics (Prometheus), /healthz and /readyz on this port; 0 = off",
                                flag="--metrics-port")
    web_port: Optional[int] = setting("KVBUS_STREAMS_WEB_PORT", PORT, None,
                                      "port of Faust's own web server; unset: no web server")
    workdir: str = setting("KVBUS_STREAMS_WORKDIR", TEXT, ".", "directory that holds the data directory",
                           flag="--workdir")
    datadir: Optional[str] = setting("KVBUS_STREAMS_DATADIR", TEXT, None,
                                     "Faust data directory (RocksDB files), one per worker process",
                                     flag="--datadir", shown="<workdir>/<app-id>-data")
    store: str = setting("KVBUS_STREAMS_STORE", TEXT, "memory://",
                         "table store: memory:// (rebuilt from the changelog) or rocksdb:// (local files)",
                         flag="--store")
    replication: int = setting("KVBUS_REPLICATION", COUNT, 1,
                               "replication factor of the changelog topic and of the tier topics the workers create")
    standby_replicas: int = setting("KVBUS_STREAMS_STANDBY_REPLICAS", NATURAL, 0,
                                    "Faust standby replicas of the state table (useful with rocksdb://)")
    session_timeout: float = setting("KVBUS_STREAMS_SESSION_TIMEOUT", SECONDS, 6.0,
                                     "consumer-group session timeout: seconds before a dead worker's partitions "
                                     "move (at least the brokers' group.min.session.timeout.ms, Kafka's default 6)")
    batch: int = setting("KVBUS_STREAMS_BATCH", COUNT, 2000, "most raw records taken per processing batch")
    batch_within: float = setting(
        "KVBUS_STREAMS_BATCH_WITHIN", SECONDS, 0.01,
        "seconds a busy worker waits for a batch to fill before processing what arrived (a worker that "
        "expects fewer than KVBUS_STREAMS_BATCH_FROM records in that time waits for nothing): longer waits "
        "cost less CPU per record under load (docs/performance.md, \"Tuning values\")")
    batch_from: int = setting(
        "KVBUS_STREAMS_BATCH_FROM", COUNT, 4,
        "raw records a worker must expect within KVBUS_STREAMS_BATCH_WITHIN (at the rate they arrived over "
        "the last fraction of a second) before it waits for a batch to fill")
    recovery_timeout: float = setting(
        "KVBUS_STREAMS_RECOVERY_TIMEOUT", SECONDS, 300.0,
        "seconds a worker may stay unready (its group rebalancing, its table recovering) before it exits "
        "with an error for its supervisor to start it again; 0 = wait for ever")
    block_layout: str = setting(
        "KVBUS_STREAMS_BLOCK_LAYOUT", one_of(*BLOCK_LAYOUTS), "packed",
        "the block topics the worker writes: packed (block layout 2: a BlockEvents record per engine batch, "
        "holder and tier on kvbus.blocks-packed*) or events (layout 1: a BlockEvent record per event on kvbus.blocks*, "
        "what kvbus 0.1 write: for sinks not upgraded yet)", flag="--block-layout")
    commit_interval: float = setting("KVBUS_STREAMS_COMMIT_INTERVAL", SECONDS, 1.0,
                                     "seconds between offset commits (replay after a crash is at most about this long)")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "StreamsOptions":
        """Options from KVBUS_STREAMS_* and KVBUS_REPLICATION (of ``environ``, default the process's),
        defaults for the unset or blank ones; :class:`~kvbus.runtime.env.SettingError` names a malformed one."""
        return load(cls, environ)

    @property
    def data_dir(self) -> Path:
        """The Faust data directory to use."""
        return Path(self.datadir) if self.datadir else Path(self.workdir) / f"{self.app_id}-data"
