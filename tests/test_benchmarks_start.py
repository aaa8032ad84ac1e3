"""Every benchmark starts: ``benchmarks/X.py --help`` exits 0 (its imports resolve against today's
modules and its options parse), so a module moved or renamed elsewhere cannot leave a benchmark broken
until someone runs it. ``fleet_view.py`` is the lookup benchmarks' library, not a command."""
from __future__ import annotations

import ast
import importlib
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

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


def import_benchmark(name: str) -> Any:
    """benchmarks/<name>.py as a module, the environment left as it was (faults.py points it at
    its own cluster when imported)."""
    saved = dict(os.environ)
    sys.path.insert(0, str(BENCHMARKS))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCHMARKS))
        os.environ.clear()
        os.environ.update(saved)


def test_fault_runs_give_the_pipeline_helpers_every_option_they_read() -> None:
    """faults.py and soak.py drive pipeline.py's helpers with a namespace of their own
    (``faults.stage_args``): an option added to the ladder must reach it, or every fault run fails
    at its start."""
    faults = import_benchmark("faults")
    read = args_read(BENCHMARKS / "pipeline.py", {"new_run", "start_stages", "start_fleet", "drain"})
    given = vars(faults.stage_args(faults.parse_args([]), faults.FAULTS["sink"]))
    assert read - set(given) == set()


def test_the_fault_functions_find_their_options_in_both_benchmarks() -> None:
    """Every ``<ctx>.args.<option>`` the fault functions read is an option of faults.py and of
    soak.py, which draws from the same faults (a fault that reads one soak.py lacks fails at once)."""
    tree = ast.parse((BENCHMARKS / "faults.py").read_text())
    read = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Attribute) and node.value.attr == "args"}
    assert {"down_for", "pause_for"} <= read
    faults, soak = import_benchmark("faults"), import_benchmark("soak")
    assert read - set(vars(faults.parse_args([]))) == set()
    assert read - set(vars(soak.parse_args(["--minutes", "1"]))) == set()


def test_a_broker_younger_than_its_warm_up_is_named_and_an_older_one_is_not() -> None:
    """pipeline.py names a broker still compiling its hot paths (its first run after a start costs
    1.5-1.8x), and says nothing of one past its warm-up or gone."""
    pipeline = import_benchmark("pipeline")
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        age, warning = pipeline.fresh_broker_warning([child.pid])
        assert age is not None and age < pipeline.FRESH_BROKER_S
        assert warning and "discard this run" in warning, warning
    finally:
        child.kill()
        child.wait()
    age, warning = pipeline.fresh_broker_warning([1])  # init: up since the machine started
    assert warning is None or age < pipeline.FRESH_BROKER_S, (age, warning)
    assert pipeline.fresh_broker_warning([child.pid]) == (None, None)  # gone: nothing to say
