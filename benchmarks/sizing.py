"""Sizing rule from ladder runs: each stage's CPU as a part per process plus a part per event.

    .venv/bin/python benchmarks/pipeline.py --keep-going --rates 2000,6000,10000 --replicas 16 \\
        --streams-per-bridge 8 --partitions 16 --workers-procs 1 --sinks 1 | tail -1 > w1.json
    .venv/bin/python benchmarks/pipeline.py ... --workers-procs 4 --sinks 4 | tail -1 > w4.json
    .venv/bin/python benchmarks/sizing.py w1.json w4.json
    .venv/bin/python benchmarks/sizing.py w1.json w4.json --check w1b.json w4b.json   # held-out runs

Reads the last line of ``benchmarks/pipeline.py`` runs (one JSON object each) and fits, for every
kvbus stage, over every rung of every run (the idle rung included)::

    cores = per_process * processes + per_100k * events_per_s / 100_000

by least squares, where ``processes`` is the run's count of that stage's processes (bridges,
workers, sinks; Kafka and Redis count as one part each: their servers do not change between runs)
and ``events_per_s`` what the stage handled in the rung's window (offered at the bridges and
Kafka, consolidated at the workers, applied at the sinks and Redis). Runs with different process
counts separate the two parts; runs with one count only give their sum at one process.

Prints a table per stage (both parts, the largest relative miss of the fit over the rungs) and the
cores each stage needs for ``--rate`` events/s with ``--processes`` processes per stage; with
``--check``, also what the rule predicts for other runs (each rung's rate and process count) against
what they measured, summed over their rungs (``check_ratio``: predicted / measured). The last line
is one JSON object. The fit is two unknowns, solved in closed form: no numerical library needed.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

STAGES: dict[str, tuple[str, str]] = {
    "bridge": ("bridges", "offered_ev_s"),
    "worker": ("workers_procs", "consolidated_ev_s"),
    "sink": ("sinks", "applied_ev_s"),
    "kafka": ("", "offered_ev_s"),
    "redis": ("", "applied_ev_s"),
}
"""Stage -> (the run's field counting its processes, "" for one part; the rung's events/s it handled)."""


def points(runs: list[dict[str, Any]], stage: str) -> list[tuple[float, float, float]]:
    """(processes, events/s, cores) of ``stage`` in every rung of ``runs``."""
    procs_field, rate_field = STAGES[stage]
    out = []
    for run in runs:
        procs = float(run[procs_field]) if procs_field else 1.0
        for rung in run["rungs"].values():
            cores = (rung.get("cpu_cores") or {}).get(stage)
            if cores is not None and rung.get(rate_field) is not None:
                out.append((procs, float(rung[rate_field]), float(cores)))
    return out


def fit(pts: list[tuple[float, float, float]]) -> tuple[float, float, float]:
    """Least squares of cores = a * processes + b * events/s / 1e5 over ``pts``: (a, b, the largest
    relative miss). Solved through the 2x2 normal equations."""
    xs = [(p, r / 1e5) for p, r, _ in pts]
    ys = [c for *_, c in pts]
    s11 = sum(p * p for p, _ in xs)
    s12 = sum(p * r for p, r in xs)
    s22 = sum(r * r for _, r in xs)
    t1 = sum(p * y for (p, _), y in zip(xs, ys))
    t2 = sum(r * y for (_, r), y in zip(xs, ys))
    det = s11 * s22 - s12 * s12
    if abs(det) < 1e-12:
        raise ValueError("the rungs do not separate the two parts (one rate only?)")
    a = (t1 * s22 - t2 * s12) / det
    b = (s11 * t2 - s12 * t1) / det
    miss = max((abs(a * p + b * r - y) / y for (p, r), y in zip(xs, ys) if y > 0), default=0.0)
    return a, b, miss


def load(paths: list[Path]) -> list[dict[str, Any]]:
    """The last line (one JSON object) of each file."""
    return [json.loads(path.read_text().strip().splitlines()[-1]) for path in paths]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", type=Path, help="files holding the last line of a benchmarks/pipeline.py run")
    p.add_argument("--rate", type=float, default=100_000.0, help="events/s to size for (default 100000)")
    p.add_argument("--processes", type=int, default=4, help="processes per scaled stage to size for (default 4)")
    p.add_argument("--check", nargs="+", type=Path, default=[], metavar="RUN",
                   help="runs left out of the fit, to hold the rule against")
    args = p.parse_args(argv)
    runs, held = load(args.runs), load(args.check)
    out: dict[str, Any] = {"runs": [r.get("run") for r in runs], "checked": [r.get("run") for r in held],
                           "rate_ev_s": args.rate,
                           "processes": args.processes, "stages": {}}
    print(f"{'stage':8} {'cores/process':>14} {'cores/100k ev/s':>16} {'worst miss':>11} "
          f"{'cores at rate':>14}" + (f" {'check pred/meas':>16}" if held else ""))
    total = 0.0
    for stage, (procs_field, _) in STAGES.items():
        a, b, miss = fit(points(runs, stage))
        need = a * (args.processes if procs_field else 1) + b * args.rate / 1e5
        total += need
        fig = out["stages"][stage] = {"per_process": round(a, 3), "per_100k": round(b, 2),
                                      "worst_miss": round(miss, 2), "cores": round(need, 2)}
        line = f"{stage:8} {a:14.3f} {b:16.2f} {miss:10.0%} {need:14.2f}"
        if held:
            pts = points(held, stage)
            measured = sum(c for *_, c in pts)
            fig["check_ratio"] = round(sum(a * n + b * r / 1e5 for n, r, _ in pts) / measured, 2) if measured else None
            line += f" {fig['check_ratio']:16.2f}"
        print(line)
    out["cores"] = round(total, 2)
    print(f"total cores for {args.rate:,.0f} events/s with {args.processes} processes per stage: {total:.1f}")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
