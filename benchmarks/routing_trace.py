"""Trace mode of ``benchmarks/routing.py`` (``--trace FILE``): a Mooncake-format trace replayed through
simulated vLLM engines, routed by kvbus's view, an oracle, an approximate prefix tree, by load and
round-robin, every router deciding with :func:`kvbus.client.routing.choose`.

    .venv/bin/python benchmarks/routing.py --trace ../shared/data/mooncake-fast25/conversation_trace.jsonl

**Requests.** Each trace line (``timestamp`` ms, ``input_length``, ``output_length``, ``hash_ids`` of
512-token blocks) is one request, played at ``timestamp / --speedup`` after the start (the first
``--requests`` lines). A 512-token id becomes 512 token ids drawn from a hash of the id
(:func:`id_tokens`: the same id, the same tokens), i.e. 32 engine blocks of 16 tokens with vLLM's
sha256 block hashes; equal ids give equal hashes and a prompt that starts with another's ids starts
with its blocks. The prompt is the first ``input_length`` tokens (the last id may be partial; only full
16-token blocks are cached). Replies are not cached (the trace gives no ids for them).

**Engines.** ``--replicas`` (default 8) simulated vLLM engines per router
(:class:`kvbus.simulator.fleet.CacheModel`, GPU prefix cache of ``--gpu-blocks`` blocks, LRU). The
default, 26,000 blocks of 16 tokens (416k tokens), is what one 80 GB H100 holds for Llama-3-8B in bf16:
0.9 x 80 GB - 16 GB of weights = 56 GB over 128 KiB of KV per token (32 layers x 8 KV heads x 128 x 2
x 2 bytes). Caches that size are finite and matter on this trace: an LRU holding 8 x 26,000 blocks
keeps 15 % of the first 1,500 requests' prompt blocks reusable against 26.5 % with no limit (computed
on the trace's ids, one global cache).

**Service time.** Per engine, requests wait FCFS for prefill; prefill takes ``--prefill-us`` per
uncached prompt token; TTFT estimate = the wait + that prefill. Decode then takes ``--decode-ms`` per
output token (continuous batching: decodes overlap, so only prefill queues). A request is in flight from
routing until its decode ends; load = in-flight requests per replica. The service model runs in trace
time (the trace's own seconds, not divided by the speed-up). Defaults are derived from public figures,
not measured: prefill, 2 FLOPs per parameter per token (the rule of thumb in
https://fergusfinn.com/blog/inference-arithmetic) = 16 GFLOP per token for 8B, on an H100 SXM
(989 dense bf16 TFLOPS, NVIDIA's data sheet) at 40 % MFU: 40 us per token (25,000 tokens/s);
decode, 16 GB of weights read per step at 3.35 TB/s = 4.8 ms, x2.5 for KV reads and scheduling at
moderate batch: 12 ms per output token, of the order of the time per output token vLLM's v0.6.0
performance update (https://blog.vllm.ai/2024/09/05/perf-update.html) shows for Llama 8B on one H100.

**Publishing.** The kvbus lanes' engines publish a request's events when it is routed, or with
``--publish-at prefill-end`` when its prefill ends in trace time (as a real engine stores computed
blocks). Before the first request each engine publishes one probe, waited for in the view
(:func:`announce`): predictions are recorded only for holders the view knows.

**Routers**, each on engines of its own, all replaying the same requests, all deciding with
:func:`~kvbus.client.routing.choose` (``--beta``):

- ``oracle``: matched prefix from its engines' own caches (instant truth);
- ``kvbus``: matched prefix from the real view (one :meth:`ViewClient.lookup` per request among its
  replicas); its engines publish every batch through bridges -> Kafka -> worker -> sink -> Redis
  (``benchmarks/pipeline.py``'s processes, fresh topics and prefix), one bridge per fleet;
- ``kvbus_predicted``: kvbus, plus after each decision :meth:`ViewClient.predict` of the prompt's chain on
  the chosen replica (``--predict-ttl`` s) and lookups with ``predicted=--predicted-weight``, choosing by
  the reply's score (held blocks weigh 1, predicted ones the weight); a published fleet of its own;
- ``approximate``: the router's own record of which prefixes it sent where (:class:`SentPrefixes`, no
  events, LRU-bounded to ``--approx-blocks`` hashes), as vllm-router's cache-aware policy keeps one;
- ``least_loaded``: load only; ``round_robin``: the next replica in turn.

``--routers 1,4``: each count N is N router instances splitting the requests round-robin. Without
shared load each instance knows only the in-flight requests it sent itself; ``--shared-load`` adds, for
each N > 1, a run where every instance sees all in-flight requests. The kvbus routers (``kvbus``,
``kvbus_predicted``) use kvbus's own shared load (:class:`ViewLoad`): each instance has a
:class:`~kvbus.client.load.LoadReporter` (router ``<lane>#<i>``) on the view's Redis, reports
``started`` when it routes and ``finished`` when the request's decode ends in trace time (reported at the
first arrival after it: the sums a decision reads are the requests in flight at that trace time), and
decides with :meth:`ViewClient.lookup_with_load` (matched from the lookup, load from the sums) when load
is shared, with its reporter's own book when not. Leases (``--load-lease``, wall seconds) are renewed
by every report and every :data:`RENEW_EVERY` s. The routers without Redis (oracle, approximate,
least_loaded, round_robin) share an in-process stand-in (:class:`LoadBoard`) that counts the same
requests. ``--kinds`` plays only some router kinds (at least one kvbus kind).

**Figures** per router (and router count / shared load): reused prompt tokens (served from cache) and
their share of the oracle's with the same router setting, hit rate (requests that reused at least one
block; and beyond their first 512-token id, which nearly every request shares), TTFT p50 / p90 (trace
seconds), load imbalance (max / mean in-flight over the replicas, sampled at each arrival with any
request in flight, averaged); for kvbus the freshness p50 / p99 of probes
(wall-clock ms: at speed-up S a view lag of L ms is L x S ms of trace time, so kvbus is judged against a
pipeline S times slower than real); for kvbus_predicted the blocks its predictions recorded. ``targets``
checks issue 45's targets on the lanes run (:func:`targets`). Progress every few seconds on stderr; the
last stdout line is one JSON object with every figure.
"""
from __future__ import annotations

