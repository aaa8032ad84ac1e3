"""Soak: hours of steady load on the three-broker cluster, a random fault every few minutes; memory, lag, view followed.

    .venv/bin/python benchmarks/soak.py --minutes 30
    .venv/bin/python benchmarks/soak.py --minutes 3 --fault-every 60 --use-env   # the caller's KVBUS_* stack

**The run.** One set of real processes for the whole soak (``benchmarks/pipeline.py``'s: ``kvbus sink``,
``--workers`` ``kvbus worker``, one ``kvbus bridge`` per engine, ``kvbus fleet`` publishing ``--rate``
engine events/s with a freshness probe every ``--probe-every`` s) on fresh topics (replication 3)
and Redis prefix, on the cluster of ``benchmarks/faults.py`` (its ``CLUSTER_ENV``, or the caller's
``KVBUS_*`` with ``--use-env``, as it runs if it runs: one broker or three, and then only the faults that
fit its brokers); brought up with 3 brokers if not running, stopped at the end if this run started it.

**Faults.** After ``--warmup`` s, and then every ``--fault-every`` s, one fault drawn at random
(``--seed``) from faults.py's registry (``faults.FAULTS``: the same functions the fault suite runs),
among those that fit the soak's processes (``fits``: no Redis of their own, the soak's sink count and
sink options, at most ``--workers`` workers). Each fault is followed as the suite follows it
(``faults.settle``) until the view is fresh again; its convergence figures are ``faults.figures``'
(``converge_from_fault_s``, ``converge_from_restart_s``, ``max_stale_ms``, ``lag_back_s``, ...).

**Samples.** Every ``--sample-every`` s: the resident set size (``VmRSS`` of ``/proc/<pid>/status``)
of every process (the run's children, each Kafka broker, the registry, Redis and this process), both
hops' consumer lag (pipeline.Sampler, once a second), the view's size (``ResidencyStore.size``:
entries, distinct blocks, live holders) and Redis' ``used_memory``. A progress line goes to stderr
at each sample (elapsed/total, lag, RSS, view).

**Figures.** RSS growth per hour of each process incarnation: the least-squares slope of its
samples after ``--warmup`` s (from the soak's start, and from the incarnation's own start for a
restarted one), over at least ``--min-fit`` s, in MiB/h, and over the second half of those samples.
The view's size and growth per hour: each replica's caches hold at most 2,048 GPU + 4,096 CPU
+ 4,096 kvcr blocks (kvbus fleet's defaults, LRU), and a probe is one block the fleet removes again once
``--probe-keep`` newer ones are out, so a bounded view levels off at the fleet's capacity plus
``--probe-keep`` entries once the caches are full. Worst lag of
each hop, over the whole run and outside the faults (from each fault until it settled).
At the end the fleet stops, both hops drain and the view is compared with the fleet's ground
truth (``pipeline.view_matches_truth``) and every holder's position with the last batch published
(``faults.positions_match``). The last line is one JSON object with every figure.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import random
import signal
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import redis  # noqa: E402

import faults as fx  # noqa: E402  (benchmarks/faults.py: the fault registry and how a fault is followed)
import pipeline as pl  # noqa: E402  (benchmarks/pipeline.py: the processes, probes, lag, the truth check)
from kvbus.infra.procs import proc_rss_kib, read_pid  # noqa: E402
from kvbus.infra.stack_env import Paths  # noqa: E402
from kvbus.runtime.settings import Settings  # noqa: E402
from kvbus.sinks.view.store_url import open_store  # noqa: E402

log = logging.getLogger("kvbus.soak")

CONVERGENCE = ("fault_window_s", "in_flight", "late_probes", "max_stale_ms", "converge_from_fault_s",
               "converge_from_restart_s", "lag_back_s", "steady_fresh_p50_ms")
"""The per-fault figures of faults.figures the soak reports."""


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, required=True, help="minutes of load (faults included)")
    fx.add_load_args(p)
    p.add_argument("--workers", type=int, default=2, help="Faust worker processes (default 2)")
    p.add_argument("--probe-every", type=float, default=0.1, help="seconds between freshness probes (default 0.1)")
    p.add_argument("--probe-keep", type=int, default=600,
                   help="probes left in the view: the fleet removes the oldest beyond this many again "
                        "(kvbus fleet --probe-keep; 0 = none removed; default 600)")
    p.add_argument("--clear-rate", type=float, default=0.0005,
                   help="chance per engine step that a replica clears its cache (AllBlocksCleared), so that "
                        "the view churns as well as fills (kvbus fleet --clear-rate; default 0.0005)")
    p.add_argument("--faults", default=None,
                   help="comma-separated faults to draw from (default: every registered fault that fits)")
    p.add_argument("--fault-every", type=float, default=180.0, help="seconds between fault starts (default 180)")
    p.add_argument("--warmup", type=float, default=120.0,
                   help="seconds before the first fault, and left out of the RSS fits (default 120)")
    p.add_argument("--min-fit", type=float, default=300.0,
                   help="shortest span (s) of samples an RSS slope is fitted over (default 300)")
    p.add_argument("--sample-every", type=float, default=10.0, help="seconds between RSS/view samples (default 10)")
    fx.add_fault_args(p)
    p.add_argument("--drain-timeout", type=float, default=120.0,
                   help="seconds to wait for the pipeline to drain at the end (default 120)")
    p.add_argument("--samples-out", type=Path, default=None,
                   help="write every resource sample as a JSON line: seconds since the start, RSS KiB by process, "
                        "view size, Redis used_memory, probes published")
    p.add_argument("--seed", type=int, default=11, help="fleet seed and fault draw seed (default 11)")
    p.add_argument("--keep", action="store_true", help="leave the run's topics and Redis keys")
    p.add_argument("--keep-cluster", action="store_true", help="leave the cluster up even if this run started it")
    p.add_argument("--use-env", action="store_true",
                   help="use the caller's KVBUS_* settings instead of the fault cluster's (faults.CLUSTER_ENV)")
    return p.parse_args(argv)


def fits(f: fx.Fault, setup: fx.Fault, brokers: int = 3) -> bool:
    """Whether fault ``f`` can run on the soak's processes ``setup`` (its workers, sinks, sink options) and a
    cluster of ``brokers`` Kafka brokers: no Redis of its own, the same sinks and sink options, at most the
    soak's workers, at most the cluster's brokers."""
    return (f.redis is None and f.sinks == setup.sinks and f.sink_args == setup.sink_args
            and f.workers <= setup.workers and f.brokers <= brokers)


# -- samples -----------------------------------------------------------------------------

@dataclass
class Probe:
    """One resource sample (monotonic time ``t``)."""

    t: float
    rss_kib: dict[str, tuple[int, int]]
    """Process name -> (pid, VmRSS KiB)."""
    view: Optional[dict[str, int]] = None
    """ResidencyStore.size: entries, blocks, holders (None: Redis unreachable)."""
    redis_used: Optional[int] = None
    """Redis ``used_memory`` bytes."""
    probes: int = 0
    """Freshness probes published so far (each one block the fleet never evicts)."""


def service_processes() -> dict[str, int]:
    """The stack's processes by pid file name (kafka-<node>, registry, ...) -> pid."""
    out = {}
    for pf in sorted(Paths().run.glob("*.pid")):
        rec = read_pid(pf)
        if rec is not None:
            out[pf.stem] = rec.pid
    return out


