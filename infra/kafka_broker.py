"""Apache Kafka 4.4.0 in KRaft combined mode (broker+controller per JVM) from Maven jars.

* Jars: ``infra/kafka/pom.xml`` -> ``$STATE/kafka/libs`` (fetched only when missing or
  when the pom changed).
* Config: generated per node into ``$STATE/kafka/conf/<mode>/node<i>.properties``
  (static controller quorum, loopback listeners).
* Data: ``$STATE/data/kafka-<mode>/node<i>``; the cluster id is kept in
  ``$STATE/data/kafka-<mode>/cluster.id`` and storage is formatted once.
* Logs: ``$STATE/logs/kafka-<mode>-node<i>.log``.

``<mode>`` is ``single`` for one node and ``cluster3`` for three nodes.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import shutil
import subprocess
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import tools
from .procs import PidRecord, ServiceError, alive_record, failure, port_open, start_process
from .stack_env import INFRA_DIR, KAFKA_JVM_OPTS, LOOPBACK, Paths, bootstrap_for, broker_ports, env_opts

log = logging.getLogger("infra")

KAFKA_VERSION = "4.4.0"
POM = INFRA_DIR / "kafka" / "pom.xml"
LOG4J_CONFIG = INFRA_DIR / "kafka" / "log4j2.properties"
LIBS_MARKER = ".complete"


def mode_name(brokers: int) -> str:
    """Directory/log name of a cluster size: ``single`` or ``cluster<N>``."""
    return "single" if brokers == 1 else f"cluster{brokers}"


@dataclass(frozen=True)
class Node:
    """One combined broker+controller JVM."""

    node_id: int
    port: int
    controller_port: int
    brokers: int
    paths: Paths

    @property
    def name(self) -> str:
        return f"kafka-{self.node_id}" if self.brokers == 1 else f"kafka-{self.node_id}of{self.brokers}"

    @property
    def mode_dir(self) -> Path:
        return self.paths.data / f"kafka-{mode_name(self.brokers)}"

    @property
    def data_dir(self) -> Path:
        return self.mode_dir / f"node{self.node_id}"

    @property
    def props_path(self) -> Path:
        return self.paths.kafka_conf / mode_name(self.brokers) / f"node{self.node_id}.properties"

    @property
    def pid_path(self) -> Path:
        return self.paths.run / f"kafka-{mode_name(self.brokers)}-node{self.node_id}.pid"

    @property
    def log_path(self) -> Path:
        return self.paths.logs / f"kafka-{mode_name(self.brokers)}-node{self.node_id}.log"

    @property
    def address(self) -> str:
        return f"{LOOPBACK}:{self.port}"


def plan(paths: Paths, brokers: int) -> list[Node]:
    """The nodes of a ``brokers``-node cluster; ports from :func:`kvbus.infra.stack_env.broker_ports`."""
    if brokers < 1:
        raise ValueError("brokers must be >= 1")
    ports = broker_ports(brokers)
    nodes = [Node(i + 1, p, p + 1, brokers, paths) for i, p in enumerate(ports)]
    taken: dict[int, str] = {}
    for n in nodes:
        for port, what in ((n.port, "broker"), (n.controller_port, "controller")):
            if port in taken:
                raise ValueError(
                    f"{n.name}: {what} port {port} is also {taken[port]}'s; each controller listens on its broker "
                    f"port + 1, so KVBUS_BOOTSTRAP ports must be at least 2 apart (e.g. :29092,:29094,:29096)"
                )
            taken[port] = f"{n.name} {what}"
    return nodes


def bootstrap(nodes: list[Node]) -> str:
    """Bootstrap string for ``nodes``."""
    return bootstrap_for([n.port for n in nodes])


# ---------------------------------------------------------------------------- jars


def _pom_digest() -> str:
    return hashlib.sha256(POM.read_bytes()).hexdigest()


def libs_present(paths: Paths) -> bool:
    """True if ``$STATE/kafka/libs`` was filled from the current pom."""
    marker = paths.kafka_libs / LIBS_MARKER
    return marker.is_file() and marker.read_text().strip() == _pom_digest()


def ensure_libs(paths: Paths) -> bool:
    """Copy the Kafka runtime jars into ``$STATE/kafka/libs`` if missing. Returns True if fetched."""
    if libs_present(paths):
        return False
    tmp = paths.kafka_libs.with_name("libs.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tools.run_maven(
        POM,
        [
            f"{tools.MAVEN_DEPENDENCY_PLUGIN}:copy-dependencies",
            "-DincludeScope=runtime",
            f"-DoutputDirectory={tmp}",
        ],
        what=f"Kafka {KAFKA_VERSION} jars",
        log_path=paths.logs / "maven-kafka.log",
    )
    jars = list(tmp.glob("*.jar"))
    if not any(j.name.startswith(f"kafka_2.13-{KAFKA_VERSION}") for j in jars):
        raise ServiceError(f"Maven did not produce kafka_2.13-{KAFKA_VERSION}.jar in {tmp}")
    (tmp / LIBS_MARKER).write_text(_pom_digest())
    shutil.rmtree(paths.kafka_libs, ignore_errors=True)
    tmp.replace(paths.kafka_libs)
    log.info("Kafka jars ready in %s (%d jars)", paths.kafka_libs, len(jars))
    return True


# ---------------------------------------------------------------------------- config


def node_properties(node: Node, nodes: list[Node], overrides: Mapping[str, str | None] | None = None) -> str:
    """server.properties text for ``node`` in a cluster of ``nodes``; ``overrides``: properties to
    set instead (a value ``None`` drops the property), e.g. the secured stack's listeners
    (:mod:`kvbus.infra.secure`)."""
    n = len(nodes)
    rf = min(3, n)
    min_isr = 2 if n >= 3 else 1
    voters = ",".join(f"{x.node_id}@{LOOPBACK}:{x.controller_port}" for x in nodes)
    lines = {
        "process.roles": "broker,controller",
        "node.id": str(node.node_id),
        "controller.quorum.voters": voters,
        "listeners": f"PLAINTEXT://{LOOPBACK}:{node.port},CONTROLLER://{LOOPBACK}:{node.controller_port}",
        "advertised.listeners": f"PLAINTEXT://{LOOPBACK}:{node.port}",
        "controller.listener.names": "CONTROLLER",
        "inter.broker.listener.name": "PLAINTEXT",
        "listener.security.protocol.map": "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
        "log.dirs": str(node.data_dir),
        "num.partitions": "4",
        "default.replication.factor": str(rf),
        "min.insync.replicas": str(min_isr),
        "offsets.topic.replication.factor": str(rf),
        "offsets.topic.num.partitions": "8",
        "transaction.state.log.replication.factor": str(rf),
        "transaction.state.log.min.isr": str(min_isr),
        "transaction.state.log.num.partitions": "8",
        "share.coordinator.state.topic.replication.factor": str(rf),
        "share.coordinator.state.topic.min.isr": str(min_isr),
        "group.initial.rebalance.delay.ms": "0",
        "auto.create.topics.enable": "true",
        "delete.topic.enable": "true",
        "num.network.threads": "2",
        "num.io.threads": "4",
        "num.recovery.threads.per.data.dir": "1",
        "log.segment.bytes": str(64 * 1024 * 1024),
        "log.retention.hours": "168",
        "unclean.leader.election.enable": "false",
        # the controller fences a broker that sent no heartbeat for broker.session.timeout.ms (Kafka's
        # default 9 s, heartbeats every 2 s); until then a crashed broker still leads its partitions,
        # and nothing is written to them nor read from them: the largest part of the view's staleness
        # after a broker crash (benchmarks/faults.py, broker-leader). 5 s with heartbeats every second
        "broker.session.timeout.ms": "5000",
        "broker.heartbeat.interval.ms": "1000",
    }
    for key, value in (overrides or {}).items():
        if value is None:
            lines.pop(key, None)
        else:
            lines[key] = value
    header = f"# generated by infra/kafka_broker.py for {node.name}; edits are overwritten by `infra/stack up`\n"
    return header + "".join(f"{k}={v}\n" for k, v in lines.items())


def write_configs(nodes: list[Node], overrides: Mapping[str, str | None] | None = None) -> None:
    """(Re)write every node's properties file (``overrides``: see :func:`node_properties`)."""
    for node in nodes:
        node.props_path.parent.mkdir(parents=True, exist_ok=True)
        node.props_path.write_text(node_properties(node, nodes, overrides))


