"""benchmarks/routing.py: its options reach pipeline.py's helpers (synthetic and trace mode), the trace
mode's parts (the trace's expansion into engine blocks, the service model, what each router knows), and
a real smoke run of each mode through the stack whose last stdout line is the JSON figures."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvbus.runtime.settings import Settings
from tests.test_benchmarks_start import BENCHMARKS, args_read, import_benchmark

PIPELINE_HELPERS = {"new_run", "start_stages"}
"""The pipeline.py functions routing.py calls with a namespace of its own."""


def test_the_synthetic_mode_gives_the_pipeline_helpers_every_option_they_read() -> None:
    routing = import_benchmark("routing")
    args = routing.parse_args([])
    args.base_port = 20000  # main() sets it from a free port block
    assert args_read(BENCHMARKS / "pipeline.py", PIPELINE_HELPERS) - set(vars(args)) == set()


def test_the_trace_mode_gives_the_pipeline_helpers_every_option_they_read() -> None:
    routing = import_benchmark("routing")
    trace = import_benchmark("routing_trace")
    args = routing.parse_args(["--trace", "t.jsonl", "--routers", "1,4", "--shared-load"])
    stage = trace.stages_args(args, 3, 20000)
    assert args_read(BENCHMARKS / "pipeline.py", PIPELINE_HELPERS) - set(vars(stage)) == set()
    assert (stage.replicas, stage.streams_per_bridge, args.replicas) == (24, 8, 8)  # one bridge per kvbus fleet


def test_every_router_decides_with_the_clients_policy() -> None:
    """The benchmark's own ``pick`` is gone: every router calls kvbus.client.routing.choose."""
    routing = import_benchmark("routing")
    assert not hasattr(routing, "pick")
    assert routing.parse_args([]).beta == routing.DEFAULT_BETA
    text = (BENCHMARKS / "routing_trace.py").read_text()
    assert "from kvbus.client.routing import choose" in text


def test_a_trace_id_expands_to_the_same_tokens_and_prefixes_stay_prefixes() -> None:
    trace = import_benchmark("routing_trace")
    assert trace.id_tokens(7) == trace.id_tokens(7) and trace.id_tokens(7) != trace.id_tokens(8)
    assert len(trace.id_tokens(7)) == 512 and all(0 < t < trace.VOCAB for t in trace.id_tokens(7))
    short = trace.TraceRequest(0.0, 700, 10, (1, 2))
    long = trace.TraceRequest(0.0, 1500, 10, (1, 2, 3))
    a, b = trace.prompt_tokens(short), trace.prompt_tokens(long)
    assert len(a) == 700 and b[:700] == a  # the last id partial: input_length tokens


def test_prefill_queues_fcfs_and_a_request_is_in_flight_until_its_decode_ends() -> None:
    trace = import_benchmark("routing_trace")
    svc = trace.ServiceModel(prefill_s=0.001, decode_s=0.01)
    r = trace.Replica()
    assert r.serve(0.0, 1000, 10, svc) == pytest.approx((1.0, 1.1))
    assert r.serve(0.5, 500, 0, svc) == pytest.approx((1.0, 1.5))  # waits 0.5 s for the first prefill
    assert (r.in_flight(0.9), r.in_flight(1.2), r.in_flight(2.0)) == (2, 1, 0)


def test_each_router_instance_sees_its_own_load_unless_load_is_shared() -> None:
    trace = import_benchmark("routing_trace")
    args = argparse.Namespace(approx_blocks=1000, beta=0.5, prefill_us=40.0, decode_ms=12.0)
    models = trace.build_lanes([trace.LaneSpec("least_loaded", 2, False)], _in_process(args), None, None)[0].models
    own = trace.Lane(trace.LaneSpec("least_loaded", 2, False), models, args)
    shared = trace.Lane(trace.LaneSpec("least_loaded", 2, True), models, args)
    assert own.boards[0] is not own.boards[1] and shared.boards[0] is shared.boards[1]
    shared.boards[0].add("replica-0", 5.0)
    assert shared.boards[1].load(1.0)["replica-0"] == 1 and shared.boards[1].load(6.0)["replica-0"] == 0


