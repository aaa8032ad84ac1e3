"""Micro-benchmark of the Avro codec's two paths (kvbus.schemas.codec): the generated Python run by
``exec`` (the reference) and its compiled build (kvbus.schemas.codec_build, made by ``./dev setup``).
No stack: a mock schema registry, one core, CPU time of this process.

Per event, best of ``--repeats`` timed passes over the same records:

* **sink decode**: ``FastSerde(registry, "BlockEvents").loads`` of block layout 2 records (``--packed-events``
  events each, the event mix of benchmarks/sink.py), as ``kvbus sink`` decodes them;
* **bridge encode**: ``FastSerde(registry, "EventBatch").dumps`` of the EventBatch the bridge makes from a
  vLLM batch (benchmarks/producer.py's engine steps, msgpack decoded by ``decode_batch`` beforehand, not timed);
* **publisher encode**: ``encode_engine_events`` + ``batch_from_head`` of the in-process publisher (engine
  event objects to an EventBatch value, through the codec's positional writers);
* **worker scan**: the worker's reading of those EventBatch values (``batch_scanner``: block events kept
  as their bytes, kvbus.streams.record_values).

Each path runs in a child process (``KVBUS_COMPILED_CODEC=0`` / ``1``), as a kvbus process would run it.
Prints the figures and the compiled-over-reference ratios, and as the last line one JSON object.

    .venv/bin/python benchmarks/codec.py [--events 40000] [--repeats 5]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

TOPIC = "bench.codec"
FIGURES = ("sink_decode_us_per_event", "bridge_encode_us_per_event", "publisher_encode_us_per_event",
           "worker_scan_us_per_event")


def best_pass(run: Callable[[], None], repeats: int) -> float:
    """Seconds of the fastest of ``repeats`` calls of ``run`` (CPU time of this process)."""
    best = float("inf")
    for _ in range(repeats):
        t = time.process_time()
        run()
        best = min(best, time.process_time() - t)
    return best


def sink_decode(n_events: int, per_record: int, repeats: int) -> float:
    """µs per event of the sink's decoding of BlockEvents records."""
    from kvbus.schemas.codec import FastSerde
    from kvbus.schemas.serde import registry_client
    from sink import event_stream, packed

    records = packed(event_stream(n_events, 64, seed=3), per_record)
    serde = FastSerde(registry_client("mock://bench-codec"), "BlockEvents")
    blobs = [serde.dumps(r, TOPIC) for r in records]
    events = sum(len(r.events) for r in records)
    assert [serde.loads(b, TOPIC) for b in blobs[:100]] == records[:100]
    loads = serde.loads

    def run() -> None:  # each value dropped once decoded, as the sink does after applying it
        for b in blobs:
            loads(b, TOPIC)

    return best_pass(run, repeats) / events * 1e6


def worker_scan(n_events: int, repeats: int) -> float:
    """µs per event of the worker's reading of the bridge's EventBatch values (block events kept as bytes)."""
    from kvbus.schemas.codec import FastSerde, batch_scanner
    from kvbus.schemas.serde import registry_client
    from kvbus.streams.raw_event import RawEvent
    from kvbus.streams.record_values import SharedEvents

    registry = registry_client("mock://bench-codec")
    batches = bridge_batches(n_events)
    blobs = [FastSerde(registry, "EventBatch").dumps(b, TOPIC) for b in batches]
    events = sum(len(b.events) for b in batches)
    loads = FastSerde(registry, "EventBatch", reader=batch_scanner(RawEvent, SharedEvents())).loads

    def run() -> None:
        for b in blobs:
            loads(b, TOPIC)

    return best_pass(run, repeats) / events * 1e6


