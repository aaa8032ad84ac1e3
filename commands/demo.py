"""``kvbus demo``: the main job in one command.

Brings the stack up (or reuses it), registers the schemas, starts a synthetic fleet,
one bridge per engine stream, the Faust worker and the sink as child processes,
streams for ``--duration`` seconds with a live progress line, lets the pipeline
drain, then prints the residency view and one lookup for a prompt the fleet served.
Ctrl-C stops everything it started (the stack too, if it started it).

``--secure``: the same on the secured stack (``infra/stack up --secure``: SASL_SSL Kafka with ACLs,
TLS Redis with ACL users, a registry requiring credentials for writes), each stage run as its own
least-privilege principal from the env files the stack writes (bridge, streams, sink; the lookup as
router; the demo itself, which registers the schemas and reads the groups' lag, as admin).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import time
import uuid
from pathlib import Path

from kvbus.children import Children, wait_for
from kvbus.demo_layout import (
    BRIDGE_METRICS_BASE,
    REPLICAS,
    SINK_GROUP,
    SINK_METRICS_PORT,
    WORKER_GROUP,
    WORKER_METRICS_PORT,
    WORKERS,
    metrics_endpoints,
)
from kvbus.demo_progress import Progress
from kvbus.runtime.settings import Settings

log = logging.getLogger("kvbus.demo")



def add_demo_args(p: argparse.ArgumentParser) -> None:
    """Options of ``kvbus demo``."""
    p.add_argument("--replicas", type=int, default=REPLICAS, help=f"engine replicas (default {REPLICAS})")
    p.add_argument("--workers", type=int, default=WORKERS,
                   help=f"tensor-parallel workers per replica, each its own stream and bridge (default {WORKERS})")
    p.add_argument("--duration", type=float, default=30.0, help="seconds of streaming (default 30)")
    p.add_argument("--rate", type=float, default=20.0,
                   help="engine steps (batches) per second per replica (default 20)")
    p.add_argument("--seed", type=int, default=7, help="fleet seed (default 7)")
    p.add_argument("--base-port", type=int, default=5557, help="first ZMQ port of the fleet (default 5557)")
    p.add_argument("--format", default="vllm-0.33", help="engine wire format of the fleet (default vllm-0.33)")
    p.add_argument("--keep-stack", action="store_true",
                   help="leave the services running at the end (default: stop them if the demo started them)")
    p.add_argument("--drain-timeout", type=float, default=60.0,
                   help="seconds to wait for the sink to catch up after the fleet stops")
    p.add_argument("--secure", action="store_true",
                   help="run on the secured stack (infra/stack up --secure), each stage as its own principal")


def run_demo(args: argparse.Namespace, settings: Settings) -> int:
    """Run the demo; exit code 0 when the example lookup agrees with the fleet's ground truth."""
    from kvbus.infra import stack

    if args.secure:
        from kvbus.infra import secure as stack  # noqa: F811 - the secured stack's up/down/status
    kind = "secured stack" if args.secure else "stack"
    state_dir = Path(os.environ.get("KVBUS_STATE_DIR", Path.cwd() / ".infra"))
    started_stack = not stack.status().get("ready")
    if started_stack:
        print(f"== bringing the {kind} up (Kafka, Apicurio Registry, Redis) ...", flush=True)
        t0 = time.monotonic()
        stack.up()
        print(f"   {kind} up in {time.monotonic() - t0:.1f}s", flush=True)
    else:
        print(f"== reusing the running {kind}", flush=True)
    envs = principal_envs() if args.secure else {}
    if args.secure:
        settings = Settings.from_env({**os.environ, **envs["admin"]})
        print("== stages run as their principals: sink=sink, worker=streams, bridges=bridge, lookup=router "
              "(env files in .infra/secure/env)", flush=True)
    children = Children(log_dir=state_dir / "logs")
    manifest = state_dir / f"demo-manifest-{uuid.uuid4().hex[:6]}.json"
    try:
        _register_schemas(settings)
        _start_pipeline(children, args, manifest, envs)
        ok = _stream(children, args, settings, manifest,
                     Settings.from_env({**os.environ, **envs["router"]}) if args.secure else settings)
        return 0 if ok else 1
    except KeyboardInterrupt:
        print("\n== interrupted: stopping what the demo started", flush=True)
        return 130
    finally:
        children.stop_all()
        if started_stack and not args.keep_stack:
            print("== stopping the stack the demo started (use --keep-stack to leave it up)", flush=True)
            stack.down()
        manifest.unlink(missing_ok=True)


def _register_schemas(settings: Settings) -> None:
    from kvbus.schemas.registry import register

    ids = register(settings.registry_url, settings.topics, ("kvcr",), settings.security.registry)
    print(f"== schemas registered: {', '.join(f'{s}={i}' for s, i in ids.items())}", flush=True)


def _streams(args: argparse.Namespace) -> list[tuple[str, int, int, int]]:
    """(replica, worker_rank, pub_port, replay_port) of every fleet stream (kvbus.simulator.fleet's port rule)."""
    from kvbus.simulator.fleet import FleetConfig, stream_index

    cfg = FleetConfig(replicas=args.replicas, workers=args.workers, base_port=args.base_port)
    out = []
    for i in range(args.replicas):
        for w in range(args.workers):
            port = args.base_port + 2 * stream_index(cfg, i, 0, w)
            out.append((f"{cfg.replica_prefix}{i}", w, port, port + 1))
    return out


def principal_envs() -> dict[str, dict[str, str]]:
    """The secured stack's ``KVBUS_*`` settings of each principal (its env files)."""
    from kvbus.infra import secure
    from kvbus.infra.stack_env import read_env_file

    layout = secure.SecureLayout.default()
    return {p: read_env_file(layout.env_file(p)) for p in secure.PRINCIPALS}


