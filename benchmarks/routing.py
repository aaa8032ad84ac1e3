"""What the view's answers are worth to a router: prefix tokens reused when routing by kvbus, by an oracle, round-robin.

    .venv/bin/python benchmarks/routing.py                           # 500, 2000, 5000 events/s, 25 s each
    .venv/bin/python benchmarks/routing.py --rates 2000 --seconds 60 --replicas 16

**Workload.** A fleet's users hold ``--sessions`` conversations at a time, each over one of
``--system-prompts`` shared system prompts; a request is the next turn of a random open conversation:
its previous prompt, the reply to it and a new user message (the first turn: the system prompt and a
message). A conversation ends after 1 to ``--max-turns`` turns and a new one takes its place. The
stream depends on ``--seed`` only, never on where requests go, so every router gets the same requests.

**Engines.** ``--replicas`` simulated vLLM 0.33 engines (:class:`kvbus.simulator.fleet.CacheModel`: a GPU prefix
cache of ``--gpu-blocks`` blocks, LRU eviction, one ``BlockRemoved`` per evicted hash, vLLM's sha256
block hashes). The chosen replica serves the prompt and its reply, reusing the leading blocks it holds;
the full blocks of prompt and reply stay cached. *Reused tokens* = resident leading blocks of the prompt
x block size, read from the engine itself at the moment it serves the request.

**Routers**, all with kvbus's routing policy (:func:`kvbus.client.routing.choose`): the best score
``matched / prompt_blocks - beta * load / max_load`` (``--beta``); load = requests among the last
``--window`` routed (those still in flight); ties go to the longer prefix, the lower load, then the
replica next in a rotation that advances with every request.

- ``kvbus``: the prefixes come from the real view (:func:`view_matches`, one lookup per request).
  Its engines publish every batch over ZMQ to one ``kvbus bridge`` each -> Kafka -> ``kvbus worker``
  -> ``kvbus sink`` -> Redis (the processes of ``benchmarks/pipeline.py``, fresh topics, groups and
  Redis prefix), paced so that the engines publish ``rate`` events/s.
- ``oracle``: the prefixes come from the engines' own caches, i.e. an index that has seen every event
  the instant it was published (its own engines, in process, same requests).
- ``round_robin``: replica ``i mod replicas`` for request ``i`` (its own engines).

Per rate, the engines' caches start empty (``AllBlocksCleared`` through the pipeline, then the view is
waited for to be empty), the kvbus router plays the stream for ``--seconds``; the oracle and round-robin
then play the same requests. Requests of the first ``--warmup`` seconds fill the caches and are not
scored; in the oracle's and round-robin's runs they go where kvbus sent them, so all three score from the
same caches. ``kvbus_share`` = kvbus's reused tokens / the oracle's. Once one choice differs, the two
fleets' caches differ and the greedy policy may do better or worse from there on, so this share drifts
by up to a few percent either way (above 1 too). ``kvbus_share_same_state`` has no such drift: kvbus's reused tokens
/ what the policy on the engines' own state at each lookup would have reused on kvbus's fleet (at most 1).

**Freshness context** (kvbus run): ``answers_behind`` = lookups where the view held a shorter prefix
than the engine did for some replica, ``answers_ahead`` a longer one (blocks already evicted);
``choices_differ`` = requests for which the policy on the engines' state would have picked another
replica; probes (a one-block ``BlockStored`` of a fresh hash every ``--probe-every`` s, polled with
lookups between requests) give freshness p50 / p99. After each rate the pipeline drains and the view is
compared with the engines' ground truth (``view_exact``).

Each rate prints one line; the last line is one JSON object with every figure.

**Trace mode** (``--trace FILE``): a Mooncake-format trace replayed at its timestamps through engines
with finite caches and a service-time model, five routers (oracle, kvbus, approximate, least-loaded,
round-robin), one or several router instances; ``benchmarks/routing_trace.py`` says how.
"""
from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import random
import sys
import time
from collections import Counter, deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator, Mapping, Optional, Sequence

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import pipeline as pl  # noqa: E402  (benchmarks/pipeline.py: the stage processes, the truth check)
import routing_trace  # noqa: E402  (benchmarks/routing_trace.py: the trace mode)
from kvbus.children import free_port_block, wait_for  # noqa: E402
from kvbus.client import ViewClient  # noqa: E402
from kvbus.client.routing import DEFAULT_BETA, choose  # noqa: E402
from kvbus.runtime.settings import Settings  # noqa: E402
from kvbus.schemas.hashing import block_hashes  # noqa: E402
from kvbus.simulator.fleet import CacheModel, Fleet, FleetConfig, ModelConfig, message, system_prompts  # noqa: E402
from kvbus.sinks.view.store import ResidencyStore  # noqa: E402
from kvbus.sinks.view.store_url import open_store  # noqa: E402

