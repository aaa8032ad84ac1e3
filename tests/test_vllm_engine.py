"""kvbus with a real vLLM engine: vLLM for CPUs (kvbus.infra.vllm_engine installs it on first use into a
venv of its own), its OpenAI server on a tiny model, its KV events through bridge -> Kafka -> worker ->
sink -> Redis.

* **The view equals what the engine did**: shared system prompts, distinct prompts that overflow the
  engine's 48 blocks (BlockRemoved), identical prompts sent at once and decoding the same tokens (each
  request fills a block of its own with them: the same hash stored twice, then removed once per copy),
  a prefix-cache reset (AllBlocksCleared). What the engine holds comes from an independent
  subscriber on the engine's own socket (tests/engine_truth.py, reference counts), never from kvbus.
* **The router's prediction is the engine's hit**: before every request, once the view equals what the
  engine holds, ``ViewClient.lookup`` on the prompt's tokens (hashed as the engine does) predicts its
  cached blocks; the engine's ``usage.prompt_tokens_details.cached_tokens`` must equal that many blocks
  (at most ``(prompt length - 1) // block size``: vLLM always computes a prompt's last token), with
  ``sha256``, then ``xxhash``, with and without a ``cache_salt``.
* **Engine restart**: SIGKILLed and started again (with xxhash), its sequence restarts at 0 and the view
  drops everything the previous run held. **Stopped for good**: its holder expires (``--stale-after``).
* **Data parallel** (``--data-parallel-size 2``, which vLLM for CPUs runs): each rank publishes on a
  socket of its own, one bridge per rank, and each rank's blocks arrive in the view as its own holder.

``KVBUS_ENGINE_TESTS=0`` skips them (the engine's venv is ~6 GB: docs/development.md).
"""
from __future__ import annotations

import os
import random
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Iterator

import pytest

from kvbus.children import free_port, free_port_block
from kvbus.client import ViewClient
from kvbus.infra import vllm_engine
from kvbus.infra.vllm_engine import EngineSpec
from kvbus.runtime.settings import Settings
from kvbus.schemas.hashing import block_hashes
from tests.conftest import fresh_topics
from tests.engine_truth import EngineTruth
from tests.pipeline import Pipeline, eventually
from tests.vllm_server import MODEL_DIR, VllmServer
from tests.waiting import Waiting

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(1800),
    pytest.mark.skipif(os.environ.get("KVBUS_ENGINE_TESTS") == "0", reason="KVBUS_ENGINE_TESTS=0"),
]

REPLICA = "vllm-0"
DP_REPLICA = "vllm-dp"
BS = 32
SEED = "0"
FRESH_TIMEOUT = 120.0
"""Seconds the view may take to equal what the engine holds (a second or less on an idle machine)."""
Prompt = tuple[list[int], str | None]
"""A prompt's token ids and its cache salt."""


@dataclass
class Run:
    """The module's pipeline, engine and its truth."""

    pipeline: Pipeline
    view: ViewClient
    prefix: str
    python: Path
    """The engine venv's Python."""
    spec: EngineSpec
    logs: Path
    """Where the engines' and the pipeline's logs go."""
    engine: VllmServer | None = None
    truth: EngineTruth | None = None
    starts: list[float] = field(default_factory=list)
    """Seconds each engine start took."""
    stored_before: set[int] = field(default_factory=set)
    """Hashes an earlier engine run stored."""

    def start_engine(self, algo: str) -> None:
        self.spec = EngineSpec(MODEL_DIR, self.spec.port, self.spec.events_port, self.spec.replay_port, algo=algo,
                               seed=SEED, block_size=BS)
        self.truth = EngineTruth(f"tcp://127.0.0.1:{self.spec.events_port}")
        self.engine = VllmServer(self.python, self.spec, self.logs / f"engine-{len(self.starts)}.log")
        self.starts.append(self.engine.wait_ready())

    def held_in_view(self, hashes: set[int]) -> set[int]:
        """Which of ``hashes`` the view lists the replica as holding (a lookup of each as a chain of one)."""
        return {h for h in hashes if any(m.replica == REPLICA for m in self.view.lookup(hashes=[h]))}

    def fresh(self) -> Waiting | bool:
        """the view holds the hashes the engine holds (its own socket's reference counts), never one it does
        not hold, and misses only those of which a copy was removed while another stays: the view's GPU tier
        is a set, not a count of copies (docs/sinks-layout.md, "Stores and removes", says why)"""
        held, outlived = self.truth.held(), self.truth.outlived()
        listed = ViewClient(self.pipeline.settings.redis_url, self.prefix).summary().get(REPLICA, {}).get("GPU", 0)
        in_view = self.held_in_view(self.truth.ever_stored() | self.stored_before)
        if held - outlived <= in_view <= held and listed == len(in_view):
            return True
        return Waiting(engine=len(held), view=listed, missing=sorted(held - outlived - in_view)[:5],
                       extra=sorted(in_view - held)[:5], truth=self.truth.stats())

    def wait_fresh(self) -> None:
        eventually(self.fresh, FRESH_TIMEOUT, self.pipeline)

    def wait_published(self, prompt: list[int], salt: str | None) -> None:
        """Wait until the engine's socket has said it holds every full block of ``prompt``, which it does
        once the request is answered: its publisher sends from a thread of its own, so without this wait
        a freshness check may compare the view with events not yet sent (both lacking them)."""
        chain = {int.from_bytes(h, "big") for h in block_hashes(prompt, BS, self.spec.algo, seed=SEED,
                                                                 cache_salt=salt)}

        def published():
            """the engine's socket lists the prompt's blocks as held"""
            missing = chain - self.truth.held()
            return not missing or Waiting(missing=len(missing), of=len(chain))

        eventually(published, FRESH_TIMEOUT, self.pipeline)


