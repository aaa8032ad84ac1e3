"""Every benchmark starts: ``benchmarks/X.py --help`` exits 0 (its imports resolve against today's
modules and its options parse), so a module moved or renamed elsewhere cannot leave a benchmark broken
until someone runs it; and every benchmark runs for real, a smoke run of seconds against the test stack
(exit 0, the last stdout line one JSON object: the benchmarks' contract), so a broken start cannot land
either. ``fleet_view.py`` and ``block_topics.py`` are the benchmarks' libraries, not commands."""
from __future__ import annotations

import ast
import importlib
import json
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


# -- smoke runs ------------------------------------------------------------------------------------------------
#
# Every command above also runs for real, a few seconds against the test stack: its start, one measurement and
# its contract (exit 0, the last stdout line one JSON object). All of them are in this module, so they share one
# xdist group (tests/conftest.py groups by module) and never race for the stack.

SMOKE: dict[str, list[str]] = {
    "bridges.py": ["--replicas", "2", "--rate", "500", "--seconds", "2"],
    "codec.py": ["--events", "2000", "--repeats", "1"],
    "lookup.py": ["--entries", "20000", "--replicas", "8", "--queries", "20", "--server-queries", "10",
                  "--maxmemory", "256mb"],
    "producer.py": ["--seconds", "2", "--batches", "100"],
    "rebuild.py": ["--entries", "20000", "--replicas", "8", "--queries", "20"],
    "registry_probe.py": ["--requests", "2"],
    "serve.py": ["--entries", "20000", "--replicas", "8", "--queries", "20", "--token-prompts", "10",
                 "--threads", "0", "--concurrency", "2", "--seconds", "1", "--max-requests", "500",
                 "--maxmemory", "256mb"],
    "sink.py": ["--events", "2000", "--replicas", "8", "--batch", "500"],
    "streams.py": ["--replicas", "8", "--tp", "2"],  # fewer reports: all applied before the first scrape
}
"""The smallest options of each command that still run its start and one measurement."""

PIPELINE_SMOKE = ["--replicas", "2", "--rates", "500", "--idle", "4", "--warmup", "1", "--window", "3", "--gap", "1",
                  "--drain-timeout", "60"]

SPECIAL = {
    "pipeline.py": "run once by the pipeline_smoke fixture: its output is also sizing.py's input",
    "sizing.py": "reads pipeline.py runs: fed the pipeline smoke run's last line",
    "faults.py": "builds its own 3-broker cluster unless --use-env: one short fault on the test stack",
    "soak.py": "the same as faults.py, with --minutes",
    "routing.py": "not here: its smoke run is tests/test_routing_benchmark.py's (another change covers it)",
}
"""Commands whose smoke run is not a plain SMOKE entry, and why."""


def test_every_command_has_a_smoke_run() -> None:
    """A new benchmark gets a smoke run here (or says in SPECIAL why it runs elsewhere)."""
    assert set(SMOKE) | set(SPECIAL) == set(COMMANDS)
    assert not set(SMOKE) & set(SPECIAL)


