"""Producer-side benchmarks (needs the real stack: Kafka + schema registry).

(a) **bridge**: events/s one bridge process sustains from ZMQ to *acknowledged* Kafka
    writes. A subprocess publishes realistic vLLM 0.33 batches (prompt stores with a
    Zipf-like token mix, one BlockRemoved per evicted hash) as fast as it can, with a
    replay ROUTER like vLLM's; this process runs the bridge (SUB -> decode -> sequencer ->
    Avro -> idempotent producer, acks=all) and counts acknowledged events over a window.
(b) **publisher**: CPU microseconds per event of the in-process ``KafkaEventPublisher``:
    ``time.process_time()`` (all threads, incl. librdkafka) and ``time.thread_time()``
    (the engine's calling thread) over many ``publish()`` calls, serialization and
    producer queueing included, delivery awaited at the end.

Prints the command line, the figures, and as the last line one JSON object.

    .venv/bin/python benchmarks/producer.py [--seconds 10] [--only bridge|publisher]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

import msgspec

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kvbus.children import free_port  # noqa: E402
from kvbus.runtime.settings import Settings  # noqa: E402
from kvbus.schemas.topics import Topics  # noqa: E402
from kvbus.simulator.vllm_shapes import (  # noqa: E402
    VllmBlockRemoved as BlockRemoved,
    VllmBlockStored as BlockStored,
    VllmKVEventBatch as KVEventBatch,
)

BLOCK = 16
VOCAB = 128_000


# -- workload --------------------------------------------------------------------------

def zipf_token(rng: random.Random) -> int:
    """A token id with a heavy head, like natural text."""
    return min(VOCAB - 1, int(rng.paretovariate(1.1)) - 1 + (rng.randrange(VOCAB) if rng.random() < 0.2 else 0))


def make_batches(n: int, events_per_batch: int = 40, seed: int = 1) -> list[KVEventBatch]:
    """Engine steps: ~40% BlockStored (1-4 blocks of 16 tokens, parent chained), ~60% one-hash
    BlockRemoved (vLLM evicts one hash per event) -- ~16 tokens per event on average."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        evs: list = []
        for i in range(events_per_batch):
            if rng.random() < 0.4:
                nb = rng.randint(1, 4)
                evs.append(BlockStored(
                    block_hashes=[rng.getrandbits(64) for _ in range(nb)],
                    parent_block_hash=rng.getrandbits(64) if rng.random() < 0.8 else None,
                    token_ids=[zipf_token(rng) for _ in range(BLOCK * nb)], block_size=BLOCK,
                    lora_id=None, medium="GPU", lora_name=None, group_idx=0, kv_cache_spec_kind="full_attention"))
            else:
                evs.append(BlockRemoved(block_hashes=[rng.getrandbits(64)], medium="GPU", group_idx=0))
        out.append(KVEventBatch(ts=time.time(), events=evs, data_parallel_rank=0))
    return out


# -- (a) publisher subprocess --------------------------------------------------------------

def engine_main(argv: list[str]) -> int:
    """Subprocess: publish pre-encoded batches at full speed on PUB, serve replays on ROUTER."""
    import zmq

    pub_ep, replay_ep, total, distinct = argv[0], argv[1], int(argv[2]), int(argv[3])
    enc = msgspec.msgpack.Encoder()
    payloads = [enc.encode(b) for b in make_batches(distinct)]
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.SNDHWM, 0)  # never drop: the whole run fits in memory
    pub.bind(pub_ep)
    router = ctx.socket(zmq.ROUTER)
    router.bind(replay_ep)
    buffer: list[tuple[int, bytes]] = []
    time.sleep(1.0)  # let the bridge's SUB connect
    t0 = time.perf_counter()
    for seq in range(total):
        p = payloads[seq % distinct]
        pub.send_multipart([b"", seq.to_bytes(8, "big"), p], copy=False)
        buffer.append((seq, p))
        if len(buffer) > 10_000:
            del buffer[:1000]
        if seq % 64 == 0:
            while router.poll(0):
                ident, _, start = router.recv_multipart()
                s0 = int.from_bytes(start, "big")
                for s, pl in buffer:
                    if s >= s0:
                        router.send_multipart([ident, b"", b"", s.to_bytes(8, "big"), pl])
                router.send_multipart([ident, b"", b"", b"\xff" * 8, b""])
    sent_s = time.perf_counter() - t0
    print(json.dumps({"sent_batches": total, "send_seconds": round(sent_s, 3)}), flush=True)
    end = time.monotonic() + 120
    while time.monotonic() < end:  # keep serving replays until killed
        if router.poll(100):
            ident, _, start = router.recv_multipart()
            s0 = int.from_bytes(start, "big")
            for s, pl in buffer:
                if s >= s0:
                    router.send_multipart([ident, b"", b"", s.to_bytes(8, "big"), pl])
            router.send_multipart([ident, b"", b"", b"\xff" * 8, b""])
    return 0




