"""Apicurio Registry (Quarkus fast-jar) as the Confluent-compatible schema registry.

* Distribution: ``io.apicurio:apicurio-registry-app:<version>:tar.gz:all`` pinned in
  ``infra/apicurio/pom.xml``, unpacked into ``$STATE/apicurio/app``.
* Needs Java >= 21 (3.3.3 is compiled to class file version 65); Kafka keeps the
  default Java 17. See :func:`kvbus.infra.tools.java_at_least`.
* Runs ``java -jar quarkus-run.jar`` on ``KVBUS_REGISTRY_URL``'s port (8081), management
  (health) on ``127.0.0.1:9001`` -> ``/health/ready``.
* Confluent API: ``/apis/ccompat/v7``; global rule ``compatibility=BACKWARD`` so an
  incompatible registration gets HTTP 409.
* Storage: KafkaSQL (journal topic ``kafkasql-journal`` in our Kafka), so schema ids
  survive registry restarts (and stack restarts, as long as the Kafka data is kept).
"""

from __future__ import annotations

import logging
import os
import shutil
import tarfile
import urllib.request
from collections.abc import Mapping
from pathlib import Path

from . import tools
from .procs import PidRecord, ServiceError, alive_record, port_open, start_process
from .stack_env import APICURIO_VERSION, INFRA_DIR, REGISTRY_JAVA, REGISTRY_JVM_OPTS, Paths, RegistrySettings, env_opts

log = logging.getLogger("infra")

POM = INFRA_DIR / "apicurio" / "pom.xml"
NAME = "registry"
VERSION_MARKER = ".kvbus-version"
JAVA_MIN = 21  # Apicurio 3.3.3 ships class file version 65 (Java 21)


def version() -> str:
    """Apicurio version to run (``$KVBUS_APICURIO_VERSION`` or the pinned default)."""
    return APICURIO_VERSION.read(os.environ)


def pid_path(paths: Paths) -> Path:
    return paths.run / "registry.pid"


def log_path(paths: Paths) -> Path:
    return paths.logs / "registry.log"


def app_present(paths: Paths) -> bool:
    """True if the wanted version is unpacked in ``$STATE/apicurio/app``."""
    marker = paths.apicurio_app / VERSION_MARKER
    return (marker.is_file() and marker.read_text().strip() == version()
            and (paths.apicurio_app / "quarkus-run.jar").is_file())