@pytest.fixture(scope="module")
def run(stack, tmp_path_factory):
    python = vllm_engine.ensure()  # the first time: installs vLLM for CPUs (minutes)
    with fresh_topics(stack, "v") as topics:
        yield from _run(replace(stack, topics=topics), python, tmp_path_factory)


def _run(settings: Settings, python: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    """The module's pipeline and engine on ``settings``' topics, stopped at the end."""
    suffix = uuid.uuid4().hex[:8]
    logs = tmp_path_factory.mktemp("vllm")
    prefix = f"vllm{suffix}:"
    pipeline = Pipeline(settings, logs)
    spec = EngineSpec(MODEL_DIR, free_port(), free_port(), free_port(), seed=SEED, block_size=BS)
    r = Run(pipeline, ViewClient(settings.redis_url, prefix), prefix, python, spec, logs)
    try:
        pipeline.start("sink", "sink", "--group", f"sink-{suffix}", "--prefix", prefix)
        pipeline.start("worker", "worker", "--app-id", f"vllm-{suffix}", "--workdir", str(logs))
        pipeline.start("bridge", "bridge", "--endpoint", f"tcp://127.0.0.1:{spec.events_port}",
                       "--replay-endpoint", f"tcp://127.0.0.1:{spec.replay_port}", "--replica", REPLICA)
        r.start_engine("sha256")
        yield r
    finally:
        if r.engine is not None:
            r.engine.kill()
        if r.truth is not None:
            r.truth.close()
        pipeline.stop()
        r.view.close()


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 1000) for _ in range(n)]