def bench_bridge(settings: Settings, seconds: float, warmup: float = 2.0) -> dict[str, Any]:
    """(a): acknowledged events/s through one bridge."""
    from kvbus.producers.bridge import Bridge, BridgeConfig
    from kvbus.producers.metrics import BridgeMetrics
    from kvbus.producers.raw_producer import RawProducer
    from kvbus.schemas.codec import FastSerde
    from kvbus.schemas.serde import RecordSerde, registry_client

    topics = settings.topics
    registry = registry_client(settings)
    fast = FastSerde(registry, "EventBatch")
    fast.header(topics.raw)  # registers the schema before the clock starts
    dl = RecordSerde(registry, "DeadLetter")
    metrics = BridgeMetrics()
    sink = RawProducer.build(settings.bootstrap, topics.raw, topics.dlq, lambda b: fast.dumps(b, topics.raw),
                           lambda d: dl.dumps(d, topics.dlq), metrics)
    p1, p2 = free_port(), free_port()
    cfg = BridgeConfig(endpoint=f"tcp://127.0.0.1:{p1}", replica="bench-0",
                       replay_endpoint=f"tcp://127.0.0.1:{p2}", engine="vllm", rcvhwm=0)
    bridge = Bridge(cfg, sink, metrics)
    bridge.open()
    # enough batches that the publisher is still going when the window closes
    total = int(max(seconds + warmup + 5, 10) * 250_000 / 40)
    engine = subprocess.Popen([sys.executable, __file__, "--engine", cfg.endpoint, cfg.replay_endpoint or "",
                               str(total), "500"], stdout=subprocess.PIPE, cwd=str(REPO))
    samples: list[tuple[float, float, float, float]] = []  # (wall, process cpu, main-thread cpu, acked events)
    start = time.monotonic()
    try:
        while time.monotonic() - start < 60:
            bridge.step(poll_ms=5)
            if metrics.value("events_acked") > 0:
                break
        else:
            raise RuntimeError("bridge: no event acknowledged by Kafka within 60 s of the engine's start")
        t_first = time.monotonic()
        next_sample = t_first + warmup
        end = t_first + warmup + seconds
        while True:
            bridge.step(poll_ms=5)
            now = time.monotonic()
            if now >= next_sample:
                samples.append((now, time.process_time(), time.thread_time(), metrics.value("events_acked")))
                next_sample = now + 0.5
                # two samples at least: on a loaded machine one step can outlast the whole window
                # (a rate from one sample divided by zero)
                if now >= end and len(samples) >= 2:
                    break
    finally:
        engine.kill()
        engine.wait()
        bridge.close(10)
    (w0, c0, t0, e0), (w1, c1, t1, e1) = samples[0], samples[-1]
    rate = (e1 - e0) / (w1 - w0)
    thread_us = (t1 - t0) / max(1.0, e1 - e0) * 1e6
    return {
        "bridge_events_per_s": round(rate),
        "bridge_batches_per_s": round(rate / 40),
        "bridge_cpu_us_per_event": round((c1 - c0) / max(1.0, e1 - e0) * 1e6, 2),
        "bridge_main_thread_cpu_us_per_event": round(thread_us, 2),
        "bridge_main_thread_capacity_events_per_s": round(1e6 / thread_us) if thread_us else None,
        "bridge_window_s": round(w1 - w0, 1),
        "bridge_resets": metrics.value("resets"),
        "bridge_gaps": metrics.value("gaps"),
        "bridge_delivery_errors": metrics.value("delivery_errors"),
    }


# -- (b) in-process publisher ------------------------------------------------------------------