def ensure_app(paths: Paths) -> bool:
    """Fetch (Maven) and unpack the registry if missing. Returns True if it was fetched."""
    if app_present(paths):
        return False
    ver = version()
    dl = paths.apicurio / "download"
    shutil.rmtree(dl, ignore_errors=True)
    tools.run_maven(
        POM,
        [
            f"{tools.MAVEN_DEPENDENCY_PLUGIN}:copy-dependencies",
            "-DexcludeTransitive=true",
            f"-Dapicurio.version={ver}",
            f"-DoutputDirectory={dl}",
        ],
        what=f"Apicurio Registry {ver}",
        log_path=paths.logs / "maven-apicurio.log",
    )
    tarballs = list(dl.glob("apicurio-registry-app-*-all.tar.gz"))
    if len(tarballs) != 1:
        raise ServiceError(f"expected one apicurio-registry-app-*-all.tar.gz in {dl}, found {tarballs}")
    tmp = paths.apicurio_app.with_name("app.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with tarfile.open(tarballs[0]) as tf:
        tf.extractall(tmp, filter="data")
    if not (tmp / "quarkus-run.jar").is_file():
        raise ServiceError(f"{tarballs[0].name} has no quarkus-run.jar at its top level")
    (tmp / VERSION_MARKER).write_text(ver + "\n")
    shutil.rmtree(paths.apicurio_app, ignore_errors=True)
    tmp.replace(paths.apicurio_app)
    shutil.rmtree(dl, ignore_errors=True)
    log.info("Apicurio Registry %s unpacked into %s", ver, paths.apicurio_app)
    return True


def argv(paths: Paths, reg: RegistrySettings, bootstrap: str, replication: int,
         extra_props: Mapping[str, str | None] | None = None) -> list[str]:
    """Command line of the registry JVM; ``extra_props``: system properties to set instead (``None``
    drops one), e.g. the secured stack's TLS and authentication (:mod:`kvbus.infra.secure`; secrets go in a
    config file, never here: a command line is visible to every local user)."""
    data = paths.data / "apicurio"
    del replication  # sized by Apicurio itself from the cluster (see below)
    props = {
        "kvbus.infra.state": str(paths.root),  # marker: identifies our process
        "quarkus.http.host": reg.host,
        "quarkus.http.port": str(reg.port),
        "quarkus.management.host": reg.host,
        "quarkus.management.port": str(reg.management_port),
        "apicurio.rules.global.compatibility": "BACKWARD",
        "apicurio.storage.kind": "kafkasql",
        "apicurio.kafkasql.bootstrap.servers": bootstrap,
        # NB: do not set apicurio.kafkasql.topic.replication.factor: 3.3.3 reads it but also
        # passes it on as a topic config and Kafka rejects the topic ("Unknown topic config
        # name: replication.factor"). Its default is min(3, cluster size) with
        # min.insync.replicas = max(RF - 1, 1), i.e. 1/1 on one broker and 3/2 on three.
        "apicurio.kafkasql.topic.partitions": "1",
        "apicurio.storage.snapshot.location": str(data),
        "apicurio.import.work-dir": str(data),
        "apicurio.datasource.jdbc.initial-size": "2",
        "apicurio.datasource.jdbc.min-size": "2",
        # the journal checks at startup wait one poll timeout per empty poll (default 5 s: ~20 s)
        "apicurio.kafkasql.consumer.poll.timeout": "1000",
        "quarkus.log.console.format": "%d{yyyy-MM-dd HH:mm:ss,SSS} %p [%c{3.}] (%t) %m%n",
        'quarkus.log.category."org.apache.kafka".level': "WARN",
        "java.util.logging.manager": "org.jboss.logmanager.LogManager",
    }
    for key, value in (extra_props or {}).items():
        if value is None:
            props.pop(key, None)
        else:
            props[key] = value
    return [
        java(paths),
        "-Xms64m",
        "-Xmx512m",
        "-XX:+UseG1GC",
        "-XX:TieredStopAtLevel=1",
        "-XX:+ExitOnOutOfMemoryError",
        "-Djava.awt.headless=true",
        *[f"-D{k}={v}" for k, v in props.items()],
        *env_opts(REGISTRY_JVM_OPTS),
        "-jar",
        str(paths.apicurio_app / "quarkus-run.jar"),
    ]


def java(paths: Paths) -> str:
    """A Java >= 21 for the registry (3.3.x classes are Java 21 bytecode);
    see :func:`kvbus.infra.tools.java_at_least`."""
    return tools.java_at_least(JAVA_MIN, jdk_dir=paths.root / "jdk", env_var=REGISTRY_JAVA.variable)


def marker(paths: Paths) -> str:
    return f"-Dkvbus.infra.state={paths.root}"


def running(paths: Paths) -> PidRecord | None:
    """Our live registry process, if any."""
    return alive_record(pid_path(paths))


def start(paths: Paths, reg: RegistrySettings, bootstrap: str, replication: int,
          extra_props: Mapping[str, str | None] | None = None) -> PidRecord | None:
    """Start the registry unless ours is running (``extra_props``: see :func:`argv`). Returns the new
    record (None if already up)."""
    if running(paths) is not None:
        return None
    for port in (reg.port, reg.management_port):
        if port_open(reg.host, port):
            raise ServiceError(
                f"{NAME}: port {port} is already in use by a process this stack did not start "
                f"(state dir {paths.root}); stop it or change KVBUS_REGISTRY_URL / KVBUS_REGISTRY_MANAGEMENT_PORT"
            )
    data = paths.data / "apicurio"
    data.mkdir(parents=True, exist_ok=True)
    return start_process(
        NAME, argv(paths, reg, bootstrap, replication, extra_props),
        pid_path=pid_path(paths), log_path=log_path(paths), marker=marker(paths), cwd=data
    )


def _get(url: str, timeout: float = 2.0) -> tuple[int, bytes]:
    req = urllib.request.Request(url, headers={"Accept": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def ready(reg: RegistrySettings) -> bool:
    """Health endpoint says UP and ``GET /subjects`` answers 200."""
    status, _ = _get(reg.health_url)
    if status != 200:
        return False
    status, _ = _get(reg.subjects_url)
    return status == 200


def is_ready(reg: RegistrySettings) -> bool:
    """Like :func:`ready` but never raises."""
    try:
        return port_open(reg.host, reg.port) and ready(reg)
    except Exception:  # noqa: BLE001
        return False
