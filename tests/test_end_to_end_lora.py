"""A LoRA and salted prompt on the real stack: one fleet replica publishes the chain vLLM 0.33 publishes
for it (its hashes, lora_id, lora_name and event extra keys taken from vLLM's own vectors), another the
same tokens for the base model; bridges -> Kafka -> Faust worker -> Kafka -> sink -> Redis. ``kvbus lookup
--tokens ... --lora-name ... --lora-path ... --cache-salt ...`` finds only the first, the plain lookup only
the second."""
from __future__ import annotations

import uuid

import msgspec
import pytest

from kvbus.schemas.events import BlockStored, canonical_hash
from kvbus.simulator.fleet import Fleet, FleetConfig, ScriptBatch
from tests.pipeline import Pipeline, eventually
from tests.vllm_hash_vectors import ALL, NEWEST, Vector

pytestmark = pytest.mark.integration

LORA = ("sql-adapter", "/adapters/sql-adapter/v1")
SALT = "tenant-a"
SEED = "0"


def vector(lora, salt) -> Vector:
    (v,) = [v for v in ALL if (v.vllm, v.algo, v.seed, v.prompt, v.block_size, v.lora, v.cache_salt)
            == (NEWEST, "sha256", SEED, "B", 16, lora, salt)]
    return v


def published(v: Vector) -> BlockStored:
    """The BlockStored vLLM sends for ``v``'s prompt: its full blocks in one event (block_pool's fields)."""
    n = len(v.hashes)
    return BlockStored(block_hashes=[canonical_hash(h) for h in v.hashes], parent_block_hash=None,
                       token_ids=v.tokens[:n * v.block_size], block_size=v.block_size,
                       lora_id=1 if v.lora else None, medium="GPU", lora_name=v.lora[0] if v.lora else None,
                       extra_keys=msgspec.msgpack.encode(v.event_extra_keys) if v.event_extra_keys else None)


@pytest.fixture
def pipeline(test_settings, tmp_path):
    p = Pipeline(test_settings, tmp_path)
    yield p
    p.stop()


def test_lora_salted_prompt_matches_its_holder_only(pipeline, tmp_path) -> None:
    lora_v, base_v = vector(LORA, SALT), vector(None, None)
    assert lora_v.event_extra_keys[0] == [LORA[0], SALT]  # vLLM's event shape: untagged name and salt
    run = uuid.uuid4().hex[:8]
    prefix = f"lora{run}:"
    fleet = Fleet(FleetConfig(replicas=2, base_port=0, format=f"vllm-{NEWEST.rsplit('.', 1)[0]}")).start()
    try:
        pipeline.start("sink", "sink", "--group", f"sink-{run}", "--prefix", prefix)
        pipeline.start("worker", "worker", "--app-id", f"streams-{run}", "--workdir", str(tmp_path))
        for s in fleet.streams():
            pipeline.start(f"bridge-{s.replica}", "bridge", "--endpoint", s.endpoint,
                           "--replay-endpoint", s.replay_endpoint, "--replica", s.replica)
        fleet.play([ScriptBatch("replica-0", [published(lora_v)]), ScriptBatch("replica-1", [published(base_v)])])

        tokens = ["--tokens", ",".join(map(str, lora_v.tokens)), "--block-size", "16", "--hash-seed", SEED,
                  "--prefix", prefix]
        with_lora = tokens + ["--lora-name", LORA[0], "--lora-path", LORA[1], "--cache-salt", SALT]

        def answer(*argv: str) -> dict | None:
            got = pipeline.lookup_json(*argv, check=False)
            if isinstance(got, str):  # the sink has not loaded the view's functions yet
                return None
            return {name: (m["matched"], m["tiers"]) for name, m in got.items()}

        want = {"lora": {"replica-0": (3, {"GPU": 3})}, "base": {"replica-1": (3, {"GPU": 3})}}
        seen: dict[str, dict | None] = {}

        def arrived() -> bool:
            seen["lora"], seen["base"] = answer(*with_lora), answer(*tokens)
            return seen == want

        try:
            eventually(arrived, 120, pipeline)
        except AssertionError as e:
            raise AssertionError(f"waited for the LoRA lookup to answer {want['lora']} and the plain one "
                                 f"{want['base']}; saw {seen} ({e})") from None
        # the adapter re-pointed at another path, or without the salt: nothing cached
        assert pipeline.lookup_json(*tokens, "--lora-name", LORA[0], "--lora-path", LORA[1] + "-new",
                                    "--cache-salt", SALT) == {}
        assert pipeline.lookup_json(*tokens, "--lora-name", LORA[0], "--lora-path", LORA[1]) == {}
    finally:
        fleet.stop()