def run_benchmark(name: str, args: list[str], settings: Any, timeout: float = 120) -> dict[str, Any]:
    """Run ``benchmarks/<name> <args>`` against ``settings``' stack; assert it exits 0 and that its last stdout
    line is one JSON object, and return that object."""
    from tests.pipeline import env_for

    r = subprocess.run([sys.executable, str(BENCHMARKS / name), *args], capture_output=True, text=True,
                       timeout=timeout, cwd=BENCHMARKS.parent, env=env_for(settings))
    assert r.returncode == 0, (f"benchmarks/{name} {' '.join(args)} exited {r.returncode}:\n"
                               f"{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    lines = r.stdout.strip().splitlines()
    assert lines, f"benchmarks/{name} printed nothing:\n{r.stderr[-3000:]}"
    try:
        last = json.loads(lines[-1])
    except json.JSONDecodeError as e:
        raise AssertionError(f"benchmarks/{name}: the last line is not JSON ({e}): {lines[-1][:500]!r}") from None
    assert isinstance(last, dict), f"benchmarks/{name}: the last line is not one JSON object: {lines[-1][:500]!r}"
    return last


@pytest.mark.integration
@pytest.mark.parametrize("name", sorted(SMOKE))
def test_benchmark_smoke_run(name: str, stack: Any, tmp_path: Path) -> None:
    """``benchmarks/<name>`` with its SMOKE options: 1-11 s each. Special cases: streams.py keeps TP=2's
    default 400 steps over 8 replicas (25,600 reports): with fewer the worker applies the whole trace
    between two scrapes and there is nothing to time (the run then reports no rate); codec.py needs no
    stack but runs its two codec paths in children, as always."""
    args = list(SMOKE[name])
    if name == "serve.py":
        args += ["--log-dir", str(tmp_path)]
    if name == "streams.py":
        args += ["--workdir", str(tmp_path)]
    run_benchmark(name, args, stack)


@pytest.fixture(scope="module")
def pipeline_smoke(stack: Any) -> dict[str, Any]:
    """The last line of one short pipeline.py run: 2 engines, the idle rung and one rung of 500 events/s. ~21 s,
    over the others' seconds: the whole path starts (fleet, bridges, worker, sink) and drains, and each rung's
    window needs 2 or more lag samples (taken once a second), else it has no figures: 4 s of idle (a 3 s
    window, which sizing.py needs: the idle rung separates its two parts) and 1 + 3 s at 500 events/s."""
    return run_benchmark("pipeline.py", PIPELINE_SMOKE, stack)


@pytest.mark.integration
def test_pipeline_smoke_run(pipeline_smoke: dict[str, Any]) -> None:
    assert set(pipeline_smoke["rungs"]) == {"idle", "500"}, pipeline_smoke["rungs"]


@pytest.mark.integration
def test_sizing_smoke_run(pipeline_smoke: dict[str, Any], stack: Any, tmp_path: Path) -> None:
    """sizing.py fits the pipeline smoke run (its idle and 500 events/s rungs separate the two parts)."""
    run = tmp_path / "run.json"
    run.write_text(json.dumps(pipeline_smoke) + "\n")
    run_benchmark("sizing.py", [str(run), "--check", str(run)], stack)


FAULT_SMOKE = ["--use-env", "--replicas", "2", "--rate", "500", "--down-for", "1", "--settle", "1",
               "--converge-timeout", "30", "--drain-timeout", "60"]
"""The load and fault options faults.py and soak.py share, at their smallest: the test stack (``--use-env``),
2 engines at 500 events/s, a process down for 1 s."""


@pytest.mark.integration
def test_faults_smoke_run(stack: Any) -> None:
    """One fault, ``bridge`` (kill -9 a bridge, restart it after 1 s), on the test stack: ``--use-env`` runs
    on the one-broker stack as it is instead of the three-broker cluster faults.py builds by default (which
    takes minutes to start on 2 cores); 10 steady probes and 1 s of flow before the fault. ~20 s."""
    out = run_benchmark("faults.py", [*FAULT_SMOKE, "--faults", "bridge", "--before", "1", "--steady-probes", "10",
                                      "--steady-timeout", "60"], stack)
    assert out["all_ok"] and [f["fault"] for f in out["faults"]] == ["bridge"], out


@pytest.mark.integration
def test_faults_on_one_broker_refuse_the_broker_faults(stack: Any) -> None:
    """A fault that kills a broker needs three: on the one-broker test stack it is refused at the start."""
    from tests.pipeline import env_for

    r = subprocess.run([sys.executable, str(BENCHMARKS / "faults.py"), "--use-env", "--faults", "broker-leader"],
                       capture_output=True, text=True, timeout=120, cwd=BENCHMARKS.parent, env=env_for(stack))
    assert r.returncode != 0
    assert "need 3 Kafka brokers" in r.stderr, r.stderr[-2000:]


@pytest.mark.integration
def test_soak_smoke_run(stack: Any) -> None:
    """The shortest soak that still runs a fault: the soak starts a fault only with 30 s left to follow it,
    so 33 s of load (``--minutes 0.55``) with the fault (``bridge``) after 3 s, one worker, a sample a second;
    on the test stack (``--use-env``, as faults.py above). ~45 s: the longest smoke run here, and the only one
    that exercises the soak's own fault loop."""
    out = run_benchmark("soak.py", [*FAULT_SMOKE, "--minutes", "0.55", "--warmup", "3", "--faults", "bridge",
                                    "--workers", "1", "--sample-every", "1", "--min-fit", "5"], stack, timeout=240)
    assert out["ok"] and [f["fault"] for f in out["faults"]] == ["bridge"], out