class Resources(threading.Thread):
    """Samples every process's RSS, the view's size and Redis' memory every ``every`` s (from ``t0``,
    for ``total_s`` s), and prints a progress line on stderr."""

    def __init__(self, run: pl.Run, store: Any, prober: pl.Prober, lag: pl.Sampler, every: float, t0: float,
                 total_s: float) -> None:
        super().__init__(name="resources", daemon=True)
        self.run_, self.store, self.prober, self.lag = run, store, prober, lag
        self.every, self.t0, self.total_s = every, t0, total_s
        self.samples: list[Probe] = []
        self.stop = threading.Event()
        self.redis = redis.Redis.from_url(run.settings.redis_url)
        self.status = ""
        """What the soak is doing (shown on the progress line)."""

    def take(self) -> Probe:
        procs = {c.name: c.proc.pid for c in self.run_.children.started}
        procs.update(service_processes())
        procs["bench"] = os.getpid()
        rss = {}
        for name, pid in procs.items():
            kib = proc_rss_kib(pid)
            if kib is not None:
                rss[name] = (pid, kib)
        s = Probe(time.monotonic(), rss, probes=len(self.prober.published))
        try:
            s.view = self.store.reader().size()
            s.redis_used = int(self.redis.info("memory")["used_memory"])
            if "redis" not in rss:  # not one of the stack's pid files (a Redis of the caller's)
                pid = int(self.redis.info("server")["process_id"])
                kib = proc_rss_kib(pid)
                if kib is not None:
                    rss["redis"] = (pid, kib)
        except (redis.RedisError, OSError) as e:
            log.debug("view size not sampled: %s", e)
        return s

    def progress(self, s: Probe) -> str:
        el = s.t - self.t0
        last = self.lag.samples[-1] if self.lag.samples else None
        mib = {n: kib / 1024 for n, (_, kib) in s.rss_kib.items()}
        kinds: dict[str, float] = {}
        for n, v in mib.items():
            k = n.split("-")[0]
            kinds[k] = max(kinds.get(k, 0.0), v)
        view = s.view or {}
        return (f"[soak] {el / 60:5.1f}/{self.total_s / 60:.0f} min | lag raw {getattr(last, 'lag_raw', '?')} "
                f"blocks {getattr(last, 'lag_blocks', '?')} | max RSS MiB "
                + " ".join(f"{k}={v:.0f}" for k, v in sorted(kinds.items()))
                + f" | view {view.get('blocks', '?')} blocks {view.get('entries', '?')} entries "
                  f"{view.get('holders', '?')} holders | {self.status}")

    def run(self) -> None:
        while not self.stop.is_set():
            t = time.monotonic()
            try:
                s = self.take()
                self.samples.append(s)
                print(self.progress(s), file=sys.stderr, flush=True)
            except Exception:  # noqa: BLE001 - one lost sample, never a dead sampler
                log.exception("resource sample lost")
            self.stop.wait(max(0.0, self.every - (time.monotonic() - t)))