def random_cluster_id() -> str:
    """Same format as ``kafka-storage random-uuid``: base64url of 16 random bytes, no padding."""
    while True:
        cid = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not cid.startswith("-"):
            return cid


def cluster_id(nodes: list[Node]) -> str:
    """The persisted cluster id of this mode (created on first use)."""
    path = nodes[0].mode_dir / "cluster.id"
    if path.is_file():
        return path.read_text().strip()
    path.parent.mkdir(parents=True, exist_ok=True)
    cid = random_cluster_id()
    path.write_text(cid + "\n")
    return cid


def java_argv(paths: Paths, brokers: int, main: str, args: list[str], *, server: bool) -> list[str]:
    """``java ... -cp libs/* main args`` with small heaps suited to a 2-core test box.

    C1 only (``-XX:TieredStopAtLevel=1``) for the short-lived tools and for every broker of a
    cluster of several: three brokers' C2 compiler threads on a 2-core box took ~0.3 core between
    them for minutes after start, and the pipeline beside them fell seconds behind; with C1 only a
    restarted broker was ready in 8-16 s instead of 28-35 s and freshness came back 2-5 times sooner
    after a broker or controller fault (docs/benchmarks.md, "C1-only brokers"). A single broker keeps
    C2, so that ``benchmarks/pipeline.py``'s capacity is Kafka's at full speed.
    ``KVBUS_KAFKA_JVM_OPTS=-XX:TieredStopAtLevel=4`` gives a cluster C2 back (later flags win).
    """
    heap = (["-Xms256m", "-Xmx512m"] if brokers == 1 else ["-Xms256m", "-Xmx384m"]) if server else ["-Xmx256m"]
    opts = [
        *heap,
        "-XX:+UseG1GC",
        "-XX:MaxGCPauseMillis=20",
        "-XX:InitiatingHeapOccupancyPercent=35",
        "-XX:+ExplicitGCInvokesConcurrent",
        *([] if server and brokers == 1 else ["-XX:TieredStopAtLevel=1"]),
        "-XX:+ExitOnOutOfMemoryError",
        "-Djava.awt.headless=true",
        f"-Dlog4j2.configurationFile={LOG4J_CONFIG}",
        f"-Dkafka.logs.dir={paths.logs}",
    ]
    if server:
        opts += env_opts(KAFKA_JVM_OPTS)
    return [tools.java(), *opts, "-cp", str(paths.kafka_libs / "*"), main, *args]


