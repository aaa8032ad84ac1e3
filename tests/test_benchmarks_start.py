"""Every benchmark starts: ``benchmarks/X.py --help`` exits 0 (its imports resolve against today's
modules and its options parse), so a module moved or renamed elsewhere cannot leave a benchmark broken
until someone runs it. ``fleet_view.py`` is the lookup benchmarks' library, not a command."""
from __future__ import annotations

import ast
import os
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


def args_read(path: Path, functions: set[str]) -> set[str]:
    """The attributes of ``args`` that ``functions`` of the module at ``path`` read."""
    tree = ast.parse(path.read_text())
    return {node.attr for fn in tree.body if isinstance(fn, ast.FunctionDef) and fn.name in functions
            for node in ast.walk(fn)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "args"}


def test_fault_runs_give_the_pipeline_helpers_every_option_they_read() -> None:
    """faults.py and soak.py drive pipeline.py's helpers with a namespace of their own
    (``faults.stage_args``): an option added to the ladder must reach it, or every fault run fails
    at its start."""
    saved = dict(os.environ)  # faults.py points the environment at its own cluster when imported
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import faults
    finally:
        sys.path.remove(str(BENCHMARKS))
        os.environ.clear()
        os.environ.update(saved)
    read = args_read(BENCHMARKS / "pipeline.py", {"new_run", "start_stages", "start_fleet", "drain"})
    given = vars(faults.stage_args(faults.parse_args([]), faults.FAULTS["sink"]))
    assert read - set(given) == set()