# -- figures -----------------------------------------------------------------------------

def slope_per_hour(points: list[tuple[float, float]]) -> Optional[float]:
    """Least-squares slope of (seconds, value) points, per hour; None for fewer than 3 points."""
    if len(points) < 3 or points[-1][0] - points[0][0] <= 0:
        return None
    return statistics.linear_regression([t for t, _ in points], [v for _, v in points]).slope * 3600.0


def rss_figures(samples: list[Probe], t0: float, warmup: float, min_fit: float) -> dict[str, Any]:
    """Per process name, per incarnation (pid): RSS first/last/max MiB and the growth slope (MiB/h)
    over its samples from ``warmup`` s after the later of the soak's and its own start, and over the
    second half of those samples (a buffer still filling at the warm-up's end slopes in the first
    half only; a leak slopes in both)."""
    series: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for s in samples:
        for name, (pid, kib) in s.rss_kib.items():
            series.setdefault((name, pid), []).append((s.t, kib / 1024.0))
    out: dict[str, Any] = {}
    for (name, pid), pts in sorted(series.items()):
        start = max(t0, pts[0][0]) + warmup
        fit = [(t, v) for t, v in pts if t >= start]
        span = fit[-1][0] - fit[0][0] if fit else 0.0
        slope = slope_per_hour(fit) if span >= min_fit else None
        tail = [(t, v) for t, v in fit if t >= fit[-1][0] - span / 2] if fit else []
        tail_slope = slope_per_hour(tail) if span >= min_fit else None
        out.setdefault(name, []).append({
            "pid": pid, "samples": len(pts), "fit_span_s": round(span), "first_mib": round(pts[0][1], 1),
            "after_warmup_mib": round(fit[0][1], 1) if fit else None, "last_mib": round(pts[-1][1], 1),
            "max_mib": round(max(v for _, v in pts), 1),
            "growth_mib_h": round(slope, 1) if slope is not None else None,
            "second_half_growth_mib_h": round(tail_slope, 1) if tail_slope is not None else None,
        })
    return out


def write_samples(path: Path, samples: list[Probe], t0: float) -> None:
    """Every sample as one JSON line (``--samples-out``)."""
    with open(path, "w", encoding="utf-8") as f:
        for s in samples:
            f.write(json.dumps({"t": round(s.t - t0, 1), "rss_kib": {n: kib for n, (_, kib) in s.rss_kib.items()},
                                "view": s.view, "redis_used": s.redis_used, "probes": s.probes}) + "\n")