ROUTERS = ("kvbus", "oracle", "round_robin")
PROGRESS_EVERY = 5.0
"""Seconds between progress lines during a run."""
TRACE_GPU_BLOCKS = 26_000
"""Trace mode's GPU cache per replica, blocks of 16 tokens: one H100 80 GB's KV for Llama-3-8B
(benchmarks/routing_trace.py says why)."""


# -- the workload ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Workload:
    """Shape of the request stream and of the engines."""

    sessions: int = 48
    """Conversations open at a time."""
    max_turns: int = 8
    """A conversation lasts 1 to ``max_turns`` turns (uniform)."""
    system_prompts: int = 8
    """Shared system prompts (3-12 blocks each)."""
    block_size: int = 16
    gpu_blocks: int = 512
    """GPU prefix-cache capacity of each replica, in blocks."""
    seed: int = 0

    def model_config(self) -> ModelConfig:
        """The engines' configuration: GPU only (no CPU offload, no secondary tier, no resets)."""
        return ModelConfig(block_size=self.block_size, gpu_blocks=self.gpu_blocks, system_prompts=self.system_prompts,
                           cpu_rate=0.0, kvcr_rate=0.0, clear_rate=0.0)


@dataclass(frozen=True)
class Request:
    """One request: turn ``turn`` (0 = first) of conversation ``session``."""

    session: int
    turn: int
    prompt: list[int]
    """The prompt's token ids."""
    reply: list[int]
    """The tokens the engine generates (cached with the prompt; the next turn's prompt starts with both)."""
    chain: list[bytes]
    """Block hashes of the prompt's full blocks (what a router looks up)."""


def requests(w: Workload) -> Iterator[Request]:
    """The request stream of ``w`` (endless, deterministic for ``w.seed``)."""
    cfg = w.model_config()
    rng = random.Random(f"routing:{w.seed}")
    system = system_prompts(random.Random(f"system:{w.seed}"), cfg)
    sessions = itertools.count()
    def new() -> tuple[int, int, int, list[int]]:
        return next(sessions), rng.randint(1, w.max_turns), 0, list(rng.choice(system))

    # each open conversation: (id, turns left, next turn, the next prompt's start: previous prompt + reply)
    open_: list[tuple[int, int, int, list[int]]] = [new() for _ in range(w.sessions)]
    while True:
        i = rng.randrange(len(open_))
        sid, left, turn, history = open_[i]
        prompt = history + message(rng, cfg)
        reply = message(rng, cfg)
        yield Request(sid, turn, prompt, reply, block_hashes(prompt, w.block_size))
        open_[i] = (sid, left - 1, turn + 1, prompt + reply) if left > 1 else new()


def engines(w: Workload, replicas: int) -> dict[str, CacheModel]:
    """In-process engines (replica name -> its cache), as :class:`kvbus.simulator.fleet.Fleet` builds them."""
    return {name: m for (name, _), m in Fleet(fleet_config(w, replicas)).models.items()}


def fleet_config(w: Workload, replicas: int, base_port: int = 0) -> FleetConfig:
    """The fleet of the engines (1 dp rank, TP 1, vLLM 0.33 wire format)."""
    return FleetConfig(replicas=replicas, base_port=base_port, seed=w.seed, block_size=w.block_size,
                       model=w.model_config())


# -- the routers -------------------------------------------------------------------------------

