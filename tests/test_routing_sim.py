"""The routing benchmark's simulation (benchmarks/routing.py): the request stream, the policy, the oracle,
the scoring, and the one question it asks the view (against a real Redis view)."""
from __future__ import annotations

import argparse
import itertools
import sys
import time
import uuid
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import routing  # noqa: E402  (benchmarks/routing.py)
from kvbus.client import ViewClient
from kvbus.infra.scratch_redis import RedisServer  # noqa: E402
from kvbus.schemas.events import BlockEvent  # noqa: E402
from kvbus.schemas.hashing import block_hashes  # noqa: E402
from kvbus.simulator.engine_wire import project  # noqa: E402
from kvbus.simulator.fleet import Fleet  # noqa: E402
from kvbus.sinks.view.redis_store import RedisStore  # noqa: E402

pytestmark = pytest.mark.timeout(60)

S = list(range(1, 33))
"""A system prompt of two full blocks."""


def req(session: int, turn: int, prompt: list[int], reply: list[int]) -> routing.Request:
    return routing.Request(session, turn, prompt, reply, block_hashes(prompt, 16))


def tiny_stream() -> list[routing.Request]:
    """Two conversations over S; the first one's second turn extends its first prompt and reply."""
    first = req(0, 0, S + [100] * 16, [101] * 16)  # 3 prompt blocks, 4 cached with the reply
    other = req(1, 0, S + [200] * 16, [201] * 16)
    second = req(0, 1, first.prompt + first.reply + [102] * 16, [103] * 8)  # 5 prompt blocks
    return [first, other, second]


def test_the_benchmark_routes_with_the_clients_policy():
    """routing.py has no policy of its own (its ``pick`` is gone): kvbus.client.routing.choose decides."""
    from kvbus.client import routing as client_routing

    assert not hasattr(routing, "pick") and routing.choose is client_routing.choose
    assert routing.parse_args([]).beta == client_routing.DEFAULT_BETA
    assert routing.rotation(["a", "b", "c"], 4) == ["b", "c", "a"]


@pytest.mark.parametrize("router, beta, gpu_blocks, choices, reused", [
    ("oracle", 0.0, 512, "000", [0, 32, 64]),  # all three to replica-0: S, then the first turn's 4 blocks
    ("oracle", 1.0, 512, "010", [0, 0, 64]),  # 2 of 3 blocks held < 1.0 x replica-0's relative load 1: replica-1
    ("oracle", 0.0, 4, "000", [0, 32, 32]),  # 4 blocks: storing `other` evicted the first turn's own blocks
    ("round_robin", 0.0, 512, "010", [0, 0, 64]),
])
def test_tiny_stream_reuses_what_the_chosen_engine_held(router, beta, gpu_blocks, choices, reused):
    w = routing.Workload(gpu_blocks=gpu_blocks)
    reqs = tiny_stream()
    want = [f"replica-{c}" for c in choices]
    for scored in range(len(reqs)):  # the warm-up follows the choices given; the rest is the router's
        t, got = routing.simulate(reqs, router, w, 2, window=4, beta=beta, warm_choices=want[:scored])
        assert got == want and t.requests == len(reqs) - scored
        assert t.reused_tokens == sum(reused[scored:])
        assert t.prompt_tokens == sum(len(r.prompt) for r in reqs[scored:])


def test_warm_up_goes_where_it_is_told_and_the_router_takes_over_after_it():
    w = routing.Workload()
    t, got = routing.simulate(tiny_stream(), "oracle", w, 2, window=4, beta=0.0, warm_choices=["replica-1"])
    assert got == ["replica-1"] * 3 and t.reused_tokens == 32 + 64  # the oracle follows its prefixes to replica-1


def test_reuse_counts_the_prompt_only_and_share_is_against_the_oracle():
    w = routing.Workload()
    again = tiny_stream()[0]
    t, _ = routing.simulate([again, again], "round_robin", w, 1, window=4, beta=0.5)
    assert t.reused_tokens == 48  # the second time all 4 blocks are cached, 3 of them the prompt's
    assert t.figures()["reused_share"] == round(48 / 96, 4)
    assert routing.share(routing.Tally(reused_tokens=99), routing.Tally(reused_tokens=100)) == 0.99
    assert routing.share(routing.Tally(reused_tokens=5), routing.Tally()) is None


