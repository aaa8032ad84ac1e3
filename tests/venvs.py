"""Fresh virtual environments for the packaging tests: a copy of the repository as a fresh clone has
it, the wheel built from that copy, and venvs holding only that wheel and one role's extras.

Everything a venv runs is started from a directory outside the repository, with an environment
that carries no ``PYTHONPATH``: what imports there is what the venv holds, never the checkout.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Iterable, Mapping, Sequence

ROOT = Path(__file__).resolve().parent.parent
"""The repository's checkout."""

BASE_PYTHON = Path(sys.base_prefix) / "bin" / f"python{sys.version_info.major}.{sys.version_info.minor}"
"""The interpreter the test venv was made from (3.11+, as ./dev checks): fresh venvs are made from it."""


def fresh_clone(dest: Path) -> Path:
    """Copy into ``dest`` what a fresh clone of this checkout holds: the files git tracks and the new
    files it does not ignore (so uncommitted work is what gets built), without build/, .venv,
    .infra or anything else ignored. Returns ``dest``."""
    listed = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            check=True, capture_output=True).stdout
    for name in filter(None, listed.decode().split("\0")):
        src = ROOT / name
        if not src.is_file():  # tracked but deleted in the work tree
            continue
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, target)
    return dest


def build_wheel(source: Path, out: Path) -> Path:
    """Build kvbus's wheel from the tree ``source`` with pip (isolated build, as from a clone) into
    ``out``; returns the wheel's path."""
    out.mkdir(parents=True, exist_ok=True)
    run = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "--disable-pip-version-check",
                          "-w", str(out), str(source)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"pip wheel failed:\n{run.stdout}\n{run.stderr}"
    wheels = sorted(out.glob("kvbus-*.whl"))
    assert len(wheels) == 1, f"expected one kvbus wheel in {out}, found {[w.name for w in wheels]}"
    return wheels[0]


def lowest_versions(pyproject: Mapping, extra: str) -> list[str]:
    """``name==<lower bound>`` of every library ``pip install 'kvbus[<extra>]'`` asks for by name: the
    base dependencies and those of ``extra`` and of the extras it names (``kvbus[...]``), from the
    parsed ``pyproject``. A requirement without a lower bound is left out."""
    from packaging.requirements import Requirement

    project = pyproject["project"]
    extras, pins, todo = set(), {}, [extra]
    for req in map(Requirement, project["dependencies"]):
        pins[req.name] = req
    while todo:
        name = todo.pop()
        if name in extras:
            continue
        extras.add(name)
        for req in map(Requirement, project["optional-dependencies"][name]):
            if req.name == project["name"]:
                todo.extend(req.extras)
            else:
                pins[req.name] = req
    out = []
    for name, req in sorted(pins.items()):
        lower = [s.version for s in req.specifier if s.operator in (">=", "==")]
        if lower:
            extras_part = f"[{','.join(sorted(req.extras))}]" if req.extras else ""
            out.append(f"{name}{extras_part}=={lower[0]}")
    return out


def clean_env(bin_dir: Path, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """An environment with ``bin_dir`` first on PATH, no PYTHONPATH and no ``KVBUS_*`` of the test
    process, plus ``extra``."""
    env = {"PATH": f"{bin_dir}:/usr/local/bin:/usr/bin:/bin", "HOME": os.environ.get("HOME", "/tmp"),
           "LANG": "C.UTF-8"}
    env.update(extra or {})
    return env


class Venv:
    """A virtual environment at ``path``, made without pip; packages go in with the test venv's pip
    (``pip --python``), which uses pip's cache."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.bin = path / "bin"
        self.python = self.bin / "python"

    @classmethod
    def create(cls, path: Path) -> "Venv":
        """A new, empty venv made from :data:`BASE_PYTHON`."""
        subprocess.run([str(BASE_PYTHON), "-m", "venv", "--without-pip", str(path)], check=True, timeout=120)
        return cls(path)

    def install(self, *requirements: str) -> None:
        """``pip install`` ``requirements`` (e.g. ``"/tmp/kvbus-0.2.0-py3-none-any.whl[client]"``)."""
        run = subprocess.run([sys.executable, "-m", "pip", "--python", str(self.python), "install", "-q",
                              "--disable-pip-version-check", *requirements],
                             capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, f"pip install {' '.join(requirements)} failed:\n{run.stdout}\n{run.stderr}"

    def run(self, argv: Sequence[str], env: Mapping[str, str] | None = None,
            timeout: float = 120, cwd: Path | None = None) -> subprocess.CompletedProcess:
        """Run ``argv`` (a program of the venv's bin/ by name, or a path) from ``cwd`` (default: the venv's
        directory) with :func:`clean_env`; output captured as text."""
        exe = argv[0] if "/" in argv[0] else str(self.bin / argv[0])
        return subprocess.run([exe, *argv[1:]], cwd=cwd or self.path, env=clean_env(self.bin, env), capture_output=True,
                              text=True, timeout=timeout)

    def check(self, argv: Sequence[str], env: Mapping[str, str] | None = None, timeout: float = 120) -> str:
        """:meth:`run`, failing with its output unless it exits 0; returns its standard output."""
        done = self.run(argv, env, timeout)
        assert done.returncode == 0, f"{' '.join(argv)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
        return done.stdout

    def versions(self, distributions: Iterable[str]) -> dict[str, str]:
        """The installed version of each of ``distributions`` (names as pip knows them)."""
        code = ("import importlib.metadata as m, json, sys\n"
                "print(json.dumps({d: m.version(d) for d in sys.argv[1:]}))")
        return json.loads(self.check(["python", "-I", "-c", code, *distributions]).strip().splitlines()[-1])

    def importable(self, modules: Iterable[str]) -> list[str]:
        """Those of the top-level ``modules`` this venv can import."""
        code = ("import importlib.util, sys\n"
                "print(' '.join(m for m in sys.argv[1:] if importlib.util.find_spec(m) is not None))")
        return self.check(["python", "-I", "-c", code, *modules]).split()

    def import_all(self, packages: Iterable[str]) -> dict[str, str]:
        """Import every module of ``packages`` (subpackages included, ``__main__`` modules not) in this
        venv; returns {module: error} of those that fail (empty: all import)."""
        code = """
import importlib, json, pkgutil, sys
failed = {}
for pkg in sys.argv[1:]:
    root = importlib.import_module(pkg)
    subs = pkgutil.walk_packages(root.__path__, pkg + ".")
    names = [pkg] + [m.name for m in subs if not m.name.endswith(".__main__")]
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as e:
            failed[name] = repr(e)
print(json.dumps(failed))
"""
        return json.loads(self.check(["python", "-I", "-c", code, *packages]).strip().splitlines()[-1])
