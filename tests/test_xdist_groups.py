"""``./dev test`` runs the suite with ``-n 2 --dist loadgroup`` and relies on a module's tests running in one
process, in order (tests/conftest.py groups them by module): module fixtures start their servers and engines
once, and tests that share one (the secured stack) see the same one. pytest 9.2 with pytest-xdist 3.8 broke
that silently (pyproject.toml pins pytest below 9.2): this runs a throw-away suite of two modules the way
``./dev test`` does and checks where each test ran."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent

MODULE = '''
import os

import pytest


@pytest.mark.parametrize("i", range(6))
def test_where(i):
    with open(os.environ["WHERE_LOG"], "a") as f:
        f.write(f"{__name__} {os.environ.get('PYTEST_XDIST_WORKER')}\\n")
'''


def test_a_modules_tests_run_in_one_worker(tmp_path: Path) -> None:
    shutil.copy(ROOT / "conftest.py", tmp_path / "conftest.py")  # the suite's own grouping
    for name in ("test_one", "test_two"):
        (tmp_path / f"{name}.py").write_text(MODULE)
    log = tmp_path / "where.log"
    out = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadgroup",
                          "-q", "-o", "addopts=", str(tmp_path)], cwd=tmp_path, capture_output=True, text=True,
                         env={**os.environ, "WHERE_LOG": str(log)}, timeout=120)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    workers: dict[str, set[str]] = defaultdict(set)
    for line in log.read_text().splitlines():
        module, worker = line.split()
        workers[module].add(worker)
    assert set(workers) == {"test_one", "test_two"}, workers
    assert all(len(w) == 1 for w in workers.values()), f"a module's tests ran in several workers: {dict(workers)}"