def format_storage(paths: Paths, nodes: list[Node], extra_args: Sequence[str] = ()) -> list[str]:
    """Format the log dir of every node that has no ``meta.properties`` yet (in parallel);
    ``extra_args``: more ``kafka-storage format`` arguments (e.g. ``--add-scram``; never logged).

    Returns the names of the nodes formatted.
    """
    todo = [n for n in nodes if not (n.data_dir / "meta.properties").is_file()]
    if not todo:
        return []
    cid = cluster_id(nodes)
    procs: list[tuple[Node, subprocess.Popen[bytes], Path]] = []
    for n in todo:
        n.data_dir.mkdir(parents=True, exist_ok=True)
        out = paths.logs / f"kafka-{mode_name(n.brokers)}-node{n.node_id}-format.log"
        argv = java_argv(
            paths, n.brokers, "kafka.tools.StorageTool",
            ["format", "-t", cid, "-c", str(n.props_path), "--ignore-formatted", *extra_args],
            server=False
        )
        with open(out, "wb") as fh:
            proc = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            procs.append((n, proc, out))
    for n, p, out in procs:
        if p.wait(timeout=180) != 0:
            raise failure(n.name, f"storage format failed (exit {p.returncode})", out)
    log.info("formatted Kafka storage (cluster id %s) for %s", cid, ", ".join(n.name for n in todo))
    return [n.name for n in todo]


# ---------------------------------------------------------------------------- processes