class InFlight:
    """Load per replica: requests among the last ``window`` routed to it."""

    def __init__(self, names: Sequence[str], window: int) -> None:
        self.recent: deque[str] = deque()
        self.window = window
        self.load: Counter[str] = Counter({n: 0 for n in names})

    def add(self, name: str) -> None:
        self.recent.append(name)
        self.load[name] += 1
        if len(self.recent) > self.window:
            self.load[self.recent.popleft()] -= 1


def oracle_matches(models: Mapping[str, CacheModel], chain: Sequence[bytes]) -> dict[str, int]:
    """Replica -> leading blocks of ``chain`` its engine holds right now: an index that has seen every
    event the instant it was published."""
    out = {}
    for name, m in models.items():
        n = m.resident_prefix(chain)
        if n:
            out[name] = n
    return out


def view_matches(router: ViewClient, chain: Sequence[bytes]) -> dict[str, int]:
    """Replica -> leading blocks of ``chain`` the view says it holds: the router's one question to kvbus,
    asked as routers ask it (:class:`kvbus.client.ViewClient`, one ``FCALL_RO``)."""
    return {m.replica: m.matched for m in router.lookup(hashes=list(chain))} if chain else {}


# -- scoring -------------------------------------------------------------------------------------

@dataclass
class Tally:
    """What one router achieved over the scored requests."""

    requests: int = 0
    prompt_tokens: int = 0
    reused_tokens: int = 0
    """Tokens of prompts served from the chosen engine's prefix cache."""
    events: int = 0
    """Engine events the scored requests published."""

    def add(self, req: Request, reused_blocks: int, events: int, block_size: int) -> None:
        self.requests += 1
        self.prompt_tokens += len(req.prompt)
        self.reused_tokens += min(reused_blocks, len(req.chain)) * block_size
        self.events += events

    def figures(self) -> dict[str, float | int]:
        return {**asdict(self), "reused_share": round(self.reused_tokens / max(self.prompt_tokens, 1), 4)}


def rotation(names: Sequence[str], i: int) -> list[str]:
    """Tie-break order of request ``i``: the replicas starting at ``i mod replicas``."""
    k = i % len(names)
    return [*names[k:], *names[:k]]


def simulate(reqs: Sequence[Request], router: str, w: Workload, replicas: int, *, window: int, beta: float,
             warm_choices: Sequence[str] = ()) -> tuple[Tally, list[str]]:
    """Play ``reqs`` in process with ``router`` (``oracle`` or ``round_robin``) on fresh engines; returns
    (the tally, every request's replica). The first ``len(warm_choices)`` requests warm the caches: they
    go where ``warm_choices`` says (the kvbus run's choices, so that every router's scored part starts
    from the same caches) and are not scored."""
    models = engines(w, replicas)
    names = list(models)
    flight = InFlight(names, window)
    tally = Tally()
    choices: list[str] = []
    for i, req in enumerate(reqs):
        if i < len(warm_choices):
            choice = warm_choices[i]
        elif router == "oracle":
            choice = choose(len(req.chain), oracle_matches(models, req.chain), flight.load, rotation(names, i), beta)
        elif router == "round_robin":
            choice = names[i % len(names)]
        else:
            raise ValueError(f"router {router!r}: expected oracle or round_robin (kvbus needs the pipeline)")
        reused, events = models[choice].admit(req.prompt + req.reply)
        flight.add(choice)
        choices.append(choice)
        if i >= len(warm_choices):
            tally.add(req, reused, len(events), w.block_size)
    return tally, choices


def share(kvbus: Tally, oracle: Tally) -> Optional[float]:
    """kvbus's reused tokens as a share of the oracle's (None when the oracle reused nothing)."""
    return round(kvbus.reused_tokens / oracle.reused_tokens, 4) if oracle.reused_tokens else None


# -- the kvbus run -------------------------------------------------------------------------------

