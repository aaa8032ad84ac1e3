"""``kvbus serve`` over HTTP against the direct ``FCALL_RO`` (kvbus.client), on a 10 M-entry view of 256 replicas.

    .venv/bin/python benchmarks/serve.py                     # 10 M entries, 256 replicas, 128-block chains
    .venv/bin/python benchmarks/serve.py --entries 1000000 --queries 500 --seconds 5

What it does, in one run on one throw-away ``redis-server`` (``kvbus.infra.scratch_redis``, ``--maxmemory 4gb``):

1. builds the view as benchmarks/lookup.py does (:mod:`benchmarks.fleet_view`: the fleet workload of
   ``--entries`` (replica, block, tier) entries loaded through ``RedisStore.apply``, the sink's write
   path), plus ``--token-prompts`` prompts of ``--chain`` blocks of 16 token ids, hashed as vLLM does
   (sha256, PYTHONHASHSEED=0) and stored on 2 random replicas each, so that ``/query`` by token ids finds
   its holders;
2. for each ``--threads`` value (default ``8,0``: lookups on a thread pool, and on the event loop),
   starts a real ``kvbus serve --tie-break name`` process on a free port and waits for ``/readyz``;
3. **latency**: for each query set, alternates one direct lookup (``ViewClient.lookup``: one
   ``FCALL_RO`` and the client's decoding) with one HTTP request for the same prompt over a kept-alive
   connection (request sent, answer read and JSON-decoded), sequentially, and checks that the HTTP
   answer equals the direct one folded into the API's shape (:func:`kvbus.serve.query.answer`). Sets:
   ``private`` (a conversation body, 1-2 holders; ``/query_by_hash``), ``shared`` (a conversation with
   its system prompt, ~all replicas hold a prefix: the largest answers; ``/query_by_hash``),
   ``tokens`` (``/query`` with ``--chain`` x 16 token ids against ``lookup(tokens=...)``: both hash);
4. **throughput**: ``--concurrency`` concurrent aiohttp clients in this process send the private set to
   ``/query_by_hash`` for ``--seconds`` (at most ``--max-requests``); requests/s, and requests per CPU
   second of the ``kvbus serve`` process (``/proc/<pid>/stat``: its user + system time, every
   thread) = **requests/s per core**, with Redis's main-thread CPU per request; the direct client's
   lookups per CPU second of this process (``time.process_time``) are the baseline.

The last line printed is one JSON object with the figures.
"""
from __future__ import annotations

import argparse
import asyncio
import http.client
import itertools
import json
import os
import platform
import random
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.fleet_view import load_kvbus, pct, queries, used_memory  # noqa: E402
from kvbus.children import free_port  # noqa: E402
from kvbus.client import BY_NAME, ViewClient  # noqa: E402
from kvbus.infra.scratch_redis import RedisServer, main_thread_cpu  # noqa: E402
from kvbus.schemas.hashing import block_hashes  # noqa: E402
from kvbus.serve.query import Query, answer  # noqa: E402
from kvbus.simulator.view_workload import FleetStore, fleet_workload  # noqa: E402
from kvbus.sinks.view.redis_store import RedisStore  # noqa: E402

PREFIX = "kvbus:"
BLOCK = 16
SEED = "0"
MODEL = "m"
"""The model the fleet's bridges name (its events carry it) and every request names."""
CLK_TCK = os.sysconf("SC_CLK_TCK")


def machine() -> dict:
    """The hardware the figures come from."""
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor())
    mem = next(int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
               if line.startswith("MemTotal"))
    return {"cpus": os.cpu_count(), "cpu": model, "memory_gib": round(mem / 2**20, 1),
            "python": platform.python_version()}


def proc_cpu(pid: int) -> float:
    """CPU seconds (user + system, all threads) process ``pid`` has used."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def token_prompts(n: int, blocks: int, replicas: int, seed: int) -> tuple[list[list[int]], list[FleetStore]]:
    """``n`` prompts of ``blocks`` x 16 token ids and their stores: each prompt's vLLM hashes (sha256,
    PYTHONHASHSEED=0) on GPU of 2 random replicas."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(200_000) for _ in range(blocks * BLOCK)] for _ in range(n)]
    stores = [FleetStore(r, "GPU", block_hashes(p, BLOCK, "sha256", seed=SEED))
              for p in prompts for r in rng.sample(range(replicas), 2)]
    return prompts, stores


# ---------------------------------------------------------------------------------------- the server