def engine_batches(n_events: int) -> list:
    """vLLM batches of ~40 events (benchmarks/producer.py's engine steps)."""
    from producer import make_batches

    return make_batches(max(1, n_events // 40))


def bridge_batches(n_events: int) -> list:
    """The EventBatch structs a bridge makes of vLLM batches (msgpack decoded by ``decode_batch``)."""
    import msgspec

    from kvbus.producers.decode import decode_batch
    from kvbus.schemas.events import EventBatch

    enc = msgspec.msgpack.Encoder()
    batches = []
    for seq, b in enumerate(engine_batches(n_events)):
        d = decode_batch(enc.encode(b), "auto", skip_unknown=True, keep_tokens=False)
        batches.append(EventBatch(replica="pod-a", seq=seq, ts=d.ts, events=d.events, dp_rank=0, worker_rank=0,
                                  workers=1, engine="vllm", epoch=1_765_000_000_000, topic="kv-events",
                                  model="Qwen/Qwen3-8B"))
    return batches


def bridge_encode(n_events: int, repeats: int) -> float:
    """µs per event of the bridge's encoding of the EventBatch made from a vLLM batch."""
    from kvbus.schemas.codec import FastSerde
    from kvbus.schemas.serde import registry_client

    batches = bridge_batches(n_events)
    events = sum(len(b.events) for b in batches)
    dumps = FastSerde(registry_client("mock://bench-codec"), "EventBatch").dumps

    def run() -> None:
        for b in batches:
            dumps(b, TOPIC)

    return best_pass(run, repeats) / events * 1e6


def publisher_encode(n_events: int, repeats: int) -> float:
    """µs per event of the in-process publisher's encoding of vLLM event objects."""
    from kvbus.producers.publisher import encode_engine_events
    from kvbus.schemas.codec import batch_from_head, batch_head

    batches = engine_batches(n_events)
    events = sum(len(b.events) for b in batches)
    head = b"\x00\x00\x00\x00\x01" + batch_head("pod-a", 0, 0, 1, "kvbus", "Qwen/Qwen3-8B")

    def run() -> None:
        for seq, b in enumerate(batches):
            batch_from_head(head, 1_765_000_000_000, seq, b.ts, "kv-events", encode_engine_events(b.events, False))

    return best_pass(run, repeats) / events * 1e6


def child(args: argparse.Namespace) -> dict[str, Any]:
    """The figures of this process's codec path."""
    from kvbus.schemas.codec import CODEC

    return {"compiled": CODEC.compiled, "path": CODEC.path,
            "sink_decode_us_per_event": round(sink_decode(args.events, args.packed_events, args.repeats), 3),
            "bridge_encode_us_per_event": round(bridge_encode(args.events, args.repeats), 3),
            "publisher_encode_us_per_event": round(publisher_encode(args.events, args.repeats), 3),
            "worker_scan_us_per_event": round(worker_scan(args.events, args.repeats), 3)}


def run_path(compiled: bool, argv: list[str]) -> dict[str, Any]:
    """Run this benchmark's child with the codec path ``compiled`` (or the reference) and return its figures."""
    env = {**os.environ, "KVBUS_COMPILED_CODEC": "1" if compiled else "0"}
    out = subprocess.run([sys.executable, __file__, "--child", *argv], env=env, capture_output=True, text=True,
                         check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, default=40_000, help="events per measured pass (default 40,000)")
    ap.add_argument("--packed-events", type=int, default=20, help="events per BlockEvents record (default 20)")
    ap.add_argument("--repeats", type=int, default=5, help="timed passes; the fastest counts (default 5)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return 0
    print("command:", " ".join([sys.executable, *sys.argv]), flush=True)
    passed = ["--events", str(args.events), "--packed-events", str(args.packed_events), "--repeats", str(args.repeats)]
    reference, compiled = run_path(False, passed), run_path(True, passed)
    result: dict[str, Any] = {"events": args.events, "packed_events": args.packed_events, "repeats": args.repeats,
                              "compiled_path": compiled["path"], "reference": {}, "compiled": {}, "ratio": {}}
    if not compiled["compiled"]:
        print(f"no compiled codec ({compiled['path']}): both runs are the reference path", flush=True)
    for name in FIGURES:
        ref, com = reference[name], compiled[name]
        result["reference"][name], result["compiled"][name] = ref, com
        result["ratio"][name] = round(com / ref, 3)
        print(f"{name}: reference {ref:.3f} us, compiled {com:.3f} us, compiled/reference {com / ref:.3f}",
              flush=True)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