import argparse
import hashlib
import heapq
import json
import random
import sys
import time
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

import pipeline as pl  # noqa: E402  (benchmarks/pipeline.py, on sys.path through routing.py)
from kvbus.client import ViewClient
from kvbus.client.load import LoadReporter
from kvbus.client.routing import choose
from kvbus.schemas.events import Event
from kvbus.simulator.fleet import CacheModel, Fleet, FleetConfig, ModelConfig

TRACE_BLOCK = 512
"""Tokens per trace block id (Mooncake's traces)."""
BLOCK_SIZE = 16
VOCAB = 32_000
ROUTERS = ("oracle", "kvbus", "kvbus_predicted", "approximate", "least_loaded", "round_robin")
VIEW_ROUTERS = ("kvbus", "kvbus_predicted")
"""The routers that read the real view (each lane on a published fleet of its own)."""
SHARED_LOAD_NOTE = ("kvbus and kvbus_predicted share load through kvbus itself (a LoadReporter per router "
                    "instance on the view's Redis, decisions with ViewClient.lookup_with_load); oracle, "
                    "approximate, least_loaded and round_robin have no Redis and share an in-process stand-in "
                    "(LoadBoard) that counts the same in-flight requests")
RENEW_EVERY = 5.0
"""Wall seconds between lease renewals of every kvbus router instance (less than ``--load-lease``)."""
PROGRESS_EVERY = 5.0
"""Seconds between progress lines on stderr."""


# -- the trace -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TraceRequest:
    """One trace line."""

    at: float
    """Arrival, trace seconds from the start."""
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    """Its prompt's 512-token block ids, in order (the last may be partial)."""


def read_trace(path: Path, limit: Optional[int] = None) -> list[TraceRequest]:
    """The first ``limit`` requests of the Mooncake-format trace at ``path`` (None: all)."""
    out: list[TraceRequest] = []
    with open(path) as f:
        for line in f:
            if limit is not None and len(out) >= limit:
                break
            if line.strip():
                r = json.loads(line)
                out.append(TraceRequest(r["timestamp"] / 1000.0, int(r["input_length"]), int(r["output_length"]),
                                        tuple(r["hash_ids"])))
    return out


@lru_cache(maxsize=4096)
def id_tokens(block_id: int) -> tuple[int, ...]:
    """The 512 token ids of trace block ``block_id`` (1 .. VOCAB-1), from a hash of the id and the position:
    the same id always gives the same tokens, so equal ids give equal engine block hashes."""
    raw = hashlib.shake_128(f"mooncake-block:{block_id}".encode()).digest(2 * TRACE_BLOCK)
    return tuple(v % (VOCAB - 1) + 1 for v in array("H", raw))


def prompt_tokens(req: TraceRequest) -> list[int]:
    """The prompt of ``req``: its ids' tokens in order, cut at ``input_length``."""
    out: list[int] = []
    for i in req.hash_ids:
        out.extend(id_tokens(i))
    return out[:req.input_length]


# -- engines and their service time ---------------------------------------------------------------

@dataclass(frozen=True)
class ServiceModel:
    """Time an engine spends on a request, trace seconds."""

    prefill_s: float = 40e-6
    """Prefill time per uncached prompt token (module docstring: 40 us)."""
    decode_s: float = 12e-3
    """Decode time per output token (12 ms)."""


class Replica:
    """One engine's queue: prefill FCFS, decodes overlapping; in-flight requests by their end times."""

    def __init__(self) -> None:
        self.prefill_free_at = 0.0
        self.ends: list[float] = []

    def serve(self, t: float, uncached_tokens: int, output_tokens: int, svc: ServiceModel) -> tuple[float, float]:
        """A request arriving at ``t``: returns (its TTFT estimate, when its decode ends), trace seconds."""
        start = max(t, self.prefill_free_at)
        self.prefill_free_at = start + uncached_tokens * svc.prefill_s
        end = self.prefill_free_at + output_tokens * svc.decode_s
        heapq.heappush(self.ends, end)
        return self.prefill_free_at - t, end

    def in_flight(self, t: float) -> int:
        """Requests routed here still not finished at ``t``."""
        while self.ends and self.ends[0] <= t:
            heapq.heappop(self.ends)
        return len(self.ends)


