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
    specs = [s for s in trace.lane_specs([1, 2], True) if s.kind != "kvbus"]
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
    assert set(out["lanes"]) >= {"oracle", "kvbus", "approximate", "least_loaded", "round_robin", "kvbus/2r",
                                 "kvbus/2r/shared"}
    for name, fig in out["lanes"].items():
        assert LANE_KEYS <= set(fig), name
        assert fig["requests"] == 30
    assert out["events"] > 0 and out["lanes"]["oracle"]["reused_tokens"] > 0
    assert "shared_load_note" in out