@dataclass
class ViewContext:
    """How the view's answers compared with the engines at lookup time (kvbus run, scored requests)."""

    lookups: int = 0
    ideal_reused_tokens: int = 0
    """Tokens the chosen engine would have reused had each request gone where the policy on the engines'
    state at that instant sent it (what an oracle would have gained from the same state)."""
    answers_behind: int = 0
    answers_ahead: int = 0
    choices_differ: int = 0
    probes: list[float] = field(default_factory=list)
    """Freshness of each probe seen, ms."""
    probes_unseen: int = 0

    def figures(self) -> dict[str, float | int | None]:
        n = max(self.lookups, 1)
        p = sorted(self.probes)
        return {"lookups": self.lookups, "answers_behind": round(self.answers_behind / n, 4),
                "answers_ahead": round(self.answers_ahead / n, 4), "choices_differ": round(self.choices_differ / n, 4),
                "freshness_probes": len(p), "freshness_unseen": self.probes_unseen,
                "freshness_p50_ms": round(pl.quantile(p, 0.5), 1) if p else None,
                "freshness_p99_ms": round(pl.quantile(p, 0.99), 1) if p else None}


class Probes:
    """One-block probes published through the fleet, found in the view with lookups between requests."""

    def __init__(self, fleet: Fleet, view: ResidencyStore, every: float) -> None:
        self.fleet, self.view, self.every = fleet, view, every
        self.outstanding: list[tuple[bytes, float]] = []
        self.seen_ms: list[float] = []
        self.next_at = time.monotonic()

    def tick(self, now: float, publish: bool = True) -> None:
        """Publish a probe when one is due (``publish``), then look up the outstanding ones."""
        if publish and self.every and now >= self.next_at:
            h, _ = self.fleet.publish_probe()
            self.outstanding.append((h, time.monotonic()))
            self.next_at = max(self.next_at + self.every, now)
        still = []
        for h, t in self.outstanding:
            if self.view.lookup([h]):
                self.seen_ms.append((time.monotonic() - t) * 1000.0)
            else:
                still.append((h, t))
        self.outstanding = still


def play_kvbus(
    fleet: Fleet, view: ResidencyStore, router: ViewClient, reqs: Iterator[Request], args: argparse.Namespace,
    rate: float,
) -> tuple[list[Request], list[str], int, Tally, ViewContext, float]:
    """Route ``reqs`` by the view for ``args.seconds`` at ``rate`` engine events/s; returns (the requests
    played, the replica of each, how many warmed up, the tally of the rest, the view context, seconds of
    the scored part)."""
    names = list(fleet.names)
    models = {n: fleet.models[(n, 0)] for n in names}
    flight = InFlight(names, args.window)
    tally, ctx = Tally(), ViewContext()
    probes = Probes(fleet, view, args.probe_every)
    played: list[Request] = []
    choices: list[str] = []
    warm = None
    start = time.monotonic()
    next_at = start
    scored_from_t = start
    report_at = start + PROGRESS_EVERY
    while True:
        now = time.monotonic()
        if now - start >= args.seconds:
            break
        if now >= report_at:
            report_at += PROGRESS_EVERY
            print(f"  {rate:g} ev/s, {now - start:.0f} s: {len(played)} requests, {fleet.events} events, kvbus reused "
                  f"{tally.figures()['reused_share']:.1%} of the scored prompt tokens", file=sys.stderr, flush=True)
        if warm is None and now - start >= args.warmup:
            warm, scored_from_t = len(played), now
            probes.seen_ms.clear()
        probes.tick(now)
        while now < next_at:  # idle until the next request: the probes' turn
            time.sleep(min(next_at - now, 0.001))
            now = time.monotonic()
            probes.tick(now)
        i = len(played)
        req = next(reqs)
        played.append(req)
        order = rotation(names, i)
        seen = view_matches(router, req.chain)
        choice = choose(len(req.chain), seen, flight.load, order, args.beta)
        truth = oracle_matches(models, req.chain)  # the engines' state the view is compared with
        ideal = choose(len(req.chain), truth, flight.load, order, args.beta)
        reused, events = fleet.serve(choice, req.prompt + req.reply)
        flight.add(choice)
        choices.append(choice)
        if warm is not None:
            tally.add(req, reused, events, args.block_size)
            ctx.lookups += 1
            ctx.answers_behind += any(seen.get(n, 0) < k for n, k in truth.items())
            ctx.answers_ahead += any(k > truth.get(n, 0) for n, k in seen.items())
            ctx.choices_differ += choice != ideal
            ctx.ideal_reused_tokens += truth.get(ideal, 0) * args.block_size
        next_at = max(next_at + max(events, 1) / rate, now - 1.0)  # the fleet's pacing, catch up <= 1 s
    end = time.monotonic()
    wait_for(lambda: probes.tick(time.monotonic(), publish=False) or not probes.outstanding, 5.0, 0.01)
    ctx.probes = list(probes.seen_ms)
    ctx.probes_unseen = len(probes.outstanding)
    return played, choices, warm if warm is not None else len(played), tally, ctx, end - scored_from_t