def engine_config(gpu_blocks: int) -> ModelConfig:
    """GPU prefix cache only (no offload, no secondary tier, no resets), few prompts remembered."""
    return ModelConfig(block_size=BLOCK_SIZE, gpu_blocks=gpu_blocks, cpu_rate=0.0, kvcr_rate=0.0, clear_rate=0.0,
                       history=4)


# -- what a router knows -----------------------------------------------------------------------------

class LoadBoard:
    """In-flight requests per replica as the router instances that share this board see them (one board
    per instance: its own requests; one board for all: shared load): the in-process stand-in of the
    routers that have no Redis (oracle, approximate, least_loaded, round_robin); the kvbus routers use
    kvbus's shared load (:class:`ViewLoad`)."""

    def __init__(self, names: Sequence[str]) -> None:
        self.ends: dict[str, list[float]] = {n: [] for n in names}

    def add(self, replica: str, end: float) -> None:
        """A request sent to ``replica`` that stays in flight until ``end`` (trace seconds)."""
        heapq.heappush(self.ends[replica], end)

    def load(self, t: float) -> dict[str, int]:
        """Replica -> requests in flight at ``t``."""
        for h in self.ends.values():
            while h and h[0] <= t:
                heapq.heappop(h)
        return {n: len(h) for n, h in self.ends.items()}


class ViewLoad:
    """kvbus's real shared load for the router instances of one kvbus lane: one
    :class:`~kvbus.client.load.LoadReporter` each (router ``<lane>#<i>``) on the view's Redis. An instance
    reports ``started`` when it routes a request and ``finished`` when the request's decode ends in the
    benchmark's simulated time: :meth:`advance` to an arrival's trace time first reports every request of
    the lane that ended by then, so the sums a decision reads are the requests in flight at that trace
    time, whatever the wall clock. Leases are wall-clock seconds: every report renews its router's lease
    and :meth:`keepalive` renews all of them every :data:`RENEW_EVERY` s, so an instance idle for a while
    (a gap in the trace, a run behind schedule) keeps counting."""

    def __init__(self, client: ViewClient, lane: str, routers: int, lease: float) -> None:
        self.reporters = [LoadReporter(client, router=f"{lane}#{i}", lease=lease) for i in range(routers)]
        self.pending: list[tuple[float, int, int, str, int]] = []
        """(decode end, trace s; sequence; instance; replica; prompt tokens) of the requests in flight."""
        self.seq = 0
        self.renewed = time.monotonic()

    def advance(self, t: float) -> None:
        """Every request whose decode ended by trace time ``t``: ``finished`` by the instance that routed it."""
        while self.pending and self.pending[0][0] <= t:
            _, _, inst, replica, tokens = heapq.heappop(self.pending)
            self.reporters[inst].finished(replica, tokens)

    def started(self, inst: int, replica: str, tokens: int, end: float) -> None:
        """Instance ``inst`` routed a request of ``tokens`` prompt tokens to ``replica``, in flight until ``end``."""
        self.reporters[inst].started(replica, tokens)
        self.seq += 1
        heapq.heappush(self.pending, (end, self.seq, inst, replica, tokens))

    def own(self, inst: int) -> dict[str, int]:
        """Replica -> requests in flight that instance ``inst`` sent itself (its reporter's book)."""
        return {n: ld.requests for n, ld in self.reporters[inst].book.items()}

    def keepalive(self, now: float) -> None:
        """Renew every instance's lease when :data:`RENEW_EVERY` wall seconds passed since the last renewal."""
        if now - self.renewed >= RENEW_EVERY:
            self.renewed = now
            for r in self.reporters:
                r.renew()


class SentPrefixes:
    """A router's own record of which block hashes it sent to which replica (no events), LRU-bounded to
    ``capacity`` hashes: the approximate prefix tree of vllm-router's cache-aware policy."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.where: OrderedDict[bytes, set[str]] = OrderedDict()

    def matches(self, chain: Sequence[bytes]) -> dict[str, int]:
        """Replica -> leading blocks of ``chain`` this router sent it (as far as it remembers)."""
        out: dict[str, int] = {}
        alive: Optional[set[str]] = None
        for k, h in enumerate(chain):
            held = self.where.get(h)
            alive = set(held or ()) if alive is None else alive & (held or set())
            if not alive:
                break
            for n in alive:
                out[n] = k + 1
        return out

    def record(self, chain: Sequence[bytes], replica: str) -> None:
        """``chain`` was sent to ``replica``: remembered most recently, the oldest hashes forgotten."""
        for h in chain:
            s = self.where.get(h)
            if s is None:
                self.where[h] = {replica}
            else:
                s.add(replica)
                self.where.move_to_end(h)
        while len(self.where) > self.capacity:
            self.where.popitem(last=False)


# -- one router setting ------------------------------------------------------------------------------

@dataclass(frozen=True)
class LaneSpec:
    """A router kind with a router count and a load setting."""

    kind: str
    routers: int = 1
    shared: bool = False

    @property
    def key(self) -> str:
        """Its name in the output: ``kvbus``, ``kvbus/4r``, ``kvbus/4r/shared``."""
        return self.kind + (f"/{self.routers}r" if self.routers > 1 else "") + ("/shared" if self.shared else "")


@dataclass
class Tally:
    """What one lane achieved."""

    requests: int = 0
    prompt_tokens: int = 0
    reused_tokens: int = 0
    """Prompt tokens served from the chosen engine's prefix cache."""
    hits: int = 0
    """Requests that reused at least one block."""
    deep_hits: int = 0
    """Requests that reused more than their first trace block (512 tokens: nearly every request of the
    Mooncake trace starts with the same id, so one block is reused almost everywhere)."""
    ttft: list[float] = field(default_factory=list)
    """TTFT estimate of each request, trace seconds."""
    imbalance: list[float] = field(default_factory=list)
    """Max / mean in-flight over the replicas, at each arrival with any request in flight."""

    def figures(self) -> dict[str, float | int | None]:
        t = sorted(self.ttft)
        return {"requests": self.requests, "prompt_tokens": self.prompt_tokens, "reused_tokens": self.reused_tokens,
                "reused_share": round(self.reused_tokens / max(self.prompt_tokens, 1), 4),
                "hit_rate": round(self.hits / max(self.requests, 1), 4),
                "hit_rate_beyond_first_id": round(self.deep_hits / max(self.requests, 1), 4),
                "ttft_p50_s": round(pl.quantile(t, 0.5), 3) if t else None,
                "ttft_p90_s": round(pl.quantile(t, 0.9), 3) if t else None,
                "load_imbalance": round(sum(self.imbalance) / len(self.imbalance), 3) if self.imbalance else None}


