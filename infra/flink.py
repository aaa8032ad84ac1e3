"""Apache Flink for the analytics job (analytics/flink/*.sql): PyFlink from PyPI in a virtual
environment of its own, and the SQL connector jars from Maven Central.

* PyFlink: ``$STATE/flink/venv`` with ``apache-flink`` (:data:`PYFLINK_REQUIREMENT`); its own venv
  because PyFlink pins apache-beam, pandas < 2.3 and pyarrow < 21, which kvbus's venv does not want.
  The wheel ships Flink's runtime jars (a local mini-cluster runs the job in one JVM; Java 17 is fine).
* Jars: ``infra/flink/pom.xml`` -> ``$STATE/flink/jars`` (``flink-sql-connector-kafka`` and
  ``flink-sql-avro-confluent-registry``, fetched only when missing or when the pom changed).

Both are made on first use (:func:`ensure`), like the Kafka jars (infra/kafka_broker.py).
"""
from __future__ import annotations

import hashlib
import logging
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from . import tools
from .procs import ServiceError
from .stack_env import INFRA_DIR, Paths

log = logging.getLogger("infra")

PYFLINK_REQUIREMENT = "apache-flink==2.2.0"
"""PyFlink release; infra/flink/pom.xml's jar versions go with it."""
POM = INFRA_DIR / "flink" / "pom.xml"
MARKER = ".complete"


@dataclass(frozen=True)
class FlinkRuntime:
    """What a PyFlink job needs here."""

    python: Path
    """The Python of the PyFlink venv."""
    jars: list[Path]
    """Connector and format jars to put in ``pipeline.jars``."""


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _root(paths: Paths) -> Path:
    return paths.root / "flink"


def ensure_pyflink(paths: Paths) -> Path:
    """The Python of ``$STATE/flink/venv``, created with PyFlink installed if missing."""
    venv = _root(paths) / "venv"
    python = venv / "bin" / "python"
    marker = venv / MARKER
    if marker.is_file() and marker.read_text().strip() == _digest(PYFLINK_REQUIREMENT):
        return python
    log.info("installing %s into %s (first time: a few minutes)", PYFLINK_REQUIREMENT, venv)
    shutil.rmtree(venv, ignore_errors=True)
    venv.parent.mkdir(parents=True, exist_ok=True)
    log_path = paths.logs / "pip-pyflink.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as fh:
        for cmd in ([sys.executable, "-m", "venv", str(venv)],
                    [str(python), "-m", "pip", "install", "--disable-pip-version-check", PYFLINK_REQUIREMENT]):
            fh.write(("\n$ " + " ".join(cmd) + "\n").encode())
            fh.flush()
            if subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL).returncode:
                raise ServiceError(f"{' '.join(cmd)} failed; see {log_path}")
    marker.write_text(_digest(PYFLINK_REQUIREMENT))
    return python


def ensure_jars(paths: Paths) -> list[Path]:
    """The jars of infra/flink/pom.xml in ``$STATE/flink/jars``, fetched with Maven if missing."""
    jars_dir = _root(paths) / "jars"
    marker = jars_dir / MARKER
    want = _digest(POM.read_text())
    if not (marker.is_file() and marker.read_text().strip() == want):
        tmp = jars_dir.with_name("jars.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tools.run_maven(
            POM,
            [f"{tools.MAVEN_DEPENDENCY_PLUGIN}:copy-dependencies", "-DexcludeTransitive=true",
             f"-DoutputDirectory={tmp}"],
            what="Flink SQL connector jars",
            log_path=paths.logs / "maven-flink.log",
        )
        if len(list(tmp.glob("*.jar"))) != 2:
            raise ServiceError(f"expected the Kafka connector and avro-confluent jars in {tmp}")
        (tmp / MARKER).write_text(want)
        shutil.rmtree(jars_dir, ignore_errors=True)
        tmp.replace(jars_dir)
    return sorted(jars_dir.glob("*.jar"))


def ensure(paths: Paths | None = None) -> FlinkRuntime:
    """PyFlink and the jars, made if missing."""
    paths = paths or Paths()
    return FlinkRuntime(python=ensure_pyflink(paths), jars=ensure_jars(paths))