def view_empty(view: ResidencyStore) -> bool:
    return not any(n for tiers in view.reader().summary().values() for n in tiers.values())


def one_rate(fleet: Fleet, view: ResidencyStore, router: ViewClient, args: argparse.Namespace, w: Workload, rate: float,
             manifest: Path) -> dict:
    """Fresh caches, the kvbus run at ``rate``, then the oracle and round-robin on its requests."""
    fleet.clear_caches()
    if not wait_for(lambda: view_empty(view), 60, 0.2):
        left = view.reader().summary()
        raise SystemExit(f"benchmark: the view still holds blocks 60 s after the caches were cleared: {left}")
    played, choices, warm, kv, ctx, seconds = play_kvbus(fleet, view, router, requests(w), args, rate)
    fleet.write_manifest(manifest)
    exact = wait_for(lambda: pl.view_matches_truth(view, manifest)[0], args.drain_timeout, 0.5)
    tallies = {"kvbus": kv}
    for router in ("oracle", "round_robin"):
        tallies[router], _ = simulate(played, router, w, args.replicas, window=args.window, beta=args.beta,
                                      warm_choices=choices[:warm])
    return {
        "target_ev_s": rate,
        "achieved_ev_s": round(kv.events / seconds) if seconds > 0 else 0,
        "requests_s": round(kv.requests / seconds, 1) if seconds > 0 else 0,
        "requests": len(played), "warmup_requests": warm,
        "routers": {r: t.figures() for r, t in tallies.items()},
        "kvbus_share": share(kv, tallies["oracle"]),
        "kvbus_share_same_state": share(kv, Tally(reused_tokens=ctx.ideal_reused_tokens)),
        "round_robin_share": share(tallies["round_robin"], tallies["oracle"]),
        "view": ctx.figures(),
        "view_exact": exact,
    }


def rate_line(fig: dict) -> str:
    r, v = fig["routers"], fig["view"]
    return (f"{fig['target_ev_s']:>6g} ev/s (achieved {fig['achieved_ev_s']}, {fig['requests_s']} req/s) | reused "
            + " ".join(f"{k}={r[k]['reused_tokens']} ({r[k]['reused_share']:.1%})" for k in ROUTERS)
            + f" | kvbus/oracle {fig['kvbus_share']} (same state {fig['kvbus_share_same_state']})"
            + f" rr/oracle {fig['round_robin_share']}"
            + f" | behind {v['answers_behind']:.2%} choices differ {v['choices_differ']:.2%}"
            + f" | fresh p50/p99 {v['freshness_p50_ms']}/{v['freshness_p99_ms']} ms | view exact {fig['view_exact']}")


# -- main ----------------------------------------------------------------------------------------