class Lane:
    """One router setting on engines of its own: ``models`` (replica name -> cache), ``publish`` (None: in
    process; else sends a replica's events through the pipeline), ``view`` (the kvbus lanes' client of the
    real view: lookups, shared load, predictions)."""

    def __init__(self, spec: LaneSpec, models: dict[str, CacheModel], args: argparse.Namespace,
                 publish: Optional[Callable[[str, list[Event]], None]] = None,
                 view: Optional[ViewClient] = None) -> None:
        self.spec, self.models, self.publish, self.view = spec, models, publish, view
        self.names = list(models)
        self.replicas = {n: Replica() for n in self.names}
        shared = LoadBoard(self.names)
        self.boards = [shared if spec.shared else LoadBoard(self.names) for _ in range(spec.routers)]
        """The in-process stand-in's load (routers without Redis: every kind but kvbus's)."""
        self.view_load: Optional[ViewLoad] = None
        if spec.kind in VIEW_ROUTERS:
            assert view is not None, f"{spec.kind} needs the view"
            self.view_load = ViewLoad(view, spec.key, spec.routers, getattr(args, "load_lease", 30.0))
        self.predicted = spec.kind == "kvbus_predicted"
        self.predicted_weight = getattr(args, "predicted_weight", 1.0)
        self.predict_ttl = getattr(args, "predict_ttl", 5.0)
        self.predictions = 0
        """Blocks kvbus_predict recorded (0 for a holder the view did not know yet)."""
        self.publish_at_prefill_end = getattr(args, "publish_at", "route") == "prefill-end"
        self.outbox: list[tuple[float, int, str, list[Event]]] = []
        """``--publish-at prefill-end``: (prefill end, trace s; sequence; replica; its events) not yet sent."""
        self.outbox_seq = 0
        self.answers_behind = self.answers_ahead = 0
        """kvbus lanes: lookups where the view answered some replica a shorter (longer) prefix than its
        engine held (with predictions counted, for kvbus_predicted)."""
        self.records = [SentPrefixes(args.approx_blocks) for _ in range(spec.routers)]
        self.sent = [0] * spec.routers
        self.beta, self.svc = args.beta, ServiceModel(args.prefill_us * 1e-6, args.decode_ms * 1e-3)
        self.tally = Tally()

    def matched(self, inst: int, chain: Sequence[bytes]) -> dict[str, int]:
        """Replica -> leading blocks of ``chain`` it holds, as router instance ``inst`` of this lane knows it."""
        kind = self.spec.kind
        if kind == "oracle":
            return {n: k for n, m in self.models.items() if (k := m.resident_prefix(chain))}
        if kind == "approximate":
            return self.records[inst].matches(chain)
        return {}

    def route(self, i: int, req: TraceRequest, tokens: list[int], hashes: list[bytes], digests: list[bytes]) -> str:
        """Request ``i``: its router instance chooses, the engine serves it; returns the replica."""
        inst = i % self.spec.routers
        k, self.sent[inst] = self.sent[inst], self.sent[inst] + 1
        order = rotation(self.names, k + inst)
        if self.spec.kind == "round_robin":
            choice = choose(len(hashes), {}, {}, order, 0.0)
        elif self.view_load is not None:
            matched, load = self.ask_view(inst, req.at, hashes)
            choice = choose(len(hashes), matched, load, order, self.beta)
            if self.predicted and hashes:
                assert self.view is not None
                self.predictions += self.view.predict(choice, hashes=list(hashes), ttl=self.predict_ttl)
        else:
            load = self.boards[inst].load(req.at)
            choice = choose(len(hashes), self.matched(inst, hashes), load, order, self.beta)
        reused, events = self.models[choice].admit_hashed(tokens, hashes, digests)
        reused_tokens = min(reused * BLOCK_SIZE, len(tokens))
        ttft, end = self.replicas[choice].serve(req.at, len(tokens) - reused_tokens, req.output_length, self.svc)
        if self.publish is not None and events:
            if self.publish_at_prefill_end:  # as a real engine: BlockStored once the prefill is done
                self.outbox_seq += 1
                heapq.heappush(self.outbox, (req.at + ttft, self.outbox_seq, choice, events))
            else:
                self.publish(choice, events)
        if self.view_load is not None:
            self.view_load.started(inst, choice, len(tokens), end)
        else:
            self.boards[inst].add(choice, end)
        if self.spec.kind == "approximate":
            self.records[inst].record(hashes, choice)
        self.score(req, len(tokens), reused_tokens, ttft)
        return choice

    def ask_view(self, inst: int, t: float, chain: Sequence[bytes]) -> tuple[dict[str, float], dict[str, float]]:
        """A kvbus router instance's question at trace time ``t``: replica -> matched blocks (one lookup
        among the lane's replicas; for kvbus_predicted the reply's score, where a held block weighs 1
        and a predicted one ``--predicted-weight``), and replica -> requests in flight: the shared sums of
        every instance of the lane (``lookup_with_load``, the same round trip) when load is shared, else
        the instance's own book (its reporter's)."""
        assert self.view is not None and self.view_load is not None
        self.view_load.advance(t)
        query = {"candidates": self.names, "predicted": self.predicted_weight if self.predicted else None}
        if self.spec.shared:
            found, sums = self.view.lookup_with_load(hashes=list(chain), **query)
            load = {n: float(ld.requests) for n, ld in sums.items() if n in self.models}
        else:
            found = self.view.lookup(hashes=list(chain), **query) if chain else []
            load = {n: float(k) for n, k in self.view_load.own(inst).items()}
        said = {m.replica: m.matched for m in found}
        truth = {n: m.resident_prefix(chain) for n, m in self.models.items()}
        self.answers_behind += any(said.get(n, 0) < k for n, k in truth.items())
        self.answers_ahead += any(said.get(n, 0) > k for n, k in truth.items())
        if self.predicted:  # held blocks weigh 1 (GPU), predicted ones --predicted-weight: the reply's score
            return {m.replica: m.score for m in found}, load
        return {m.replica: m.matched for m in found}, load

    def flush(self, t: float) -> None:
        """``--publish-at prefill-end``: send the events of every request whose prefill ended by trace
        time ``t`` (per replica in order: a replica's prefills end in the order they queued)."""
        while self.outbox and self.outbox[0][0] <= t:
            _, _, replica, events = heapq.heappop(self.outbox)
            assert self.publish is not None
            self.publish(replica, events)

    def keepalive(self, now: float) -> None:
        """Renew the kvbus router instances' load leases when due (wall clock ``now``)."""
        if self.view_load is not None:
            self.view_load.keepalive(now)

    def score(self, req: TraceRequest, prompt: int, reused_tokens: int, ttft: float) -> None:
        t = self.tally
        t.requests += 1
        t.prompt_tokens += prompt
        t.reused_tokens += reused_tokens
        t.hits += reused_tokens > 0
        t.deep_hits += reused_tokens > TRACE_BLOCK
        t.ttft.append(ttft)
        flight = [r.in_flight(req.at) for r in self.replicas.values()]
        if sum(flight):
            t.imbalance.append(max(flight) * len(flight) / sum(flight))