def test_the_stream_is_conversations_over_shared_system_prompts():
    w = routing.Workload(sessions=4, max_turns=3, system_prompts=2)
    reqs = list(itertools.islice(routing.requests(w), 200))
    assert reqs == list(itertools.islice(routing.requests(w), 200))  # deterministic
    assert reqs != list(itertools.islice(routing.requests(routing.Workload(sessions=4, max_turns=3, seed=1)), 200))
    last: dict[int, routing.Request] = {}
    starts = set()
    for r in reqs:
        assert r.chain == block_hashes(r.prompt, 16)
        if r.turn == 0:
            assert r.session not in last
            starts.add(tuple(r.chain[:3]))
        else:
            prev = last[r.session]
            assert r.turn == prev.turn + 1 and r.prompt[:len(prev.prompt) + len(prev.reply)] == prev.prompt + prev.reply
            assert r.turn < 3
        last[r.session] = r
    assert len(starts) == 2  # every conversation begins with one of the 2 system prompts
    assert len(last) > 4 and max(r.turn for r in reqs) == 2


def test_the_view_answers_the_router_as_the_oracle_does_once_it_has_every_event():
    w = routing.Workload(gpu_blocks=64)
    models = routing.engines(w, 3)
    reqs = list(itertools.islice(routing.requests(w), 60))
    with RedisServer() as srv:
        store = RedisStore(srv.client(), f"r{uuid.uuid4().hex[:8]}:")
        seq = {n: 0 for n in models}
        removed = 0
        for i, r in enumerate(reqs):
            name = list(models)[i % 3]
            _, events = models[name].admit(r.prompt + r.reply)
            removed += sum(type(e).__name__ == "BlockRemoved" for e in events)
            store.apply([("kvbus.blocks", BlockEvent(replica=name, epoch=1, seq=seq[name], index=j, ts=time.time(),
                                                      event=project("vllm-0.33", e)))
                         for j, e in enumerate(events)])
            seq[name] += 1
        assert removed > 0  # evictions are part of what the view must follow
        answers = [routing.oracle_matches(models, r.chain) for r in reqs]
        assert any(len(a) > 1 for a in answers) and any(a == {} for a in answers)
        with ViewClient(srv.url, store.prefix) as router:
            assert [routing.view_matches(router, r.chain) for r in reqs] == answers


def test_the_kvbus_run_scores_its_choices_against_the_policy_on_the_engines_state():
    """A view that never receives an event: every answer is empty, so kvbus routes least-loaded; the run's
    figures must equal a replay of its requests in process, scored against the oracle's choice on the
    same engines at each step."""
    w = routing.Workload(gpu_blocks=64)
    args = argparse.Namespace(seconds=1.5, warmup=0.2, window=10, beta=0.5, probe_every=0.0, block_size=16)
    with RedisServer() as srv, Fleet(routing.fleet_config(w, 3)) as fleet:
        view = RedisStore(srv.client(), f"r{uuid.uuid4().hex[:8]}:")
        with ViewClient(srv.url, view.prefix) as router:
            played, choices, warm, tally, ctx, _ = routing.play_kvbus(fleet, view, router, routing.requests(w), args,
                                                                      rate=1e6)
    assert 0 < warm < len(played)
    models = routing.engines(w, 3)
    names = list(models)
    flight = routing.InFlight(names, 10)
    want, ideal, differ, behind = routing.Tally(), 0, 0, 0
    for i, r in enumerate(played):
        order = routing.rotation(names, i)
        truth = routing.oracle_matches(models, r.chain)
        n = len(r.chain)
        choice, best = routing.choose(n, {}, flight.load, order, 0.5), routing.choose(n, truth, flight.load, order, 0.5)
        assert choices[i] == choice
        reused, events = models[choice].admit(r.prompt + r.reply)
        flight.add(choice)
        if i >= warm:
            want.add(r, reused, len(events), 16)
            ideal += truth.get(best, 0) * 16
            differ += choice != best
            behind += bool(truth)
    assert tally == want and ctx.lookups == want.requests
    assert ctx.ideal_reused_tokens == ideal > tally.reused_tokens
    assert ctx.choices_differ == differ > 0 and ctx.answers_behind == behind > 0 and ctx.answers_ahead == 0