def view_figures(samples: list[Probe], t0: float, warmup: float) -> dict[str, Any]:
    """The view's size after warm-up and at the end, its growth per hour and the probes' rate."""
    pts = [s for s in samples if s.view is not None and s.t >= t0 + warmup]
    if len(pts) < 3:
        return {}
    out: dict[str, Any] = {"after_warmup": pts[0].view, "end": pts[-1].view,
                           "max": {k: max(s.view[k] for s in pts) for k in pts[0].view}}
    for k in ("entries", "blocks", "holders"):
        v = slope_per_hour([(s.t, s.view[k]) for s in pts])
        out[f"{k}_per_h"] = round(v) if v is not None else None
    v = slope_per_hour([(s.t, s.probes) for s in pts])
    out["probes_per_h"] = round(v) if v is not None else None
    mem = [(s.t, s.redis_used / 2**20) for s in pts if s.redis_used is not None]
    v = slope_per_hour(mem)
    out["redis_used_mib"] = {"after_warmup": round(mem[0][1], 1), "end": round(mem[-1][1], 1),
                             "growth_mib_h": round(v, 1) if v is not None else None} if mem else None
    return out


def lag_figures(samples: list[pl.Sample], windows: list[tuple[float, float]]) -> dict[str, Any]:
    """Worst lag of each hop over the run and outside the fault windows (fault .. settled)."""
    def inside(t: float) -> bool:
        return any(a <= t <= b for a, b in windows)

    out: dict[str, Any] = {}
    for hop in ("lag_raw", "lag_blocks"):
        vals = [(s.t, getattr(s, hop)) for s in samples if getattr(s, hop) is not None]
        out[hop] = {"max": max((v for _, v in vals), default=None),
                    "max_outside_faults": max((v for t, v in vals if not inside(t)), default=None),
                    "p50": statistics.median([v for _, v in vals]) if vals else None}
    return out


# -- the soak ----------------------------------------------------------------------------

def follow_until(ctx: fx.Ctx, res: Resources, until: float, status: str) -> None:
    """Follow the flow (probes, processes) until monotonic time ``until``."""
    res.status = status
    ctx.follow(until - time.monotonic())


def one_fault(ctx: fx.Ctx, f: fx.Fault, since: float, t0: float) -> dict[str, Any]:
    """Run fault ``f`` on the soak's processes and follow it until the view is fresh again; its figures.
    ``since``: when the steady flow before it began (its lag range is the fault's baseline); ``t0``:
    the soak's start."""
    ctx.marks = {"start": since}
    ctx.notes = {}
    out: dict[str, Any] = {"fault": f.name}
    t = time.monotonic()
    try:
        f.run(ctx)
        out["settled"] = fx.settle(ctx)
        ctx.mark("settled")
    except fx.StageDied:
        raise
    except Exception as e:  # noqa: BLE001 - reported; the soak goes on to its end check
        out["error"] = f"{type(e).__name__}: {e}"[:2000]
        log.warning("fault %s failed: %s", f.name, out["error"])
    # what a paused process did; from the next fault on it is one of the soak's processes again (a
    # later fault may kill it: watched as woken still, its restart would start it a second time)
    out["woken_did"] = fx.woken_figures(ctx.woken).get("woken_did")
    ctx.woken = {}
    figs = fx.figures(ctx)
    out.update({k: figs.get(k) for k in CONVERGENCE})
    try:
        out.update(fx.restore_lost_broker(ctx))  # broker-lost: the next fault has three brokers again
    except Exception as e:  # noqa: BLE001 - reported; the soak goes on on two brokers
        restart_error = f"restarting the lost broker: {type(e).__name__}: {e}"
        out["error"] = "; ".join(filter(None, (out.get("error"), restart_error)))[:2000]
        log.warning("fault %s: %s", f.name, out["error"])
    out["at_s"] = round(ctx.marks.get("fault", t) - t0, 1)
    out["window"] = (ctx.marks.get("fault", t), ctx.marks.get("settled", time.monotonic()))
    if ctx.notes:
        out["notes"] = dict(ctx.notes)
    return out