def rotation(names: Sequence[str], i: int) -> list[str]:
    """Tie-break order of a router's ``i``-th request: the replicas starting at ``i mod replicas``."""
    k = i % len(names)
    return [*names[k:], *names[:k]]


def lane_specs(router_counts: Sequence[int], shared_load: bool, kinds: Sequence[str] = ROUTERS) -> list[LaneSpec]:
    """Every (router kind of ``kinds``, router count, shared load) the run plays."""
    settings = [(n, False) for n in router_counts] + [(n, True) for n in router_counts if n > 1 and shared_load]
    return [LaneSpec(kind, n, s) for n, s in settings for kind in ROUTERS if kind in kinds]


def iter_kinds(text: str) -> list[str]:
    """``--kinds``'s router kinds: ``oracle,kvbus`` -> oracle, kvbus (each one of :data:`ROUTERS`)."""
    kinds = [k.strip() for k in text.split(",") if k.strip()]
    bad = [k for k in kinds if k not in ROUTERS]
    if bad or not kinds:
        raise SystemExit(f"--kinds: expected some of {', '.join(ROUTERS)}, got {text!r}")
    return kinds


# -- the run ---------------------------------------------------------------------------------------

def fleet_config(args: argparse.Namespace, kvbus_lanes: int, base_port: int) -> FleetConfig:
    """One published fleet for every kvbus lane: lane k owns replicas k*R .. k*R+R-1."""
    return FleetConfig(replicas=args.replicas * kvbus_lanes, base_port=base_port, seed=args.seed,
                       block_size=BLOCK_SIZE, model=engine_config(args.gpu_blocks))


def build_lanes(specs: Sequence[LaneSpec], args: argparse.Namespace, fleet: Optional[Fleet],
                view: Optional[ViewClient]) -> list[Lane]:
    """The lanes of ``specs``; kvbus lanes on ``fleet``'s replicas (published), the rest in process."""
    lanes, k = [], 0
    for spec in specs:
        if spec.kind in VIEW_ROUTERS:
            assert fleet is not None
            names = list(fleet.names)[k * args.replicas:(k + 1) * args.replicas]
            k += 1
            models = {n: fleet.models[(n, 0)] for n in names}
            lanes.append(Lane(spec, models, args, publish=publisher(fleet), view=view))
        else:
            models = {f"replica-{i}": CacheModel(random.Random(f"{args.seed}:{i}"), engine_config(args.gpu_blocks))
                      for i in range(args.replicas)}
            lanes.append(Lane(spec, models, args))
    return lanes


