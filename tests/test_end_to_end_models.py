"""Two models serving identical prompts never cross-match, end to end on the real stack.

Both models share a tokenizer and the engines' hash seed, so the same prompt has the same block
hashes on every replica (vLLM does not hash the model name). The pipeline carries each replica's
model from its producer to the view: bridges -> Kafka -> Faust worker -> Kafka -> sink -> Redis.

* ``replica-0`` and ``replica-1`` serve ``llama``: their bridges are told by ``--model`` and by
  ``KVBUS_BRIDGE_MODEL``;
* ``tp-0`` serves ``qwen`` with two tensor-parallel workers (two bridges, ``--model qwen``): the worker
  consolidates their reports, and the consolidated events carry the model;
* ``pub-0`` serves ``qwen`` through the in-process publisher (``model=``);
* ``replica-2``'s bridge names no model: a lookup naming a model never answers it.

Every replica caches the same 4-block prompt; ``kvbus lookup --model`` answers each model's replicas
only, a lookup without a model answers all of them.
"""
from __future__ import annotations

import uuid

import pytest

from kvbus.producers.publisher import KafkaEventPublisher
from kvbus.schemas.events import BlockStored
from kvbus.schemas.hashing import block_hashes
from kvbus.simulator.fleet import Fleet, FleetConfig, ScriptBatch
from tests.pipeline import Pipeline, eventually

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

BS = 16
PROMPT = list(range(1, 4 * BS + 1))
HASHES = block_hashes(PROMPT, BS)  # the same for both models: same tokens, same seed
EVERYONE = {"replica-0", "replica-1", "replica-2", "tp-0", "pub-0"}
BY_MODEL = {"llama": {"replica-0", "replica-1"}, "qwen": {"tp-0", "pub-0"}}


def prompt_cached() -> BlockStored:
    return BlockStored(block_hashes=HASHES, token_ids=PROMPT, block_size=BS, medium="GPU")


class _Batch:
    """What an engine hands the publisher (ts, events)."""

    def __init__(self, ts: float, events: list) -> None:
        self.ts, self.events = ts, events


def test_two_models_with_identical_prompts_never_cross_match(test_settings, tmp_path) -> None:
    run = uuid.uuid4().hex[:8]
    prefix = f"models{run}:"
    pipeline = Pipeline(test_settings, tmp_path)
    plain = Fleet(FleetConfig(replicas=3, base_port=0, format="vllm-0.33")).start()
    tp = Fleet(FleetConfig(replicas=1, workers=2, base_port=0, format="vllm-0.33", replica_prefix="tp-")).start()
    pub = None
    try:
        pipeline.start("sink", "sink", "--group", f"sink-{run}", "--prefix", prefix)
        pipeline.start("worker", "worker", "--app-id", f"models-{run}", "--workdir", str(tmp_path), "--window", "30")
        for s in plain.streams():
            flags = {"replica-0": ["--model", "llama"]}.get(s.replica, [])
            env = {"KVBUS_BRIDGE_MODEL": "llama"} if s.replica == "replica-1" else None
            pipeline.start(f"bridge-{s.replica}", "bridge", "--endpoint", s.endpoint, "--replay-endpoint",
                           s.replay_endpoint, "--replica", s.replica, *flags, env=env)
        for s in tp.streams():
            pipeline.start(f"bridge-{s.replica}-w{s.worker_rank}", "bridge", "--endpoint", s.endpoint,
                           "--replay-endpoint", s.replay_endpoint, "--replica", s.replica, "--worker-rank",
                           str(s.worker_rank), "--workers", "2", "--model", "qwen")
        pub = KafkaEventPublisher(replica="pub-0", settings=test_settings, model="qwen")

        plain.play([ScriptBatch(f"replica-{i}", [prompt_cached()]) for i in range(3)])
        for w in range(2):  # every worker of the replica reports the batch
            tp.publisher("tp-0", 0, w).publish([prompt_cached()])
        pub.publish(_Batch(1_750_000_000.0, [prompt_cached()]))
        assert pub.flush(30) == 0

        hashes = ",".join(str(int.from_bytes(h, "big")) for h in HASHES)

        def lookup(*args: str):
            got = pipeline.lookup_json("--hashes", hashes, "--prefix", prefix, *args, check=False)
            return None if isinstance(got, str) else got  # the sink has not loaded the functions yet

        def everyone():
            got = lookup()
            return got if got is not None and set(got) == EVERYONE else None

        every = eventually(everyone, 150, pipeline)
        assert all(m["matched"] == 4 and m["tiers"] == {"GPU": 4} for m in every.values())
        for model, replicas in BY_MODEL.items():
            got = lookup("--model", model)
            assert set(got) == replicas, f"--model {model}: {sorted(got)}"
            assert {k: every[k] for k in got} == got  # the same answers, the other model's replicas left out
            by_tokens = pipeline.lookup_json("--tokens", ",".join(map(str, PROMPT)), "--block-size", str(BS),
                                             "--prefix", prefix, "--model", model)
            assert by_tokens == got
        assert lookup("--model", "mistral") == {}
        assert set(lookup("--model", "llama", "--replicas", "replica-0,replica-2,tp-0,pub-0")) == {"replica-0"}
        assert set(lookup("--model", "qwen", "--replicas", "replica-0,replica-1,replica-2")) == set()
        pipeline.check_alive()
    finally:
        if pub is not None:
            pub.shutdown(5)
        pipeline.stop()
        plain.stop()
        tp.stop()