class Server:
    """A ``kvbus serve`` process on a free port over the benchmark's Redis."""

    def __init__(self, redis_url: str, threads: int, log: Path):
        self.port = free_port()
        env = {**os.environ, "KVBUS_REDIS_URL": redis_url, "KVBUS_LOG_FORMAT": "text"}
        self.log = open(log, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvbus", "serve", "--host", "127.0.0.1", "--port", str(self.port), "--prefix",
             PREFIX, "--algo", "sha256", "--hash-seed", SEED, "--threads", str(threads), "--tie-break", "name"],
            env=env, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        last = None
        while True:
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
                conn.request("GET", "/readyz")
                if conn.getresponse().status == 200:
                    conn.close()
                    return
                last = "503"
            except OSError as e:
                last = repr(e)
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"kvbus serve did not get ready on :{self.port} within 60 s (last: {last}); "
                                   f"see {log}")
            time.sleep(0.1)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


# ---------------------------------------------------------------------------------------- measurements


def latency(server: Server, view: ViewClient, kind: str, sample: list, chain: int) -> dict:
    """Direct lookups and HTTP requests for the same prompts, alternating, answers compared."""
    by_hash = kind != "tokens"
    path = "/query_by_hash" if by_hash else "/query"
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    headers = {"Content-Type": "application/json"}
    direct, over_http, instances, differ = [], [], [], 0
    for prompt in sample:
        if by_hash:
            ints = [int.from_bytes(h, "big") for h in prompt]
            body = json.dumps({"model": MODEL, "block_size": BLOCK, "seq_hashes": ints}).encode()
            q = Query(model=MODEL, tenant="default", block_size=BLOCK, hashes=ints)
            ask = lambda: view.lookup(hashes=ints, model=MODEL)  # noqa: E731
        else:
            body = json.dumps({"model": MODEL, "block_size": BLOCK, "token_ids": prompt}).encode()
            q = Query(model=MODEL, tenant="default", block_size=BLOCK, tokens=prompt)
            ask = lambda: view.lookup(tokens=prompt, block_size=BLOCK, algo="sha256", seed=SEED,  # noqa: E731
                                      model=MODEL)
        t = time.perf_counter()
        holders = ask()
        direct.append(time.perf_counter() - t)
        t = time.perf_counter()
        conn.request("POST", path, body, headers)
        resp = conn.getresponse()
        got = json.loads(resp.read())
        over_http.append(time.perf_counter() - t)
        assert resp.status == 200, got
        differ += got != answer(q, holders)
        instances.append(len(got["default"]))
    conn.close()
    out = {
        "queries": len(sample), "path": path, "instances_per_answer": round(sum(instances) / len(instances), 1),
        "direct": {"p50_ms": round(pct(direct, 0.5) * 1e3, 3), "p99_ms": round(pct(direct, 0.99) * 1e3, 3)},
        "http": {"p50_ms": round(pct(over_http, 0.5) * 1e3, 3), "p99_ms": round(pct(over_http, 0.99) * 1e3, 3)},
        "answers_differ": differ,
    }
    out["http_over_direct"] = {k: round(out["http"][k] / out["direct"][k], 2) for k in ("p50_ms", "p99_ms")}
    print(f"  {kind} ({out['instances_per_answer']} instances per answer): direct {out['direct']}, "
          f"HTTP {out['http']}; answers that differ: {differ}", flush=True)
    return out


async def _load(port: int, bodies: list[bytes], concurrency: int, seconds: float, cap: int) -> tuple[int, int, float]:
    import aiohttp

    url = f"http://127.0.0.1:{port}/query_by_hash"
    headers = {"Content-Type": "application/json"}
    sent = errors = 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as session:
        deadline = time.monotonic() + seconds

        async def client(i: int) -> None:
            nonlocal sent, errors
            j = i
            while time.monotonic() < deadline and sent < cap:
                sent += 1
                async with session.post(url, data=bodies[j % len(bodies)], headers=headers) as resp:
                    await resp.read()
                    errors += resp.status != 200
                j += concurrency

        t0 = time.monotonic()
        await asyncio.gather(*(client(i) for i in range(concurrency)))
        return sent, errors, time.monotonic() - t0