def publisher(fleet: Fleet) -> Callable[[str, list[Event]], None]:
    """Sends one replica's events of one request as one engine batch."""
    def send(name: str, events: list[Event]) -> None:
        fleet.publish_events(name, events)
        fleet.events += len(events)
    return send


def play(lanes: Sequence[Lane], reqs: Sequence[TraceRequest], args: argparse.Namespace,
         probes_tick: Callable[[float], None], events: Callable[[], int]) -> dict[str, float]:
    """Replay ``reqs`` at their timestamps / ``args.speedup`` on every lane; ``probes_tick`` runs while
    waiting. Returns pacing figures: wall seconds, the largest delay behind schedule."""
    hasher = lanes[0].models[lanes[0].names[0]]
    start = time.monotonic()
    report_at, behind = start + PROGRESS_EVERY, 0.0
    for i, req in enumerate(reqs):
        due = start + req.at / args.speedup
        now = time.monotonic()
        while now < due:
            probes_tick(now)
            for lane in lanes:
                lane.keepalive(now)
                lane.flush((now - start) * args.speedup)
            time.sleep(min(due - now, 0.002))
            now = time.monotonic()
        behind = max(behind, now - due)
        probes_tick(now)  # also when behind schedule: the probes keep their pace
        for lane in lanes:
            lane.keepalive(now)
            lane.flush(req.at)
        tokens = prompt_tokens(req)
        hashes, digests = hasher.hashes(tokens)
        for lane in lanes:
            lane.route(i, req, tokens, hashes, digests)
        if now >= report_at:
            report_at += PROGRESS_EVERY
            print(progress_line(lanes, i + 1, len(reqs), now - start, events(), now - due), file=sys.stderr, flush=True)
    for lane in lanes:
        lane.flush(float("inf"))
    return {"wall_s": round(time.monotonic() - start, 1), "max_behind_schedule_s": round(behind, 2)}


def progress_line(lanes: Sequence[Lane], done: int, total: int, wall: float, events: int, behind: float) -> str:
    shares = " ".join(f"{ln.spec.key}={ln.tally.reused_tokens / max(ln.tally.prompt_tokens, 1):.1%}"
                      for ln in lanes if ln.spec.routers == 1)
    return (f"  {wall:.0f} s: {done}/{total} requests, {events} kvbus events ({events / max(wall, 1e-9):.0f}/s), "
            f"{behind:+.2f} s vs schedule | reused {shares}")


def lane_figures(lanes: Sequence[Lane]) -> dict[str, dict]:
    """Every lane's figures, with its reused tokens as a share of the oracle's of the same setting."""
    oracle = {(ln.spec.routers, ln.spec.shared): ln.tally for ln in lanes if ln.spec.kind == "oracle"}
    out = {}
    for ln in lanes:
        fig = ln.tally.figures()
        o = oracle.get((ln.spec.routers, ln.spec.shared))
        fig["share_of_oracle"] = round(ln.tally.reused_tokens / o.reused_tokens, 4) if o and o.reused_tokens else None
        fig.update(kind=ln.spec.kind, routers=ln.spec.routers, shared_load=ln.spec.shared)
        if ln.view_load is not None:
            n = max(ln.tally.requests, 1)
            fig.update(answers_behind=round(ln.answers_behind / n, 4), answers_ahead=round(ln.answers_ahead / n, 4))
        if ln.predicted:
            fig["predicted_blocks"] = ln.predictions
        out[ln.spec.key] = fig
    return out


def targets(figs: dict[str, dict]) -> list[dict]:
    """Issue 45's targets, as far as the lanes of ``figs`` measure them: (target, measured, met)."""
    out: list[dict] = []

    def add(target: str, measured: Optional[float], limit: float, at_least: bool) -> None:
        if measured is not None:
            out.append({"target": target, "measured": measured,
                        "met": measured >= limit if at_least else measured <= limit})

    shared = sorted({f["routers"] for f in figs.values() if f["shared_load"]})
    for kind in VIEW_ROUTERS:
        if kind not in figs:
            continue
        floors = {"kvbus_predicted": (0.98, 0.97)}.get(kind)
        if floors:
            add(f"{kind}, 1 router: reused tokens >= 98 % of the oracle's", figs[kind]["share_of_oracle"],
                floors[0], True)
            for n in shared:
                if (f := figs.get(f"{kind}/{n}r/shared")) is not None:
                    add(f"{kind}, {n} routers sharing load: reused tokens >= 97 % of the oracle's",
                        f["share_of_oracle"], floors[1], True)
        one = figs[kind]["load_imbalance"]
        for n in shared:
            if (f := figs.get(f"{kind}/{n}r/shared")) is not None and one and f["load_imbalance"]:
                add(f"{kind}, {n} routers sharing load: load imbalance <= 1.1 x 1 router's ({one})",
                    round(f["load_imbalance"] / one, 3), 1.1, False)
        for key, f in figs.items():
            if f["kind"] == kind and f["ttft_p90_s"] is not None:
                suffix = key[len(kind):]
                o = figs.get("oracle" + suffix)
                if o and o["ttft_p90_s"]:
                    add(f"{key}: TTFT p90 <= 1.1 x the oracle's ({o['ttft_p90_s']} s)",
                        round(f["ttft_p90_s"] / o["ttft_p90_s"], 3), 1.1, False)
    return out