def soak(args: argparse.Namespace, base: Settings, state_dir: Path, brokers: int = 3) -> dict[str, Any]:

    setup = fx.Fault("soak", lambda ctx: None, "the soak's processes", workers=args.workers)
    pool = [f for f in fx.FAULTS.values() if fits(f, setup, brokers)]
    if args.faults:
        names = [n.strip() for n in args.faults.split(",") if n.strip()]
        unknown = [n for n in names if n not in fx.FAULTS or not fits(fx.FAULTS[n], setup, brokers)]
        if unknown:
            raise SystemExit(f"faults unknown or not fitting the soak's processes: {unknown}; "
                             f"these fit: {[f.name for f in pool]}")
        pool = [fx.FAULTS[n] for n in names]
    rng = random.Random(args.seed)
    pargs = fx.stage_args(args, setup)
    pargs.drain_timeout = args.drain_timeout
    run = pl.new_run(pargs, base, state_dir / "logs")
    total_s = args.minutes * 60.0
    out: dict[str, Any] = {"run": run.run_id, "minutes": args.minutes, "rate_ev_s": args.rate,
                           "replicas": args.replicas, "workers": args.workers, "cluster": base.bootstrap,
                           "probe_keep": args.probe_keep, "clear_rate": args.clear_rate,
                           "fault_pool": [f.name for f in pool], "faults": [],
                           "ok": False}
    print(f"soak {run.run_id}: {args.minutes:g} min at {args.rate:g} engine events/s, {args.replicas} replicas, "
          f"{args.workers} workers, a fault every {args.fault_every:g} s from {out['fault_pool']}; "
          f"logs {run.children.log_dir}/{run.run_id}-*", flush=True)
    lag: Optional[pl.Sampler] = None
    res: Optional[Resources] = None
    try:
        started = fx.start_run(run, pargs, state_dir / "logs", args.rate, total_s + 3600.0,
                               fleet_args=("--probe-keep", str(args.probe_keep), "--clear-rate", str(args.clear_rate)))
        ports, manifest, store, prober = started.ports, started.manifest, started.store, started.prober
        lag = pl.Sampler(run)
        lag.start()
        t0 = time.monotonic()
        res = Resources(run, open_store(run.settings.redis_url, run.prefix, load=False), prober, lag,
                        args.sample_every, t0, total_s)
        res.start()
        ctx = fx.Ctx(args, run, prober, lag, ports)
        end = t0 + total_s
        next_fault = t0 + args.warmup
        steady_since = t0
        while True:
            if next_fault + 30.0 > end:  # no fault without time to follow it
                follow_until(ctx, res, end, "steady to the end")
                break
            follow_until(ctx, res, next_fault, f"steady, next fault at {(next_fault - t0) / 60:.1f} min")
            f = rng.choice(pool)
            res.status = f"fault {f.name}"
            print(f"[soak] +{(time.monotonic() - t0) / 60:.1f} min: fault {f.name}: {f.doc}", file=sys.stderr,
                  flush=True)
            r = one_fault(ctx, f, steady_since, t0)
            steady_since = time.monotonic()
            out["faults"].append(r)
            print(f"  {f.name}: " + ", ".join(f"{k} {r.get(k)}" for k in ("settled", *CONVERGENCE[3:7]))
                  + (f", error {r['error']}" if r.get("error") else ""), flush=True)
            next_fault = max(next_fault + args.fault_every, time.monotonic() + 30.0)
        res.status = "draining"
        run.children.stop(ctx.child("fleet"))  # SIGTERM: the fleet writes its final manifest
        t_stop = time.monotonic()
        try:
            drained = pl.drain(run, pargs, prober, lag)
        except SystemExit as e:  # pipeline.check_alive: a stage exited
            raise fx.StageDied(str(e)) from None
        out["drained"], out["drain_s"] = drained, round(time.monotonic() - t_stop, 1)
        exact, diffs = pl.view_matches_truth(store, manifest) if manifest.exists() else (False, ["no manifest"])
        pos_ok, pos_diffs = fx.positions_match(store, manifest) if manifest.exists() else (False, ["no manifest"])
        out.update(view_exact=exact, view_diffs=diffs[:5], positions_ok=pos_ok, position_diffs=pos_diffs[:5])
        out["probes"] = len(prober.published)
        out["probes_withdrawn"] = prober.withdrawn  # cleared by their holder before they showed
        out["ok"] = bool(drained and exact and pos_ok
                         and all(r.get("settled") and not r.get("error") for r in out["faults"]))
        out["elapsed_s"] = round(t_stop - t0, 1)
    except (Exception, SystemExit) as e:  # noqa: BLE001 - reported with the figures so far
        out["error"] = f"{type(e).__name__}: {e}"[:3000]
        log.warning("soak failed: %s", out["error"])
    finally:
        if res is not None:
            res.stop.set()
            res.join(timeout=30)
            out["rss"] = rss_figures(res.samples, res.t0, args.warmup, args.min_fit)
            if args.samples_out:
                write_samples(args.samples_out, res.samples, res.t0)
            out["view"] = view_figures(res.samples, res.t0, args.warmup)
        if lag is not None:
            lag.stop.set()
            windows = [r.pop("window") for r in out["faults"] if "window" in r]
            out["lag"] = lag_figures(lag.samples, windows)
        run.children.stop_all()
        if not args.keep:
            try:
                pl.cleanup(run)
            except Exception as e:  # noqa: BLE001 - a cleanup failure must not hide the figures
                log.warning("cleanup of %s: %s", run.run_id, e)
    return out


