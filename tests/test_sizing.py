"""benchmarks/sizing.py: the per-process and per-event parts of a stage's CPU are recovered from
ladder runs with different process counts, and the rule is held against other runs."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import sizing  # noqa: E402

sys.path.remove(str(BENCHMARKS))


def run(name: str, workers: int, sinks: int, rates: list[float]) -> dict:
    """A pipeline.py result whose stages cost exactly: worker 0.1/process + 2 cores per 100k/s,
    sink 0.05/process + 3, bridge 0.02/process + 1, Kafka 0.6 + 2.5, Redis 0.1 + 0.5."""
    rungs = {}
    for r in rates:
        cores = {"worker": 0.1 * workers + 2 * r / 1e5, "sink": 0.05 * sinks + 3 * r / 1e5,
                 "bridge": 0.02 * 2 + r / 1e5, "kafka": 0.6 + 2.5 * r / 1e5, "redis": 0.1 + 0.5 * r / 1e5}
        rungs[str(r)] = {"offered_ev_s": r, "consolidated_ev_s": r, "applied_ev_s": r, "cpu_cores": cores}
    return {"run": name, "workers_procs": workers, "sinks": sinks, "bridges": 2, "rungs": rungs}


def test_the_fit_recovers_both_parts_and_checks_held_out_runs(tmp_path: Path) -> None:
    files = []
    for name, w, s in (("a", 1, 1), ("b", 4, 4), ("c", 2, 3)):
        path = tmp_path / f"{name}.json"
        path.write_text("a figure line\n" + json.dumps(run(name, w, s, [50, 2000, 6000, 10000])) + "\n")
        files.append(str(path))
    res = subprocess.run([sys.executable, str(BENCHMARKS / "sizing.py"), *files[:2], "--check", files[2]],
                         capture_output=True, text=True, timeout=60, check=True)
    out = json.loads(res.stdout.strip().splitlines()[-1])
    st = out["stages"]
    assert (st["worker"]["per_process"], st["worker"]["per_100k"]) == (0.1, 2.0)
    assert (st["sink"]["per_process"], st["sink"]["per_100k"]) == (0.05, 3.0)
    assert st["kafka"]["per_process"] == 0.6 and st["redis"]["per_100k"] == 0.5
    assert {s["check_ratio"] for s in st.values()} == {1.0}
    assert out["cores"] == pytest.approx(0.1 * 4 + 2 + 0.05 * 4 + 3 + 0.02 * 4 + 1 + 0.6 + 2.5 + 0.1 + 0.5, abs=0.05)


def test_one_rate_only_cannot_separate_the_parts() -> None:
    with pytest.raises(ValueError, match="do not separate"):
        sizing.fit([(1.0, 1000.0, 0.1), (2.0, 2000.0, 0.2)])