def targets_table(rows: Sequence[dict]) -> str:
    """The targets as a Markdown table (stderr, docs/routing.md)."""
    lines = ["| target | measured | met? |", "|---|---|---|"]
    lines += [f"| {r['target']} | {r['measured']} | {'yes' if r['met'] else 'no'} |" for r in rows]
    return "\n".join(lines)


def table(figs: dict[str, dict]) -> str:
    """The figures as a Markdown table (printed to stderr at the end, pasted into docs/routing.md)."""
    rows = ["| router | reused share | of oracle | hit rate (> 1st id) | TTFT p50 / p90 s | imbalance |",
            "|---|---|---|---|---|---|"]
    for k, f in figs.items():
        rows.append(f"| {k} | {f['reused_share']:.1%} | {f['share_of_oracle']} | {f['hit_rate']:.1%} "
                    f"({f['hit_rate_beyond_first_id']:.1%}) | "
                    f"{f['ttft_p50_s']} / {f['ttft_p90_s']} | {f['load_imbalance']} |")
    return "\n".join(rows)


def plot(figs: dict[str, dict], path: Path, title: str) -> None:
    """A PNG of each lane's share of the oracle and TTFT p90."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(figs)
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    a.bar(keys, [figs[k]["share_of_oracle"] or 0 for k in keys], color="tab:blue")
    a.set_title("reused prompt tokens / oracle's")
    a.axhline(1.0, color="grey", lw=0.8)
    b.bar(keys, [figs[k]["ttft_p90_s"] or 0 for k in keys], color="tab:orange")
    b.set_title("TTFT p90 (s, service model)")
    for ax in (a, b):
        ax.tick_params(axis="x", rotation=45, labelsize=8)
        for lbl in ax.get_xticklabels():
            lbl.set_horizontalalignment("right")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def iter_counts(text: str) -> Iterator[int]:
    """``--routers``'s counts: ``1,4`` -> 1, 4."""
    for part in text.split(","):
        if part.strip():
            n = int(part)
            if n < 1:
                raise SystemExit(f"--routers: counts must be at least 1, got {n}")
            yield n


def stages_args(args: argparse.Namespace, kvbus_lanes: int, base_port: int) -> argparse.Namespace:
    """What ``pipeline.new_run`` and ``pipeline.start_stages`` read for the kvbus fleet: ``kvbus_lanes`` x
    ``args.replicas`` engines from ``base_port`` on, one bridge per lane's replicas."""
    out = argparse.Namespace(**vars(args))
    out.replicas, out.streams_per_bridge, out.base_port = args.replicas * kvbus_lanes, args.replicas, base_port
    return out


def announce(fleet: Fleet, store, timeout: float = 30.0) -> bool:
    """One probe per engine of ``fleet``, waited for in the view (``store``): every engine is known to the
    view before the first request, as a fleet running before its routers are (``ViewClient.predict``
    records nothing for a holder the view has not heard of). Whether all arrived within ``timeout``."""
    from kvbus.children import wait_for

    hashes = [fleet.publish_probe()[0] for _ in fleet.models]
    return bool(wait_for(lambda: all(store.lookup([h]) for h in hashes), timeout, 0.05))