def report(out: dict[str, Any]) -> None:
    """The figures as text (stdout)."""
    print("\n== faults")
    for r in out["faults"]:
        print(f"  +{r.get('at_s', 0) / 60:5.1f} min {r['fault']:<14} settled {fx.cell(r.get('settled'))} "
              f"converge (fault/restart) {fx.cell(r.get('converge_from_fault_s'))}/"
              f"{fx.cell(r.get('converge_from_restart_s'))} s, max stale {fx.cell(r.get('max_stale_ms'))} ms, "
              f"lag back {fx.cell(r.get('lag_back_s'))} s" + (f", woken {r['woken_did']}" if r.get("woken_did") else "")
              + (f", ERROR {r['error']}" if r.get("error") else ""))
    print("\n== RSS (MiB; growth = least-squares slope after warm-up, MiB/h)")
    for name, incs in out.get("rss", {}).items():
        for i in incs:
            print(f"  {name:<14} pid {i['pid']:<8} {i['after_warmup_mib'] or i['first_mib']:>7} -> {i['last_mib']:>7}"
                  f" (max {i['max_mib']}) over {i['fit_span_s']} s: {fx.cell(i['growth_mib_h'])} MiB/h, "
                  f"second half {fx.cell(i['second_half_growth_mib_h'])} MiB/h")
    v = out.get("view") or {}
    if v:
        print(f"\n== view: {v['after_warmup']} after warm-up, {v['end']} at the end; per hour: "
              f"blocks {v['blocks_per_h']}, entries {v['entries_per_h']}, holders {v['holders_per_h']} "
              f"(probes published {v['probes_per_h']}/h, the last {out.get('probe_keep')} kept); Redis used_memory "
              f"{v.get('redis_used_mib')}")
    for hop, fig in (out.get("lag") or {}).items():
        print(f"== {hop}: max {fig['max']}, max outside faults {fig['max_outside_faults']}, median {fig['p50']}")
    print(f"\ndrained {fx.cell(out.get('drained'))}, view == truth {fx.cell(out.get('view_exact'))}, positions "
          f"{fx.cell(out.get('positions_ok'))}; ok {fx.cell(out.get('ok'))}"
          + (f"\n  error: {out['error']}" if out.get("error") else "")
          + "".join(f"\n  {k}: {out[k]}" for k in ("view_diffs", "position_diffs") if out.get(k)), flush=True)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("kvbus.bench").setLevel(logging.WARNING)
    logging.getLogger("kvbus.faults").setLevel(logging.WARNING)

    def interrupted(signum: int, _frame: Any) -> None:  # SIGTERM (SIGINT is ignored in a background job)
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, interrupted)  # the run's processes stopped, the cluster as it was started
    from kvbus.infra import stack

    started = not stack.status().get("ready")
    if started:
        print(f"bringing the cluster up (3 brokers, state {os.environ.get('KVBUS_STATE_DIR')}) ...", flush=True)
    info = fx.cluster_up(args.use_env)
    print(f"cluster: {info['bootstrap']} (replication {info['replication']}), registry {info['registry_url']}, "
          f"redis {info['redis_url']}", flush=True)
    try:
        out = soak(args, Settings.from_env(), Path(info["state_dir"]), int(info["brokers"]))
    finally:
        if started and not args.keep_cluster:
            stack.down()
            print("cluster stopped", flush=True)
    report(out)
    print(json.dumps(out, default=str))
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