def bench_publisher(settings: Settings, batches: int = 4000) -> dict[str, Any]:
    """(b): CPU µs per event of KafkaEventPublisher.publish()."""
    from kvbus.producers.publisher import KafkaEventPublisher

    data = make_batches(500, seed=2)
    pub = KafkaEventPublisher(0, replica="bench-pub", settings=settings)
    for b in data:  # warm-up: lookup tables, registry, connections
        pub.publish(b)
    pub.flush(30)
    n_events = 0
    c0, t0, w0 = time.process_time(), time.thread_time(), time.perf_counter()
    for i in range(batches):
        b = data[i % len(data)]
        pub.publish(b)
        n_events += len(b.events)
    t1 = time.thread_time()
    left = pub.flush(60)
    c1, w1 = time.process_time(), time.perf_counter()
    pub.shutdown()
    return {
        "publisher_cpu_us_per_event": round((c1 - c0) / n_events * 1e6, 3),
        "publisher_thread_cpu_us_per_event": round((t1 - t0) / n_events * 1e6, 3),
        "publisher_events": n_events,
        "publisher_events_per_s_wall": round(n_events / (w1 - w0)),
        "publisher_undelivered": left,
    }


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--engine":
        return engine_main(sys.argv[2:])
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=10.0, help="measurement window of (a)")
    p.add_argument("--batches", type=int, default=4000, help="publish() calls of (b) (40 events each)")
    p.add_argument("--only", choices=("bridge", "publisher"), default=None)
    args = p.parse_args()
    python = os.path.relpath(sys.executable, REPO) if sys.executable.startswith(str(REPO)) else sys.executable
    print("command:", " ".join([python, *sys.argv]), flush=True)
    import logging

    logging.basicConfig(level=logging.INFO if os.environ.get("BENCH_DEBUG") else logging.WARNING)
    from kvbus.infra.dev_topics import ensure_topics

    base = Settings.from_env()
    sfx = uuid.uuid4().hex[:8]
    topics = Topics(raw=f"bench{sfx}.raw", blocks=f"bench{sfx}.blocks", incomplete=f"bench{sfx}.incomplete",
                    dlq=f"bench{sfx}.dlq")
    ensure_topics(base.bootstrap, [topics.raw, topics.dlq], base.partitions, 1)
    settings = replace(base, topics=topics)
    results: dict[str, Any] = {"cpus": os.cpu_count()}
    try:
        run_benchmarks(args, settings, results)
    finally:
        _delete_topics(base.bootstrap, [topics.raw, topics.dlq])
    results["targets"] = {"bridge_events_per_s": 200_000, "publisher_cpu_us_per_event": 2.0}
    print(json.dumps(results))
    return 0


def _delete_topics(bootstrap: str, names: list[str]) -> None:
    """Remove this run's topics (they hold only benchmark data)."""
    from confluent_kafka.admin import AdminClient

    for fut in AdminClient({"bootstrap.servers": bootstrap}).delete_topics(names, operation_timeout=30).values():
        try:
            fut.result()
        except Exception:  # noqa: BLE001 - best effort
            pass


def run_benchmarks(args: argparse.Namespace, settings: Settings, results: dict[str, Any]) -> None:
    """Run (a) and/or (b), printing each figure as it comes."""
    if args.only in (None, "bridge"):
        r = bench_bridge(settings, args.seconds)
        print(f"(a) bridge ZMQ -> acked Kafka: {r['bridge_events_per_s']:,} events/s "
              f"({r['bridge_batches_per_s']:,} batches/s of 40 events), {r['bridge_cpu_us_per_event']} µs CPU/event "
              f"in the bridge process (all threads; {r['bridge_main_thread_cpu_us_per_event']} µs in its main thread = "
              f"{r['bridge_main_thread_capacity_events_per_s']:,} events/s on a free core), "
              f"window {r['bridge_window_s']} s, "
              f"resets {r['bridge_resets']:.0f}",
              flush=True)
        results.update(r)
    if args.only in (None, "publisher"):
        r = bench_publisher(settings, args.batches)
        print(f"(b) in-process publisher: {r['publisher_cpu_us_per_event']} µs CPU/event (process, incl. librdkafka "
              f"threads), {r['publisher_thread_cpu_us_per_event']} µs in the calling thread, "
              f"{r['publisher_events']:,} events, undelivered {r['publisher_undelivered']}", flush=True)
        results.update(r)


if __name__ == "__main__":
    sys.exit(main())