def _start_pipeline(children: Children, args: argparse.Namespace, manifest: Path,
                    envs: dict[str, dict[str, str]]) -> None:
    """Start sink, worker, bridges and fleet; ``envs``: principal -> settings (secured stack), or empty."""
    print("== starting sink, Faust worker, bridges and fleet (logs in "
          f"{children.log_dir}/demo-*.log)", flush=True)
    children.start("sink", "sink", "--group", SINK_GROUP, "--metrics-port", str(SINK_METRICS_PORT),
                   env=envs.get("sink"))
    children.start("worker", "worker", "--app-id", WORKER_GROUP, "--metrics-port", str(WORKER_METRICS_PORT),
                   "--workdir", str(children.log_dir.parent / "demo"), env=envs.get("streams"))
    for n, (replica, w, pub, replay) in enumerate(_streams(args)):
        children.start(
            f"bridge-{replica}-w{w}", "bridge",
            "--endpoint", f"tcp://127.0.0.1:{pub}", "--replay-endpoint", f"tcp://127.0.0.1:{replay}",
            "--replica", replica, "--worker-rank", str(w), "--workers", str(args.workers),
            "--metrics-port", str(BRIDGE_METRICS_BASE + n), env=envs.get("bridge"),
        )
    time.sleep(2.0)  # let bridges connect before the fleet's first batch (replay covers the rest)
    children.start(
        "fleet", "fleet", "--replicas", str(args.replicas), "--workers", str(args.workers),
        "--base-port", str(args.base_port), "--rate", str(args.rate), "--seed", str(args.seed),
        "--format", args.format, "--duration", str(args.duration), "--manifest", str(manifest),
    )


def _stream(children: Children, args: argparse.Namespace, settings: Settings, manifest: Path,
            reader: Settings) -> bool:
    """Stream, show progress, drain; then the view and a lookup read with ``reader``'s settings."""
    progress = Progress(
        settings,
        bridge_ports=[BRIDGE_METRICS_BASE + n for n in range(len(_streams(args)))],
        worker_port=WORKER_METRICS_PORT, sink_port=SINK_METRICS_PORT,
        worker_group=WORKER_GROUP, sink_group=SINK_GROUP,
    )
    fleet = next(c for c in children.started if c.name == "fleet")
    print("== watch it live from another terminal: " + top_command(len(_streams(args))), flush=True)
    print(f"== streaming for {args.duration:.0f}s", flush=True)
    while fleet.proc.poll() is None:
        _check_alive(children)
        print("\r   " + progress.line(), end="", flush=True)
        time.sleep(1.0)
    print("\r   " + progress.line(), flush=True)
    print("== fleet stopped; waiting for the pipeline to drain", flush=True)
    drained = wait_for(lambda: progress.drained(), args.drain_timeout, 1.0)
    print("   " + progress.line() + ("" if drained else "  (not fully drained)"), flush=True)
    return _report(reader, manifest)


def top_command(bridges: int) -> str:
    """The ``kvbus top`` command line that watches a demo with ``bridges`` bridges."""
    flags = " ".join(f"--{role} {ports}" for role, ports in metrics_endpoints(bridges).items())
    return f"kvbus top {flags} --worker-group {WORKER_GROUP} --sink-group {SINK_GROUP}"


def _check_alive(children: Children) -> None:
    report = children.stopped_report(ignore=("fleet",))
    if report:
        raise SystemExit(f"demo: a stage stopped unexpectedly: {report}")


def _report(settings: Settings, manifest: Path) -> bool:
    from kvbus.client import ViewClient
    from kvbus.client.lookup_cli import add_lookup_args, lookup_answer

    with ViewClient(settings.redis_url, **settings.redis_kwargs()) as client:
        view = client.summary()
    print("== residency view (blocks per replica per tier):")
    for holder in sorted(view):
        tiers = ", ".join(f"{t}={n}" for t, n in sorted(view[holder].items()))
        print(f"   {holder:14s} {tiers}")
    data = json.loads(manifest.read_text())
    pick = _pick_prompt(data)
    if pick is None:
        print("== no fully resident prompt to look up (try a longer --duration)")
        return False
    holder, prompt = pick
    argv = ["--json", "--block-size", str(data["block_size"]), "--algo", data["hash_algo"],
            "--tokens", ",".join(map(str, prompt["tokens"]))]
    parser = argparse.ArgumentParser(prog="kvbus lookup")
    add_lookup_args(parser)
    answer = lookup_answer(parser.parse_args(argv), settings)
    shown = " ".join(argv[:-1]) + f" {','.join(map(str, prompt['tokens'][:6]))},…"
    print(f"== lookup of a {len(prompt['tokens'])}-token prompt ({prompt['blocks']} blocks) that {holder} served:")
    print(f"   $ kvbus lookup {shown}")
    print("   " + json.dumps(answer, sort_keys=True))
    name = holder[:-2] if holder.endswith("#0") else holder
    got = answer.get(name, {}).get("matched", 0)
    ok = got == prompt["blocks"]
    print(f"== {name} holds {got} of {prompt['blocks']} leading blocks: "
          + ("matches the fleet's ground truth" if ok else "DOES NOT match the fleet's ground truth"))
    return ok


def _pick_prompt(data: dict) -> tuple[str, dict] | None:
    """The longest prompt that is fully resident on GPU at the end, and who holds it."""
    best = None
    for holder, rep in data["replicas"].items():
        for p in rep["prompts"]:
            if p["resident"] and (best is None or p["blocks"] > best[1]["blocks"]):
                best = (holder, p)
    return best
