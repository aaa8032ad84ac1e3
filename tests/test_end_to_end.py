"""The walking skeleton on the real stack: a fleet publishes a known sequence of events,
bridges -> Kafka -> Faust worker -> Kafka -> sink -> Redis, and the view and
``kvbus lookup --json`` give exactly the expected answer; the view once on the stack's Redis and once
on a Valkey 9.1 (a private valkey-server)."""
from __future__ import annotations

import uuid
from dataclasses import replace

import pytest

from kvbus.infra.scratch_redis import VALKEY, RedisServer
from kvbus.schemas.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvbus.schemas.hashing import block_hashes
from kvbus.simulator.fleet import Fleet, FleetConfig, ScriptBatch
from tests.pipeline import Pipeline, eventually

pytestmark = pytest.mark.integration

BS = 16
PROMPT = list(range(1, 4 * BS + 1))          # 4 blocks
HASHES = block_hashes(PROMPT, BS)             # what vLLM publishes for it


def stored(first: int, last: int, medium: str = "GPU", ownership: str | None = None) -> BlockStored:
    """BlockStored of PROMPT's blocks first..last (inclusive), chained to the block before."""
    return BlockStored(
        block_hashes=HASHES[first:last + 1],
        parent_block_hash=HASHES[first - 1] if first else None,
        token_ids=PROMPT[first * BS:(last + 1) * BS], block_size=BS, medium=medium, ownership=ownership,
    )


SCRIPT = [
    # replica-0 caches the whole prompt on GPU, then evicts block 3
    ScriptBatch("replica-0", [stored(0, 1)]),
    ScriptBatch("replica-0", [stored(2, 3)]),
    ScriptBatch("replica-0", [BlockRemoved(block_hashes=[HASHES[3]], medium="GPU")]),
    # replica-1 caches 2 blocks on GPU and all 4 on CPU (offload), plus a kvcr tier copy
    ScriptBatch("replica-1", [stored(0, 1), stored(0, 3, "CPU")]),
    ScriptBatch("replica-1", [stored(0, 3, "CPU", ownership="kvcr")]),
    # replica-2 caches everything, then its prefix cache is reset
    ScriptBatch("replica-2", [stored(0, 3)]),
    ScriptBatch("replica-2", [AllBlocksCleared()]),
]


@pytest.fixture(scope="module")
def valkey():
    with RedisServer(kind=VALKEY) as srv:
        yield srv


@pytest.fixture(params=["redis", "valkey"])
def pipeline(request, test_settings, tmp_path):
    """The pipeline's processes, writing the view on the stack's Redis or on a Valkey."""
    settings = test_settings
    if request.param == "valkey":
        settings = replace(test_settings, redis_url=request.getfixturevalue("valkey").url)
    p = Pipeline(settings, tmp_path)
    yield p
    p.stop()


def test_known_sequence_gives_exact_view_and_lookup(pipeline, tmp_path) -> None:
    run = uuid.uuid4().hex[:8]
    prefix = f"e2e{run}:"
    fleet = Fleet(FleetConfig(replicas=3, base_port=0, format="vllm-0.33")).start()
    try:
        pipeline.start("sink", "sink", "--group", f"sink-{run}", "--prefix", prefix)
        pipeline.start("worker", "worker", "--app-id", f"streams-{run}", "--workdir", str(tmp_path))
        for s in fleet.streams():
            pipeline.start(f"bridge-{s.replica}", "bridge", "--endpoint", s.endpoint,
                           "--replay-endpoint", s.replay_endpoint, "--replica", s.replica)
        fleet.play(SCRIPT)

        hashes = ",".join(str(int.from_bytes(h, "big")) for h in HASHES)
        expected = {
            "replica-0": {"matched": 3, "tiers": {"GPU": 3}},
            "replica-1": {"matched": 4, "tiers": {"GPU": 2, "CPU": 4, "CPU@kvcr": 4}},
        }

        def answer():
            got = pipeline.lookup_json("--hashes", hashes, "--prefix", prefix, check=False)
            if isinstance(got, str):  # the sink has not loaded the view's functions yet
                return None
            seen = {k: {"matched": v["matched"], "tiers": v["tiers"]} for k, v in got.items()}
            return got if seen == expected else None

        got = eventually(answer, 120, pipeline)
        assert set(got) == {"replica-0", "replica-1"}
        # the same answer from the prompt's tokens, hashed as vLLM does
        by_tokens = pipeline.lookup_json("--tokens", ",".join(map(str, PROMPT)), "--block-size", str(BS),
                                         "--prefix", prefix)
        assert by_tokens == got

        from kvbus.client import ViewClient

        assert ViewClient(pipeline.settings.redis_url, prefix).summary() == {
            "replica-0": {"GPU": 3},
            "replica-1": {"GPU": 2, "CPU": 4, "CPU@kvcr": 4},
        }
    finally:
        fleet.stop()