def throughput(server: Server, r, sample: list, args) -> dict:
    """Concurrent requests for ``--seconds``: requests/s, and per CPU second of the server (per core)."""
    bodies = [json.dumps({"model": MODEL, "block_size": BLOCK, "seq_hashes": [int.from_bytes(h, "big") for h in q]}
                         ).encode() for q in sample]
    cpu0, rcpu0 = proc_cpu(server.proc.pid), main_thread_cpu(r)
    sent, errors, wall = asyncio.run(_load(server.port, bodies, args.concurrency, args.seconds, args.max_requests))
    cpu, rcpu = proc_cpu(server.proc.pid) - cpu0, main_thread_cpu(r) - rcpu0
    out = {"concurrency": args.concurrency, "requests": sent, "errors": errors, "seconds": round(wall, 2),
           "requests_per_s": round(sent / wall), "server_cpu_cores": round(cpu / wall, 2),
           "requests_per_s_per_core": round(sent / cpu) if cpu else None,
           "redis_cpu_us_per_request": round(rcpu / sent * 1e6, 1)}
    print(f"  throughput: {out}", flush=True)
    return out


def direct_throughput(view: ViewClient, r, sample: list) -> dict:
    """The client library's sequential lookups per CPU second of this process (the baseline per core)."""
    ints = [[int.from_bytes(h, "big") for h in q] for q in sample]
    cpu0, rcpu0, t0 = time.process_time(), main_thread_cpu(r), time.perf_counter()
    for q in ints:
        view.lookup(hashes=q, model=MODEL)
    cpu, rcpu, wall = time.process_time() - cpu0, main_thread_cpu(r) - rcpu0, time.perf_counter() - t0
    out = {"lookups": len(ints), "lookups_per_s": round(len(ints) / wall),
           "lookups_per_s_per_core": round(len(ints) / cpu) if cpu else None,
           "redis_cpu_us_per_lookup": round(rcpu / len(ints) * 1e6, 1)}
    print(f"direct client, sequential: {out}", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--entries", type=int, default=10_000_000, help="(replica, block, tier) entries to load")
    ap.add_argument("--replicas", type=int, default=256)
    ap.add_argument("--chain", type=int, default=128, help="blocks per lookup chain")
    ap.add_argument("--queries", type=int, default=2000, help="lookups per set and mode, for the latencies")
    ap.add_argument("--token-prompts", type=int, default=200, help="prompts of token ids stored on the view")
    ap.add_argument("--threads", default="8,0", help="kvbus serve --threads values to measure, comma-separated")
    ap.add_argument("--concurrency", type=int, default=16, help="concurrent HTTP clients for the throughput")
    ap.add_argument("--seconds", type=float, default=10.0, help="seconds of the throughput run per mode")
    ap.add_argument("--max-requests", type=int, default=200_000, help="at most this many throughput requests")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--maxmemory", default="4gb")
    ap.add_argument("--log-dir", default="/tmp", help="where the kvbus serve processes log")
    args = ap.parse_args(argv)

    result: dict = {"machine": machine(), "entries": None, "replicas": args.replicas, "chain": args.chain,
                    "block_size": BLOCK}
    with RedisServer(["--maxmemory", args.maxmemory, "--maxmemory-policy", "noeviction"]) as srv:
        r = srv.client()
        stores, chains, bodies = fleet_workload(args.entries, replicas=args.replicas, cpu_frac=0.5, seed=args.seed,
                                                min_chain=args.chain)
        prompts, prompt_stores = token_prompts(args.token_prompts, args.chain, args.replicas, args.seed)
        n, secs = load_kvbus(RedisStore(r, PREFIX), itertools.chain(stores, prompt_stores), model=MODEL)
        result["entries"] = n
        print(f"view: {n:,} entries loaded in {secs:.1f}s, Redis used_memory {used_memory(r) / 2**20:,.0f} MiB",
              flush=True)
        sets = {"private": queries(bodies, args.queries, args.chain),
                "shared": queries(chains, args.queries, args.chain),
                "tokens": [prompts[i % len(prompts)] for i in range(args.queries)]}
        with ViewClient(srv.url, PREFIX, tie_break=BY_NAME) as view:
            view.lookup(hashes=[1])  # names cached, connection open
            result["direct_client"] = direct_throughput(view, r, sets["private"])
            for threads in (int(t) for t in args.threads.split(",")):
                print(f"kvbus serve --threads {threads}:", flush=True)
                server = Server(srv.url, threads, Path(args.log_dir) / f"kvbus-serve-bench-{threads}.log")
                try:
                    mode: dict = {kind: latency(server, view, kind, sample, args.chain)
                                  for kind, sample in sets.items()}
                    mode["throughput"] = throughput(server, r, sets["private"], args)
                finally:
                    server.stop()
                result[f"threads_{threads}"] = mode
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