class FakeView:
    """What LoadReporter writes (``report``), summed over routers as ViewClient.load sums it."""

    def __init__(self) -> None:
        self.reports: dict[str, dict] = {}
        self.leases: list[float] = []

    def report(self, router: str, loads: dict, lease: float) -> None:
        self.reports.setdefault(router, {}).update(loads)
        self.leases.append(lease)

    def sums(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for loads in self.reports.values():
            for replica, ld in loads.items():
                out[replica] = out.get(replica, 0) + ld.requests
        return out


def test_kvbus_routers_report_started_and_finished_in_the_trace_time_and_renew_their_leases() -> None:
    trace = import_benchmark("routing_trace")
    view = FakeView()
    load = trace.ViewLoad(view, "kvbus/2r/shared", 2, lease=30.0)
    load.started(0, "r0", 100, end=5.0)
    load.started(1, "r0", 200, end=2.0)
    load.started(1, "r1", 300, end=9.0)
    assert view.sums() == {"r0": 2, "r1": 1} and set(view.reports) == {"kvbus/2r/shared#0", "kvbus/2r/shared#1"}
    assert load.own(0) == {"r0": 1} and load.own(1) == {"r0": 1, "r1": 1}
    load.advance(4.0)  # the request of instance 1 on r0 ended at 2.0 trace s: instance 1 reports it finished
    assert view.sums() == {"r0": 1, "r1": 1} and load.own(1) == {"r0": 0, "r1": 1}
    assert view.reports["kvbus/2r/shared#1"]["r0"].tokens == 0
    load.advance(10.0)
    assert view.sums() == {"r0": 0, "r1": 0}
    n = len(view.leases)
    load.keepalive(load.renewed + trace.RENEW_EVERY / 2)
    assert len(view.leases) == n  # not due yet
    load.keepalive(load.renewed + trace.RENEW_EVERY)
    assert len(view.leases) == n + 2 and set(view.leases) == {30.0}  # both instances renewed


def test_engines_can_publish_a_requests_events_when_its_prefill_ends_in_trace_time() -> None:
    trace = import_benchmark("routing_trace")
    args = _in_process(argparse.Namespace(approx_blocks=1000, beta=0.5, prefill_us=1000.0, decode_ms=12.0,
                                          publish_at="prefill-end"))
    models = trace.build_lanes([trace.LaneSpec("oracle")], args, None, None)[0].models
    sent: list[tuple[str, int]] = []
    lane = trace.Lane(trace.LaneSpec("oracle"), models, args, publish=lambda r, ev: sent.append((r, len(ev))))
    req = trace.TraceRequest(1.0, 64, 10, (1,))  # 4 blocks, 64 uncached tokens x 1 ms: prefill ends at 1.064 s
    tokens = trace.prompt_tokens(req)
    hashes, digests = lane.models["replica-0"].hashes(tokens)
    replica = lane.route(0, req, tokens, hashes, digests)
    assert sent == []
    lane.flush(1.05)
    assert sent == []
    lane.flush(1.07)
    assert [r for r, _ in sent] == [replica]  # its batch (one BlockStored of the 4 blocks)


def test_router_kinds_can_be_chosen_and_kvbus_predicted_is_one() -> None:
    trace = import_benchmark("routing_trace")
    assert "kvbus_predicted" in trace.ROUTERS and set(trace.VIEW_ROUTERS) == {"kvbus", "kvbus_predicted"}
    assert [s.key for s in trace.lane_specs([1, 4], True, trace.iter_kinds("kvbus_predicted,oracle"))] == [
        "oracle", "kvbus_predicted", "oracle/4r", "kvbus_predicted/4r", "oracle/4r/shared",
        "kvbus_predicted/4r/shared"]
    with pytest.raises(SystemExit):
        trace.iter_kinds("kvbus,nope")


def test_the_targets_compare_kvbus_with_the_oracle_and_one_router() -> None:
    trace = import_benchmark("routing_trace")

    def fig(kind: str, routers: int, shared: bool, share: float, ttft: float, imb: float) -> dict:
        return {"kind": kind, "routers": routers, "shared_load": shared, "share_of_oracle": share,
                "ttft_p90_s": ttft, "load_imbalance": imb}
    figs = {"oracle": fig("oracle", 1, False, 1.0, 2.0, 1.5), "kvbus_predicted": fig("kvbus_predicted", 1, False,
                                                                                     0.99, 2.1, 1.5),
            "oracle/4r/shared": fig("oracle", 4, True, 1.0, 2.0, 1.5),
            "kvbus_predicted/4r/shared": fig("kvbus_predicted", 4, True, 0.96, 2.4, 1.6)}
    met = [(r["target"].split(":")[0], r["measured"], r["met"]) for r in trace.targets(figs)]
    assert met == [("kvbus_predicted, 1 router", 0.99, True), ("kvbus_predicted, 4 routers sharing load", 0.96, False),
                   ("kvbus_predicted, 4 routers sharing load", 1.067, True),  # imbalance 1.6 / 1.5
                   ("kvbus_predicted", 1.05, True), ("kvbus_predicted/4r/shared", 1.2, False)]
    assert "| no |" in trace.targets_table(trace.targets(figs))


def test_the_approximate_router_remembers_what_it_sent_where_within_its_bound() -> None:
    trace = import_benchmark("routing_trace")
    rec = trace.SentPrefixes(capacity=4)
    rec.record([b"a", b"b", b"c"], "r0")
    rec.record([b"a", b"x"], "r1")
    assert rec.matches([b"a", b"b", b"c", b"d"]) == {"r0": 3, "r1": 1}
    rec.record([b"p", b"q"], "r2")  # 6 hashes > 4: the two least recent (b, c) are forgotten
    assert rec.matches([b"a", b"b"]) == {"r0": 1, "r1": 1}


def test_in_process_routers_replay_a_trace_and_the_oracle_reuses_most() -> None:
    trace = import_benchmark("routing_trace")
    args = _in_process(argparse.Namespace(approx_blocks=4 * 400, beta=0.5, prefill_us=40.0, decode_ms=12.0))
    reqs = [trace.TraceRequest(i * 0.2, 512 * (2 + i % 3), 50, (i % 5, 100 + i % 7, 200 + i))
            for i in range(60)]
    specs = [s for s in trace.lane_specs([1, 2], True) if s.kind not in trace.VIEW_ROUTERS]
    lanes = trace.build_lanes(specs, args, None, None)
    hasher = lanes[0].models["replica-0"]
    for i, req in enumerate(reqs):
        tokens = trace.prompt_tokens(req)
        hashes, digests = hasher.hashes(tokens)
        for lane in lanes:
            lane.route(i, req, tokens, hashes, digests)
    figs = trace.lane_figures(lanes)
    assert set(figs) == {"oracle", "approximate", "least_loaded", "round_robin", "oracle/2r", "approximate/2r",
                         "least_loaded/2r", "round_robin/2r", "oracle/2r/shared", "approximate/2r/shared",
                         "least_loaded/2r/shared", "round_robin/2r/shared"}
    assert figs["oracle"]["reused_tokens"] > figs["round_robin"]["reused_tokens"] > 0
    assert all(f["requests"] == 60 and f["ttft_p90_s"] >= f["ttft_p50_s"] >= 0 for f in figs.values())
    assert "| oracle |" in trace.table(figs)


def _in_process(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` with a small fleet: 4 replicas of 400 blocks (evictions within a few requests)."""
    args.replicas, args.gpu_blocks, args.seed = 4, 400, 0
    return args


# -- smoke runs through the stack --------------------------------------------------------------------

TRACE_KEYS = {"mode", "requests", "speedup", "beta", "lanes", "events", "freshness_p50_ms", "freshness_p99_ms",
              "view_exact", "max_behind_schedule_s"}
LANE_KEYS = {"reused_tokens", "reused_share", "share_of_oracle", "hit_rate", "ttft_p50_s", "ttft_p90_s",
             "load_imbalance"}


def run_routing(stack: Settings, *argv: str) -> dict:
    """routing.py ``argv`` on the session's stack; its last stdout line, parsed (one JSON object)."""
    env = {**os.environ, **stack.to_env()}
    r = subprocess.run([sys.executable, str(BENCHMARKS / "routing.py"), *argv], capture_output=True, text=True,
                       timeout=300, cwd=BENCHMARKS.parent, env=env)
    assert r.returncode == 0, f"routing.py exited {r.returncode}:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    last = r.stdout.strip().splitlines()[-1]
    out = json.loads(last)
    assert isinstance(out, dict)
    return out


@pytest.mark.integration
def test_a_synthetic_run_ends_with_its_figures(stack: Settings) -> None:
    out = run_routing(stack, "--rates", "1000", "--seconds", "4", "--warmup", "1", "--replicas", "4")
    fig = out["rates"]["1000"]
    assert {"kvbus", "oracle", "round_robin"} <= set(fig["routers"]) and fig["view_exact"] is True
    assert fig["routers"]["kvbus"]["requests"] > 0 and "kvbus_share" in out


@pytest.mark.integration
def test_a_trace_run_ends_with_its_figures(stack: Settings, tmp_path: Path) -> None:
    lines = [{"timestamp": i * 100, "input_length": 512 * (1 + i % 3) + 100, "output_length": 20,
              "hash_ids": [0, *(1000 + i % 4 + k for k in range(1 + i % 3))]} for i in range(30)]
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = run_routing(stack, "--trace", str(path), "--speedup", "1", "--replicas", "2", "--gpu-blocks", "100",
                      "--routers", "1,2", "--shared-load", "--probe-every", "0.05", "--drain-timeout", "30")
    assert TRACE_KEYS <= set(out) and out["requests"] == 30 and out["view_exact"] is True
    assert set(out["lanes"]) >= {"oracle", "kvbus", "kvbus_predicted", "approximate", "least_loaded", "round_robin",
                                 "kvbus/2r", "kvbus/2r/shared", "kvbus_predicted/2r/shared"}
    for name, fig in out["lanes"].items():
        assert LANE_KEYS <= set(fig), name
        assert fig["requests"] == 30
    assert out["events"] > 0 and out["lanes"]["oracle"]["reused_tokens"] > 0
    assert "shared_load_note" in out and out["targets"]
    assert all(out["lanes"][k]["predicted_blocks"] > 0 for k in ("kvbus_predicted", "kvbus_predicted/2r/shared"))