def run(args: argparse.Namespace, probes_cls: type) -> dict:
    """The trace run: the stack's pipeline for the kvbus lanes, every lane replayed, the figures.
    ``probes_cls``: routing.py's :class:`Probes` (freshness probes through the kvbus fleet)."""
    import os

    from kvbus.children import free_port_block, wait_for
    from kvbus.infra import stack
    from kvbus.runtime.settings import Settings
    from kvbus.schemas.registry import register
    from kvbus.sinks.view.store_url import open_store

    kinds = iter_kinds(args.kinds)
    if not set(kinds) & set(VIEW_ROUTERS):
        raise SystemExit("--kinds: trace mode needs kvbus or kvbus_predicted (the pipeline's fleet, the probes)")
    reqs = read_trace(args.trace, args.requests)
    specs = lane_specs(list(iter_counts(args.routers)), args.shared_load, kinds)
    kvbus_lanes = sum(s.kind in VIEW_ROUTERS for s in specs)
    stage_args = stages_args(args, kvbus_lanes, free_port_block(2 * args.replicas * kvbus_lanes))
    started_stack = not stack.status().get("ready")
    if started_stack:
        print("bringing the stack up ...", file=sys.stderr, flush=True)
        stack.up()
    state_dir = Path(os.environ.get("KVBUS_STATE_DIR", Path(__file__).resolve().parents[1] / ".infra"))
    run_ = pl.new_run(stage_args, Settings.from_env(), state_dir / "logs")
    manifest = state_dir / "logs" / f"{run_.run_id}-manifest.json"
    span = reqs[-1].at if reqs else 0.0
    print(f"run {run_.run_id}: {len(reqs)} requests of {args.trace} ({span:.0f} trace s) at x{args.speedup:g}; "
          f"{args.replicas} replicas x {args.gpu_blocks} GPU blocks per router; lanes "
          f"{', '.join(s.key for s in specs)}; beta {args.beta}", file=sys.stderr, flush=True)
    fleet = Fleet(fleet_config(args, kvbus_lanes, stage_args.base_port))
    result: dict = {"mode": "trace", "run": run_.run_id, "trace": str(args.trace), "requests": len(reqs),
                    "trace_seconds": round(span, 1), "speedup": args.speedup, "replicas": args.replicas,
                    "gpu_blocks": args.gpu_blocks, "approx_blocks": args.approx_blocks, "beta": args.beta,
                    "prefill_us_per_token": args.prefill_us, "decode_ms_per_token": args.decode_ms,
                    "routers": args.routers, "shared_load": args.shared_load,
                    "predicted_weight": args.predicted_weight, "predict_ttl_s": args.predict_ttl,
                    "load_lease_s": args.load_lease, "publish_at": args.publish_at}
    if args.shared_load:
        result["shared_load_note"] = SHARED_LOAD_NOTE
    try:
        register(run_.settings.registry_url, run_.settings.topics, ("kvcr",), run_.settings.security.registry)
        pl.start_stages(run_, stage_args)
        fleet.start()
        time.sleep(2.0)  # bridges connected before the first batch
        store = open_store(run_.settings.redis_url, run_.prefix, load=False)
        client = ViewClient(run_.settings.redis_url, run_.prefix, **run_.settings.redis_kwargs())
        lanes = build_lanes(specs, args, fleet, client)
        probes = probes_cls(fleet, store, args.probe_every)
        announce(fleet, store)
        pace = play(lanes, reqs, args, probes.tick, lambda: fleet.events)
        wait_for(lambda: probes.tick(time.monotonic(), publish=False) or not probes.outstanding, 5.0, 0.01)
        pl.check_alive(run_)
        fleet.write_manifest(manifest)
        exact = wait_for(lambda: pl.view_matches_truth(store, manifest)[0], args.drain_timeout, 0.5)
    finally:
        fleet.stop()
        run_.children.stop_all()
        if not args.keep:
            pl.cleanup(run_)
        if started_stack:
            stack.down()
    fresh = sorted(probes.seen_ms)
    result.update(pace, events=fleet.events, events_s=round(fleet.events / max(pace["wall_s"], 1e-9)),
                  freshness_probes=len(fresh), freshness_unseen=len(probes.outstanding),
                  freshness_p50_ms=round(pl.quantile(fresh, 0.5), 1) if fresh else None,
                  freshness_p99_ms=round(pl.quantile(fresh, 0.99), 1) if fresh else None,
                  view_exact=exact, lanes=lane_figures(lanes))
    result["targets"] = targets(result["lanes"])
    print(table(result["lanes"]), file=sys.stderr, flush=True)
    print(targets_table(result["targets"]), file=sys.stderr, flush=True)
    if args.plot:
        plot(result["lanes"], args.plot, f"{len(reqs)} Mooncake requests x{args.speedup:g}, {args.replicas} replicas "
             f"x {args.gpu_blocks} blocks, beta {args.beta}; kvbus freshness p50 {result['freshness_p50_ms']} ms")
    return result


def add_args(p: argparse.ArgumentParser) -> None:
    """Trace mode's options (routing.py's parser)."""
    add = p.add_argument
    add("--trace", type=Path, default=None, help="replay this Mooncake-format trace (trace mode; module docstring)")
    add("--speedup", type=float, default=2.0, help="trace mode: play timestamps / this (default 2)")
    add("--requests", type=int, default=1200, help="trace mode: the first N requests (default 1200; 0 = all)")
    add("--routers", default="1", help="trace mode: router instances per run, comma-separated (default 1; e.g. 1,4)")
    add("--shared-load", action="store_true",
        help="trace mode: also run each N > 1 with load shared by the instances (kvbus's LoadReporter and "
             "lookup_with_load for the kvbus routers; an in-process stand-in for the others)")
    add("--kinds", default=",".join(ROUTERS),
        help=f"trace mode: the router kinds to play, comma-separated (default all: {','.join(ROUTERS)})")
    add("--predicted-weight", type=float, default=1.0,
        help="trace mode: kvbus_predicted's lookups count a predicted block with this weight (default 1.0)")
    add("--predict-ttl", type=float, default=5.0,
        help="trace mode: kvbus_predicted's predictions count for this many wall seconds (default 5)")
    add("--publish-at", choices=("route", "prefill-end"), default="route",
        help="trace mode: the kvbus engines publish a request's events when it is routed (default) or, as "
             "real engines, when its prefill ends in trace time")
    add("--load-lease", type=float, default=30.0,
        help="trace mode: the kvbus routers' load leases, wall seconds (renewed every 5 s; default 30)")
    add("--approx-blocks", type=int, default=None,
        help="trace mode: hashes the approximate router remembers (default replicas x gpu blocks)")
    add("--prefill-us", type=float, default=ServiceModel.prefill_s * 1e6,
        help="trace mode: prefill microseconds per uncached prompt token (default 40)")
    add("--decode-ms", type=float, default=ServiceModel.decode_s * 1e3,
        help="trace mode: decode milliseconds per output token (default 12)")
    add("--plot", type=Path, default=None, help="trace mode: write a PNG of share of oracle and TTFT p90")
