"""Every benchmark starts: ``benchmarks/X.py --help`` exits 0 (its imports resolve against today's
modules and its options parse), so a module moved or renamed elsewhere cannot leave a benchmark broken
until someone runs it. ``fleet_view.py`` is the lookup benchmarks' library, not a command."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
COMMANDS = sorted(p.name for p in BENCHMARKS.glob("*.py") if "__main__" in p.read_text())


def test_every_benchmark_is_listed() -> None:
    assert {"pipeline.py", "faults.py", "soak.py", "sink.py"} <= set(COMMANDS)


@pytest.mark.parametrize("name", COMMANDS)
def test_benchmark_help_runs(name: str) -> None:
    r = subprocess.run([sys.executable, str(BENCHMARKS / name), "--help"], capture_output=True, text=True,
                       timeout=120, cwd=BENCHMARKS.parent)
    assert r.returncode == 0, f"benchmarks/{name} --help exited {r.returncode}:\n{r.stderr[-2000:]}"
    assert "usage:" in r.stdout