def running(nodes: list[Node]) -> dict[str, PidRecord]:
    """Our live node processes by node name."""
    out: dict[str, PidRecord] = {}
    for n in nodes:
        rec = alive_record(n.pid_path)
        if rec is not None:
            out[n.name] = rec
    return out


def start(paths: Paths, nodes: list[Node], only: set[int] | None = None, *,
          overrides: Mapping[str, str | None] | None = None, format_args: Sequence[str] = ()) -> list[PidRecord]:
    """Start every node that is not already running (ours); ``only``: just these node ids (the
    configs of all ``nodes`` are written, so a restarted node gets the same quorum). Returns the
    new records. ``overrides``: properties of :func:`node_properties`; ``format_args``: of
    :func:`format_storage` (the secured stack's listeners and SCRAM bootstrap).

    Raises if a node's port is taken by a process we did not start.
    """
    live = running(nodes)
    todo = [n for n in nodes if n.name not in live and (only is None or n.node_id in only)]
    for n in todo:
        for port in (n.port, n.controller_port):
            if port_open(LOOPBACK, port):
                raise ServiceError(
                    f"{n.name}: port {port} is already in use by a process this stack did not start "
                    f"(state dir {paths.root}); stop it or point KVBUS_BOOTSTRAP elsewhere"
                )
    if not todo:
        return []
    write_configs(nodes, overrides)
    format_storage(paths, todo, format_args)
    started = []
    for n in todo:
        argv = java_argv(paths, n.brokers, "kafka.Kafka", [str(n.props_path)], server=True)
        started.append(start_process(n.name, argv, pid_path=n.pid_path, log_path=n.log_path,
                                     marker=str(n.props_path), cwd=n.mode_dir))
    return started


def active_controller(nodes: list[Node]) -> int | None:
    """Node id of the active KRaft controller (the quorum leader), from the ``quorum-state`` file
    each node keeps in its metadata log directory: the leader of the highest epoch any node knows.
    ``None`` while no node knows one (an election is under way)."""
    best: tuple[int, int] | None = None
    for n in nodes:
        try:
            st = json.loads((n.data_dir / "__cluster_metadata-0" / "quorum-state").read_text())
        except (OSError, ValueError):
            continue
        leader, epoch = int(st.get("leaderId", -1)), int(st.get("leaderEpoch", -1))
        if leader >= 0 and (best is None or epoch > best[0]):
            best = (epoch, leader)
    return best[1] if best else None


def metadata_brokers(bootstrap_servers: str, timeout: float = 2.0) -> set[int]:
    """Broker ids in the cluster metadata (empty set if unreachable)."""
    from .dev_topics import admin_client

    md = admin_client(bootstrap_servers).list_topics(timeout=timeout)
    return set(md.brokers)


class Readiness:
    """Reusable readiness probe: all nodes' ports open and all broker ids in metadata;
    ``client_conf``: more admin client properties (the secured stack's credentials)."""

    def __init__(self, nodes: list[Node], client_conf: Mapping[str, Any] | None = None) -> None:
        self.nodes = nodes
        self.client_conf = dict(client_conf or {})
        self._client: Any = None

    def __call__(self) -> bool:
        if not all(port_open(LOOPBACK, n.port) for n in self.nodes):
            return False
        from .dev_topics import admin_client

        if self._client is None:
            self._client = admin_client(bootstrap(self.nodes), **self.client_conf)
        md = self._client.list_topics(timeout=2)
        return {n.node_id for n in self.nodes} <= set(md.brokers)


def node_ready(nodes: list[Node]) -> dict[str, bool]:
    """Per-node readiness (port open and present in cluster metadata)."""
    open_ = {n.name: port_open(LOOPBACK, n.port) for n in nodes}
    ids: set[int] = set()
    if any(open_.values()):
        try:
            ids = metadata_brokers(",".join(n.address for n in nodes if open_[n.name]))
        except Exception:  # noqa: BLE001
            ids = set()
    return {n.name: open_[n.name] and n.node_id in ids for n in nodes}


def jvm_pids(nodes: list[Node]) -> dict[str, int]:
    """pid of each of our live nodes."""
    return {name: rec.pid for name, rec in running(nodes).items()}