def predict_and_check(r: Run, prompts: list[Prompt]) -> dict[str, int]:
    """Send ``prompts`` one at a time; before each, once the view is fresh, predict its cached blocks from
    the view and check the engine's cached tokens against the prediction. Returns the figures."""
    figures = {"requests": 0, "with_hits": 0, "cached_tokens": 0, "prompt_tokens": 0}
    for i, (prompt, salt) in enumerate(prompts):
        r.wait_fresh()
        found = r.view.lookup(tokens=prompt, block_size=BS, algo=r.spec.algo, seed=SEED, cache_salt=salt)
        matched = next((m.matched for m in found if m.replica == REPLICA), 0)
        predicted = min(matched, (len(prompt) - 1) // BS) * BS
        cached = r.engine.complete(prompt, cache_salt=salt)
        r.wait_published(prompt, salt)
        assert cached == predicted, (f"request {i} ({len(prompt)} tokens, salt {salt!r}, {r.spec.algo}): the view "
                                     f"predicted {predicted} cached tokens ({matched} blocks held), the engine "
                                     f"took {cached}; engine events so far {r.truth.stats()}")
        figures["requests"] += 1
        figures["with_hits"] += cached > 0
        figures["cached_tokens"] += cached
        figures["prompt_tokens"] += len(prompt)
    return figures


def prediction_workload(rng: random.Random, n: int, salts: tuple[str | None, ...]) -> list[Prompt]:
    """Shared system prompts with new questions, repeats of earlier prompts, and long distinct prompts
    that evict, each with a salt drawn from ``salts``."""
    systems = [tokens(rng, rng.randrange(64, 100)) for _ in range(3)]
    out: list[Prompt] = []
    for _ in range(n):
        x = rng.random()
        if x < 0.55 or not out:
            prompt = rng.choice(systems) + tokens(rng, rng.randrange(10, 80))
        elif x < 0.75:
            prompt = rng.choice(out)[0]
        else:
            prompt = tokens(rng, rng.randrange(200, 360))
        out.append((prompt, rng.choice(salts)))
    return out


def test_the_routers_prediction_is_the_engines_hit_sha256(run) -> None:
    figures = predict_and_check(run, prediction_workload(random.Random(1), 40, (None, None, "tenant-a")))
    print(f"sha256: {figures}; engine events {run.truth.stats()}")
    assert figures["with_hits"] >= 10, figures
    assert run.truth.stats()["removes"] > 0, "the workload evicted nothing"


def test_the_view_equals_what_the_engine_did(run) -> None:
    rng = random.Random(2)
    systems = [tokens(rng, 96) for _ in range(3)]
    outlived = 0
    with ThreadPoolExecutor(8) as pool:
        for burst in range(4):
            same = [systems[burst % 3] + tokens(rng, 40) for _ in range(2)]
            # each prompt four times at once, decoding 40 identical tokens: each request's decode fills a
            # block of its own with the same content, so the same hash is stored in several copies
            twins = [pool.submit(run.engine.complete, p, None, 40) for p in same for _ in range(4)]
            batch = [tokens(rng, 300) for _ in range(3)]  # distinct: overflow the engine's blocks
            list(pool.map(run.engine.complete, batch))
            for f in twins:
                f.result()
            if burst == 1:
                run.engine.reset_prefix_cache()  # AllBlocksCleared goes out with the scheduler's next step
                run.engine.complete(systems[0] + [5, 6, 7])
            run.wait_fresh()
            outlived = max(outlived, run.truth.stats()["held_after_a_copy_was_removed"])
        twins = [pool.submit(run.engine.complete, systems[1] + [9, 9, 9], None, 100) for _ in range(4)]
        for f in twins:
            f.result()
    for _ in range(24):  # a block or two at a time: some copies of a hash go while others stay
        run.engine.complete(tokens(rng, 40))
        run.wait_fresh()
        outlived = max(outlived, run.truth.stats()["held_after_a_copy_was_removed"])
    stats = run.truth.stats()
    print(f"view equals the engine: {stats}; most hashes held after a copy was removed at a check: {outlived}")
    assert stats["clears"] >= 1 and stats["removes"] > 0 and stats["stored_twice"] > 0, stats


def test_an_engine_restart_drops_the_old_run_and_predictions_hold_with_xxhash(run) -> None:
    run.engine.complete(tokens(random.Random(6), 130))  # the run to be dropped holds these blocks at least
    run.wait_fresh()
    run.stored_before = run.truth.ever_stored()
    assert run.held_in_view(run.stored_before), "the first run left nothing in the view to drop"
    run.engine.kill()
    run.truth.close()
    run.start_engine("xxhash")
    prompt = tokens(random.Random(3), 100)
    assert run.engine.complete(prompt) == 0
    run.wait_fresh()  # the first run's blocks are gone from the view
    assert run.truth.seqs[0] == 0, f"the restarted engine's first batch had seq {run.truth.seqs[0]}"
    figures = predict_and_check(run, prediction_workload(random.Random(4), 20, (None, "tenant-b")))
    print(f"xxhash after a restart: {figures}; engine starts took {[round(s) for s in run.starts]} s")
    assert figures["with_hits"] >= 5, figures


def test_data_parallel_ranks_arrive_as_holders_of_their_own(run) -> None:
    base = free_port_block(4)
    spec = EngineSpec(MODEL_DIR, free_port(), base, base + 2, seed=SEED, block_size=BS, data_parallel_size=2)
    for rank in range(2):
        run.pipeline.start(f"bridge-dp{rank}", "bridge", "--endpoint", f"tcp://127.0.0.1:{base + rank}",
                           "--replay-endpoint", f"tcp://127.0.0.1:{base + 2 + rank}", "--replica", DP_REPLICA)
    truths = [EngineTruth(f"tcp://127.0.0.1:{base + rank}") for rank in range(2)]
    engine = VllmServer(run.python, spec, run.logs / "engine-dp.log")
    try:
        engine.wait_ready()
        rng = random.Random(5)
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(engine.complete, [tokens(rng, rng.randrange(40, 200)) for _ in range(24)]))

        def ranks_fresh():
            """each rank's holder in the view holds exactly what that rank's own socket says it holds"""
            seen = {}
            for rank, truth in enumerate(truths):
                hashes = truth.ever_stored()
                in_view = {h for h in hashes if any((m.replica, m.dp_rank) == (DP_REPLICA, rank)
                                                    for m in run.view.lookup(hashes=[h]))}
                seen[rank] = (len(truth.held()), len(in_view))
                if not truth.held() or in_view != truth.held():
                    return Waiting(held_and_in_view_per_rank=seen)
            return seen

        seen = eventually(ranks_fresh, FRESH_TIMEOUT, run.pipeline)
        print(f"data parallel: (held, in the view) per rank {seen}")
        listed = ViewClient(run.pipeline.settings.redis_url, run.prefix).summary()
        assert {f"{DP_REPLICA}#0", f"{DP_REPLICA}#1"} <= set(listed), listed
    finally:
        engine.kill()
        for truth in truths:
            truth.close()


def test_a_stopped_engine_expires_from_the_view(run) -> None:
    run.engine.kill()
    sink = next(c for c in run.pipeline.children.started if c.name == "sink")
    run.pipeline.children.stop(sink)
    run.pipeline.children.started.remove(sink)
    run.pipeline.start("sink-expiring", "sink", *sink.args[1:], "--stale-after", "5", "--expire-every", "1")
    started = time.monotonic()

    def gone():
        """the stopped engine's holder is gone from the view"""
        left = ViewClient(run.pipeline.settings.redis_url, run.prefix).summary()
        return REPLICA not in left or Waiting(left=left)

    eventually(gone, 120, run.pipeline)
    print(f"holder expired {time.monotonic() - started:.1f}s after the sink with --stale-after 5 started")
