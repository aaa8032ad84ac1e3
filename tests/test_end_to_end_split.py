"""Split batches end to end on the real stack: engine batches larger than the record limit (set
small here) are produced as several raw records by both producer paths, and every event still
reaches ``kvbus.blocks`` exactly once, in order, at its position in its engine batch.

* replica ``split-0`` runs tensor-parallel (2 workers): each worker's bridge splits the same
  batches at different points (``--max-record-bytes`` 2000 and 3500), the Faust worker pairs the
  parts' reports;
* replica ``pub-0`` publishes in process (``KafkaEventPublisher``, limit 2000), one worker; one of
  its events is too large for any record and lands in the DLQ instead (truncated), counted.
"""
from __future__ import annotations

import uuid
from collections import defaultdict
from dataclasses import replace

import pytest

from kvbus.producers.publisher import KafkaEventPublisher
from kvbus.schemas.codec import encode_event
from kvbus.schemas.events import DLQ_PAYLOAD_BYTES, BlockRemoved, BlockStored, Reset
from kvbus.simulator.engine_wire import project
from kvbus.simulator.fleet import Fleet, FleetConfig
from tests.pipeline import Pipeline
from tests.test_end_to_end_tp import read_topics

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

FMT = "vllm-0.33"
TP_REPLICA, PUB_REPLICA = "split-0", "pub-0"
LIMITS = {0: 2000, 1: 3500}
STEPS = 5


def step_events(replica: int, step: int, n: int = 8, tokens: int = 200) -> list:
    """``n`` events of ~600 bytes each (token ids of 3 bytes): one batch is several records."""
    evs: list = []
    for i in range(n):
        h = (replica * 10**6 + step * 100 + i).to_bytes(8, "big")
        if i % 4 == 3:
            evs.append(BlockRemoved(block_hashes=[h], medium="GPU"))
        else:
            evs.append(BlockStored(block_hashes=[h], token_ids=[100_000 + step + i] * tokens, block_size=tokens,
                                   medium="GPU"))
    return evs


def test_split_batches_reach_blocks_exactly_once_in_order(test_settings, tmp_path) -> None:
    run = uuid.uuid4().hex[:8]
    topics = test_settings.topics
    pipeline = Pipeline(test_settings, tmp_path)
    fleet = Fleet(FleetConfig(replicas=1, workers=2, base_port=0, format=FMT, replica_prefix="split-")).start()
    pub = None
    try:
        pipeline.start("worker", "worker", "--app-id", f"split-{run}", "--workdir", str(tmp_path), "--window", "30")
        for s in fleet.streams():
            pipeline.start(f"bridge-{s.worker_rank}", "bridge", "--endpoint", s.endpoint, "--replay-endpoint",
                           s.replay_endpoint, "--replica", s.replica, "--worker-rank", str(s.worker_rank),
                           "--workers", "2", "--max-record-bytes", str(LIMITS[s.worker_rank]),
                           "--keep-token-ids")  # the prompts' tokens make the batches this large
        pub = KafkaEventPublisher(replica=PUB_REPLICA, settings=replace(test_settings, keep_token_ids=True),
                                  max_record_bytes=2000)

        expected: dict[str, list[tuple[int, int, object]]] = defaultdict(list)  # holder -> (seq, index, event)
        oversized = None
        for step in range(STEPS):
            evs = step_events(0, step)
            for w in range(2):  # both workers report the same batch; their bridges split it differently
                fleet.publisher(TP_REPLICA, 0, w).publish(evs, ts=1_750_000_000.0 + step)
            expected[f"{TP_REPLICA}#0"] += [(step, i, project(FMT, e)) for i, e in enumerate(evs)]

            pevs = step_events(1, step)
            if step == 2:  # an event no record can carry: dead-lettered, its neighbours produced
                pevs.insert(3, BlockStored(block_hashes=[b"\xee" * 8], token_ids=[100_000] * 30_000, block_size=16))
                oversized = pevs[3]
            pub.publish(_Batch(1_750_000_000.0 + step, pevs))
            expected[f"{PUB_REPLICA}#0"] += [(step, i, e) for i, e in enumerate(pevs) if (step, i) != (2, 3)]
        assert pub.flush(30) == 0

        n_expected = sum(len(v) for v in expected.values())
        got = read_topics(test_settings, topics.blocks_pattern(), "BlockEvent", n_expected + 1, 150)
        by_holder: dict[str, list] = defaultdict(list)
        positions: dict[str, list] = defaultdict(list)
        for be in got:
            key = f"{be.replica}#{be.dp_rank}"
            positions[key].append(be.position)
            if not isinstance(be.event, Reset):
                by_holder[key].append((be.seq, be.index, be.event))
        assert dict(by_holder) == dict(expected)  # every event exactly once, in order, at its index
        for key, pos in positions.items():
            assert pos == sorted(set(pos)), f"{key}: positions must strictly grow"

        # the raw topic shows that every producer did split: several records per seq, first_index > 0
        raw = read_topics(test_settings, topics.raw, "EventBatch", 10**9, 15)  # all there is, for 15 s
        parts: dict[tuple[str, int], set] = defaultdict(set)
        for b in raw:
            if b.seq >= 0:
                parts[(b.replica, b.worker_rank)].add((b.seq, b.first_index))
        for producer in ((TP_REPLICA, 0), (TP_REPLICA, 1), (PUB_REPLICA, 0)):
            assert len(parts[producer]) > STEPS and any(fi > 0 for _, fi in parts[producer]), producer
        assert parts[(TP_REPLICA, 0)] != parts[(TP_REPLICA, 1)]  # the two bridges cut differently

        [dl] = read_topics(test_settings, topics.dlq, "DeadLetter", 1, 30)
        avro = encode_event(oversized)
        assert (dl.stage, dl.source) == ("publisher", f"{PUB_REPLICA}#0")
        assert "index 3" in dl.reason and "seq 2" in dl.reason and dl.payload == [avro[:DLQ_PAYLOAD_BYTES]]
        assert pub.metrics.value("oversized_events") == 1 and pub.metrics.value("split_batches") == STEPS
        pipeline.check_alive()
    finally:
        if pub is not None:
            pub.shutdown(5)
        pipeline.stop()
        fleet.stop()


class _Batch:
    """What an engine hands the publisher (ts, events)."""

    def __init__(self, ts: float, events: list) -> None:
        self.ts, self.events = ts, events
