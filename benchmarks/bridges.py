"""CPU per engine event of the bridges alone, on the real stack (Kafka + registry): E engine streams
through bridge processes of S streams each.

    .venv/bin/python benchmarks/bridges.py --streams-per-bridge 1     # one bridge per stream (sidecars)
    .venv/bin/python benchmarks/bridges.py --streams-per-bridge 8     # one node-level bridge
    .venv/bin/python benchmarks/bridges.py --bridge-python /other/tree/.venv/bin/python --bridge-cwd /other/tree

This process plays a pregenerated synthetic fleet (``kvbus.simulator.fleet``, vLLM 0.33, encoded
before the clock starts) at ``--rate`` engine events/s for ``--seconds``, then waits until the
bridges' producers have had every event acknowledged by Kafka. The figure is the CPU (user +
system, every thread, librdkafka's included) the bridge processes used from the first batch sent
to the last acknowledgement, per engine event: ``bridge_us_per_event``. It is CPU, not wall time,
so a machine shared with other work changes it less than it changes throughput; compare trees
side by side anyway (``--bridge-python`` / ``--bridge-cwd`` run another tree's bridges).

Prints one line per run, the last line one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import uuid
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kvbus.children import cpu_seconds, free_port, free_port_block, wait_for  # noqa: E402
from kvbus.demo_progress import scrape  # noqa: E402
from kvbus.runtime.settings import Settings  # noqa: E402
from kvbus.schemas.topics import Topics  # noqa: E402
from kvbus.simulator.fleet import Fleet, FleetConfig, ModelConfig  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replicas", type=int, default=8, help="engine streams E (default 8)")
    p.add_argument("--streams-per-bridge", type=int, default=1, help="streams per bridge process S (default 1)")
    p.add_argument("--rate", type=float, default=15000.0, help="engine events/s offered (default 15000)")
    p.add_argument("--seconds", type=float, default=10.0, help="seconds of load (default 10)")
    p.add_argument("--bridge-python", default=sys.executable, help="Python that runs the bridges (default this one)")
    p.add_argument("--bridge-cwd", default=str(REPO), help="directory the bridges run in (default this tree)")
    p.add_argument("--bridge-arg", action="append", default=[], help="extra kvbus bridge argument (repeatable)")
    p.add_argument("--seed", type=int, default=11)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from kvbus.infra.dev_topics import ensure_topics

    base = Settings.from_env()
    run_id = f"bridges{uuid.uuid4().hex[:8]}"
    topics = Topics(raw=f"{run_id}.raw", blocks=f"{run_id}.blocks", incomplete=f"{run_id}.incomplete",
                    dlq=f"{run_id}.dlq")
    settings = replace(base, topics=topics)
    ensure_topics(settings.bootstrap, [topics.raw, topics.dlq], settings.partitions, 1)
    port0 = free_port_block(2 * args.replicas)
    cfg = FleetConfig(replicas=args.replicas, base_port=port0, seed=args.seed, pregenerate=True,
                      schedule=((args.rate, args.seconds),), model=ModelConfig(clear_rate=0.0))
    fleet = Fleet(cfg).start()
    fleet.pregenerate(int(args.rate * args.seconds))
    streams = [{"endpoint": s.endpoint, "replay_endpoint": s.replay_endpoint, "replica": s.replica}
               for s in fleet.streams()]
    env = {**os.environ, **settings.to_env()}
    log_dir = Path(os.environ.get("KVBUS_STATE_DIR", REPO / ".infra")) / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    procs, ports = [], []
    per = max(1, args.streams_per_bridge)
    try:
        for b in range(0, len(streams), per):
            port = free_port()
            ports.append(port)
            group = streams[b:b + per]
            if per == 1:
                s = group[0]
                target = ["--endpoint", s["endpoint"], "--replay-endpoint", s["replay_endpoint"],
                          "--replica", s["replica"]]
            else:
                path = log_dir / f"{run_id}-bridge-{b // per}-streams.json"
                path.write_text(json.dumps(group))
                target = ["--streams", str(path)]
            out = open(log_dir / f"{run_id}-bridge-{b // per}.log", "ab")
            procs.append(subprocess.Popen([args.bridge_python, "-m", "kvbus", "bridge", *target, "--metrics-port",
                                           str(port), *args.bridge_arg], cwd=args.bridge_cwd, env=env,
                                          stdout=out, stderr=subprocess.STDOUT))
        ok = wait_for(lambda: all(_ready(p) for p in ports), 120, 0.5)
        if not ok:
            raise SystemExit("bridges not ready in 120 s")
        time.sleep(2.0)  # subscriptions live (ZMQ's slow joiner)
        cpu0 = sum(cpu_seconds(p.pid) for p in procs)
        t0 = time.monotonic()
        events = 0
        period = 1.0 / args.rate
        next_step = t0
        while fleet._pregenerated:  # noqa: SLF001 - the benchmark plays what it pregenerated
            now = time.monotonic()
            if now < next_step:
                time.sleep(min(next_step - now, 0.05))
                continue
            n = fleet.publish_step()
            events += n
            next_step = max(next_step + period * n, now - 1.0)
        sent = time.monotonic() - t0
        acked = wait_for(lambda: sum(scrape(p, r"kvbus_bridge_events_acked_total") for p in ports) >= events,
                         120, 0.05)
        took = time.monotonic() - t0
        cpu = sum(cpu_seconds(p.pid) for p in procs) - cpu0
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
        fleet.stop()
    result = {"run": run_id, "streams": args.replicas, "streams_per_bridge": per, "bridges": len(procs),
              "rate": args.rate, "events": events, "sent_s": round(sent, 2), "acked_all": acked,
              "acked_s": round(took, 2), "bridge_cpu_s": round(cpu, 3),
              "bridge_us_per_event": round(cpu / max(events, 1) * 1e6, 2), "bridge_cwd": args.bridge_cwd,
              "bridge_args": args.bridge_arg}
    print(f"{args.replicas} streams, {len(procs)} bridge process(es) ({args.bridge_cwd}): {events} events "
          f"sent in {sent:.1f} s, all acknowledged: {acked} after {took:.1f} s; bridges' CPU {cpu:.2f} s = "
          f"{result['bridge_us_per_event']} µs/event", flush=True)
    print(json.dumps(result))
    return 0


def _ready(port: int) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=1) as r:
            return r.status == 200
    except OSError:
        return False


if __name__ == "__main__":
    sys.exit(main())