def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    d = Workload()
    add = p.add_argument
    add("--rates", default="500,2000,5000", help="engine events/s of each run, comma-separated (default 500,2000,5000)")
    add("--seconds", type=float, default=25.0, help="seconds of each rate's run (default 25)")
    add("--warmup", type=float, default=5.0, help="first seconds of each run, not scored (default 5)")
    add("--replicas", type=int, default=8, help="engine replicas (default 8)")
    add("--gpu-blocks", type=int, default=None,
        help=f"GPU cache blocks per replica (default {d.gpu_blocks}; trace mode {TRACE_GPU_BLOCKS})")
    add("--sessions", type=int, default=d.sessions, help=f"conversations open at a time (default {d.sessions})")
    add("--max-turns", type=int, default=d.max_turns, help=f"turns of the longest conversation (default {d.max_turns})")
    add("--system-prompts", type=int, default=d.system_prompts,
        help=f"shared system prompts (default {d.system_prompts})")
    add("--window", type=int, default=None, help="requests in flight over the fleet (default 4 x replicas)")
    add("--beta", type=float, default=DEFAULT_BETA,
        help=f"weight of load against reuse in kvbus.client.routing.choose (default {DEFAULT_BETA})")
    add("--probe-every", type=float, default=0.05, help="seconds between freshness probes (0 = none; default 0.05)")
    add("--seed", type=int, default=0, help="workload seed (default 0)")
    add("--partitions", type=int, default=None, help="partitions of the run's topics (default KVBUS_PARTITIONS)")
    add("--drain-timeout", type=float, default=60.0, help="seconds to wait for the view to equal the engines")
    add("--keep", action="store_true", help="leave the run's topics and Redis keys")
    routing_trace.add_args(p)
    args = p.parse_args(argv)
    args.gpu_blocks = args.gpu_blocks or (TRACE_GPU_BLOCKS if args.trace else d.gpu_blocks)
    args.approx_blocks = args.approx_blocks or args.replicas * args.gpu_blocks
    args.requests = args.requests or None
    args.window = args.window or 4 * args.replicas
    args.block_size = d.block_size
    # what pipeline.start_stages reads: one bridge per engine stream (sidecars)
    args.tp, args.workers_procs, args.sinks, args.streams_per_bridge = 1, 1, 1, 1
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.trace:
        print(json.dumps(routing_trace.run(args, Probes)))
        return 0
    w = Workload(sessions=args.sessions, max_turns=args.max_turns, system_prompts=args.system_prompts,
                 gpu_blocks=args.gpu_blocks, seed=args.seed)
    rates = [float(r) for r in args.rates.split(",") if r.strip()]
    args.base_port = free_port_block(2 * args.replicas)
    from kvbus.infra import stack

    started_stack = not stack.status().get("ready")
    if started_stack:
        print("bringing the stack up ...", flush=True)
        stack.up()
    base = Settings.from_env()
    state_dir = Path(os.environ.get("KVBUS_STATE_DIR", REPO / ".infra"))
    run = pl.new_run(args, base, state_dir / "logs")
    manifest = state_dir / "logs" / f"{run.run_id}-manifest.json"
    print(f"run {run.run_id}: {args.replicas} replicas, {args.gpu_blocks} GPU blocks each, {args.sessions} open "
          f"conversations over {args.system_prompts} system prompts, up to {args.max_turns} turns; window "
          f"{args.window}, beta {args.beta}; {args.seconds:g} s per rate ({args.warmup:g} s warm-up); logs "
          f"{run.children.log_dir}/{run.run_id}-*", flush=True)
    result: dict = {"run": run.run_id, "replicas": args.replicas, "gpu_blocks": args.gpu_blocks,
                    "sessions": args.sessions, "max_turns": args.max_turns, "system_prompts": args.system_prompts,
                    "window": args.window, "beta": args.beta, "seconds": args.seconds, "warmup": args.warmup,
                    "seed": args.seed, "rates": {}}
    fleet = Fleet(fleet_config(w, args.replicas, args.base_port))
    try:
        from kvbus.schemas.registry import register

        register(run.settings.registry_url, run.settings.topics, ("kvcr",), run.settings.security.registry)
        pl.start_stages(run, args)
        fleet.start()
        time.sleep(2.0)  # bridges connected before the first batch (replay would cover the rest)
        view = open_store(run.settings.redis_url, run.prefix, load=False)
        router = ViewClient(run.settings.redis_url, run.prefix, **run.settings.redis_kwargs())
        for rate in rates:
            fig = one_rate(fleet, view, router, args, w, rate, manifest)
            pl.check_alive(run)
            result["rates"][f"{rate:g}"] = fig
            print(rate_line(fig), flush=True)
    finally:
        fleet.stop()
        run.children.stop_all()
        if not args.keep:
            pl.cleanup(run)
        if started_stack:
            stack.down()
    result["kvbus_share"] = {k: v["kvbus_share"] for k, v in result["rates"].items()}
    result["kvbus_share_same_state"] = {k: v["kvbus_share_same_state"] for k, v in result["rates"].items()}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
