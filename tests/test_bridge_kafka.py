"""Bridge against the real stack: Kafka + schema registry (integration).

The bridge runs as its own process (``python -m kvbus bridge``) against an
in-process synthetic engine; what it wrote is read back with a plain confluent
Consumer and the registry's AvroDeserializer (not kvbus's RecordSerde).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from typing import Callable

import msgspec
import pytest
from confluent_kafka import Consumer
from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroDeserializer
from confluent_kafka.serialization import MessageField, SerializationContext

from kvbus.producers.recovery import partition_for
from kvbus.producers.sequencer import REASON_ENGINE_RESTART
from kvbus.runtime.settings import Settings
from kvbus.schemas.events import BlockStored, holder_key, without_tokens
from kvbus.simulator.engine_wire import FORMATS, project
from kvbus.simulator.fleet import Fleet, FleetConfig
from tests.private_kafka import PrivateKafka
from tests.waiting import eventually

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

REPLICA = "replica-0"
FMT = "vllm-0.33"
ZMQ_TOPIC = "kv@replica-0@model"


def wait_for(cond: Callable[[], bool], timeout: float = 30.0, what: str = "condition") -> None:
    eventually(cond, timeout, what=what, interval=0.05)


class RawReader:
    """Reads a topic from the beginning with a plain Consumer + AvroDeserializer (dicts)."""

    def __init__(self, settings: Settings, topic: str) -> None:
        self.topic = topic
        self.consumer = Consumer({
            "bootstrap.servers": settings.bootstrap, "group.id": f"test-{uuid.uuid4().hex}",
            "auto.offset.reset": "earliest", "enable.auto.commit": False,
        })
        self.consumer.subscribe([topic])
        # A plain client as an analytics consumer would configure it (confluent's default
        # subject-name strategy), with a request timeout so a registry stall is retried, not hung on.
        self.deser = AvroDeserializer(SchemaRegistryClient({"url": settings.registry_url, "timeout": 10}))
        self.records: list[tuple[int, int, bytes, dict]] = []  # (partition, offset, key, value)

    def poll(self, seconds: float = 0.5) -> None:
        for msg in self.consumer.consume(1000, timeout=seconds):
            assert msg.error() is None, msg.error()
            value = self.deser(msg.value(), SerializationContext(self.topic, MessageField.VALUE))
            self.records.append((msg.partition(), msg.offset(), msg.key(), value))

    def until(self, cond: Callable[[list[dict]], bool], timeout: float = 60.0, what: str = "records") -> list[dict]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.poll()
            if cond(self.values()):
                return self.values()
        raise AssertionError(f"timed out waiting for {what}; have {len(self.records)} records")

    def values(self) -> list[dict]:
        return [v for *_, v in sorted(self.records, key=lambda r: (r[0], r[1]))]

    def close(self) -> None:
        self.consumer.close()


class BridgeProcess:
    """``python -m kvbus bridge`` with this test's topics; ``endpoint`` None: the
    streams are named by ``--streams`` in ``extra``."""

    def __init__(self, settings: Settings, endpoint: str | None, replay_endpoint: str | None, *extra: str) -> None:
        env = dict(os.environ, KVBUS_BOOTSTRAP=settings.bootstrap, KVBUS_REGISTRY_URL=settings.registry_url,
                   KVBUS_TOPIC_RAW=settings.topics.raw, KVBUS_TOPIC_DLQ=settings.topics.dlq,
                   KVBUS_TOPIC_BLOCKS=settings.topics.blocks, KVBUS_TOPIC_INCOMPLETE=settings.topics.incomplete)
        argv = [sys.executable, "-m", "kvbus", "bridge", "--topic", ZMQ_TOPIC, "--flush-timeout", "10",
                *(["--endpoint", endpoint, "--replica", REPLICA] if endpoint else []), *extra]
        if replay_endpoint:
            argv += ["--replay-endpoint", replay_endpoint]
        self.log_path = f"/tmp/kvbus-test-bridge-{uuid.uuid4().hex[:8]}.log"
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(argv, env=env, stdout=self._log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Until the bridge has subscribed (its log says so)."""
        wait_for(lambda: b"SUB tcp://" in open(self.log_path, "rb").read() or self.proc.poll() is not None,
                 timeout, "bridge start")
        assert self.proc.poll() is None, self.output()
        time.sleep(0.3)

    def output(self) -> str:
        return open(self.log_path, "rb").read().decode(errors="replace")

    def terminate(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        rc = self.proc.wait(timeout=30)
        self._log.close()
        return rc

    def kill(self) -> None:
        self.proc.kill()  # SIGKILL: no flush, no goodbye
        self.proc.wait(timeout=10)
        self._log.close()


@pytest.fixture
def fleet():
    f = Fleet(FleetConfig(replicas=1, base_port=0, format=FMT, topic=ZMQ_TOPIC, seed=3)).start()
    yield f
    f.stop()


def _data(values: list[dict]) -> list[dict]:
    return [v for v in values if v["seq"] >= 0]


def test_bridge_records_read_back_field_for_field(test_settings: Settings, fleet: Fleet):
    stream = fleet.streams()[0]
    pub = fleet.publisher(REPLICA)
    model = fleet.models[(REPLICA, 0)]
    sent = []
    for i in range(3):  # published before the bridge connects: only replay can deliver them
        evs = model.step()
        pub.publish(evs, ts=1_750_000_000.0 + i)
        sent.append(evs)
    bridge = BridgeProcess(test_settings, stream.endpoint, stream.replay_endpoint)
    reader = RawReader(test_settings, test_settings.topics.raw)
    try:
        bridge.wait_ready()
        for i in range(3, 25):
            evs = model.step()
            pub.publish(evs, ts=1_750_000_000.0 + i)
            sent.append(evs)
        values = reader.until(lambda vs: len(vs) >= 25, what="25 records")
        assert bridge.terminate() == 0, bridge.output()
        reader.poll(1.0)
        values = reader.values()
    finally:
        reader.close()
        if bridge.proc.poll() is None:
            bridge.kill()
    assert len(values) == 25 and all(v["seq"] >= 0 for v in values)
    epoch = values[0]["epoch"]
    assert epoch > 1_700_000_000_000
    for i, (v, evs) in enumerate(zip(values, sent)):
        header = ("replica", "dp_rank", "worker_rank", "workers", "engine", "epoch", "seq", "ts", "topic")
        assert {k: v[k] for k in header} == {
            "replica": REPLICA, "dp_rank": 0, "worker_rank": 0, "workers": 1, "engine": "vllm", "epoch": epoch,
            "seq": i, "ts": 1_750_000_000.0 + i, "topic": ZMQ_TOPIC,
        }
        assert v["events"] == [msgspec.structs.asdict(without_tokens(project(FMT, e))) for e in evs]
    # the engine's batches carried the prompts' tokens; by default none reaches the topic
    assert any(e.token_ids for evs in sent for e in evs if type(e).__name__ == "BlockStored")
    assert not [e for v in values for e in v["events"] if e.get("token_ids") or e.get("lookahead_token_ids")
                or e.get("token_id_pairs")]
    # every record sits in the partition the Java/murmur2 partitioner picks for its key
    key = holder_key(REPLICA, 0).encode()
    assert {(p, k) for p, _, k, _ in reader.records} == {(partition_for(key, test_settings.partitions), key)}


def test_killed_bridge_restarts_without_losing_what_the_engine_buffered(test_settings: Settings, fleet: Fleet):
    stream = fleet.streams()[0]
    pub = fleet.publisher(REPLICA)

    def publish(n: int) -> None:
        for _ in range(n):
            i = pub.next_seq
            pub.publish([BlockStored(block_hashes=[(i + 1).to_bytes(8, "big")], token_ids=list(range(16)),
                                     block_size=16, medium="GPU")], ts=1000.0 + i)

    reader = RawReader(test_settings, test_settings.topics.raw)
    first = BridgeProcess(test_settings, stream.endpoint, stream.replay_endpoint)
    try:
        first.wait_ready()
        publish(10)
        reader.until(lambda vs: len(_data(vs)) >= 10, what="10 records from the first bridge")
        first.kill()
        publish(15)  # while no bridge runs: only the engine's replay buffer has them
        second = BridgeProcess(test_settings, stream.endpoint, stream.replay_endpoint)
        second.wait_ready()
        publish(5)
        values = reader.until(lambda vs: len(_data(vs)) >= 30, what="30 records")
        assert "recovered" in second.output() and "seq 9" in second.output()
        assert second.terminate() == 0, second.output()
        reader.poll(1.0)
        values = reader.values()
        assert [v["seq"] for v in values] == list(range(30))  # in order, nothing lost, no duplicate
        assert len({v["epoch"] for v in values}) == 1  # the restarted bridge resumed the epoch
        assert [v["ts"] for v in values] == [1000.0 + i for i in range(30)]

        # the engine restarts while no bridge runs: the next bridge announces it
        pub.restart()
        publish(3)
        third = BridgeProcess(test_settings, stream.endpoint, stream.replay_endpoint)
        third.wait_ready()
        publish(1)
        values = reader.until(lambda vs: len(vs) >= 30 + 1 + 4, what="reset + 4 records")
        assert third.terminate() == 0, third.output()
        tail = values[30:]
        assert tail[0]["seq"] == -1 and tail[0]["events"] == [
            {"reason": REASON_ENGINE_RESTART, "missing_from": None, "missing_to": None}]
        assert tail[0]["epoch"] > values[0]["epoch"]
        assert [v["seq"] for v in tail[1:]] == [0, 1, 2, 3]
        assert {v["epoch"] for v in tail} == {tail[0]["epoch"]}
    finally:
        reader.close()
        for b in ("first", "second", "third"):
            proc = locals().get(b)
            if proc is not None and proc.proc.poll() is None:
                proc.kill()


def test_one_bridge_serves_several_streams_each_with_its_own_key_sequence_and_recovery(
        test_settings: Settings, tmp_path):
    """``--streams``: three engines, one bridge process. Each stream's records carry its own key, in
    its own partition, numbered by its own sequence in its own epoch; killed and restarted, the
    bridge recovers each stream's position on its own and replays what each engine buffered."""
    fleet = Fleet(FleetConfig(replicas=3, base_port=0, format=FMT, topic=ZMQ_TOPIC, seed=5)).start()
    streams = tmp_path / "streams.json"
    streams.write_text(json.dumps([{"endpoint": s.endpoint, "replay_endpoint": s.replay_endpoint,
                                    "replica": s.replica} for s in fleet.streams()]))
    names = fleet.names
    seqs = {name: 0 for name in names}

    def publish(n: int, skip: str | None = None) -> None:
        for _ in range(n):
            for k, name in enumerate(names):
                if name == skip:
                    continue
                pub = fleet.publisher(name)
                i = pub.next_seq
                pub.publish([BlockStored(block_hashes=[(1000 * k + i + 1).to_bytes(8, "big")],
                                         token_ids=list(range(16)), block_size=16, medium="GPU")], ts=1000.0 + i)
                seqs[name] = pub.next_seq

    def per_stream(values: list[dict]) -> dict[str, list[dict]]:
        return {name: [v for v in _data(values) if v["replica"] == name] for name in names}

    reader = RawReader(test_settings, test_settings.topics.raw)
    first = second = None
    try:
        first = BridgeProcess(test_settings, None, None, "--streams", str(streams))
        first.wait_ready()
        publish(8)
        reader.until(lambda vs: all(len(r) >= 8 for r in per_stream(vs).values()), what="8 records of each stream")
        first.kill()
        publish(6, skip=names[2])  # while no bridge runs; replica-2 stays quiet
        second = BridgeProcess(test_settings, None, None, "--streams", str(streams))
        second.wait_ready()
        publish(3)
        want = {name: seqs[name] for name in names}
        reader.until(lambda vs: {n: len(r) for n, r in per_stream(vs).items()} == want,
                     what=f"records of each stream: {want}")
        assert second.terminate() == 0, second.output()
        reader.poll(1.0)
        values = reader.values()
    finally:
        reader.close()
        fleet.stop()
        for proc in (first, second):
            if proc is not None and proc.proc.poll() is None:
                proc.kill()
    got = per_stream(values)
    assert {n: [v["seq"] for v in r] for n, r in got.items()} == {n: list(range(seqs[n])) for n in names}
    assert all(len({v["epoch"] for v in r}) == 1 for r in got.values())  # each resumed its epoch
    assert not [v for v in values if v["seq"] < 0]  # no reset: every gap was replayed
    assert {(v["replica"], v["events"][0]["block_hashes"][0]) for v in values} == {
        (name, (1000 * k + i + 1).to_bytes(8, "big")) for k, name in enumerate(names) for i in range(seqs[name])}
    for p, _, key, v in reader.records:
        assert key == holder_key(v["replica"], 0).encode() and p == partition_for(key, test_settings.partitions)


def test_bad_input_lands_in_the_dlq_topic(test_settings: Settings, fleet: Fleet):
    stream = fleet.streams()[0]
    pub = fleet.publisher(REPLICA)
    bridge = BridgeProcess(test_settings, stream.endpoint, None, "--no-recover")
    dlq = RawReader(test_settings, test_settings.topics.dlq)
    raw = RawReader(test_settings, test_settings.topics.raw)
    try:
        bridge.wait_ready()
        # probe until the subscription is live (no replay endpoint here)
        wait_for(lambda: (pub.publish([BlockStored(block_hashes=[b"\0" * 8], block_size=16)]) >= 0
                          and (raw.poll(0.2) or True) and len(raw.records) > 0), 30, "first record")
        pub.send_raw([ZMQ_TOPIC.encode(), b"short"])  # 2 frames
        pub.publish_payload(b"\x93\xcb\x00")  # truncated msgpack
        values = dlq.until(lambda vs: len(vs) >= 2, what="2 dead letters")
        assert bridge.terminate() == 0
    finally:
        dlq.close()
        raw.close()
        if bridge.proc.poll() is None:
            bridge.kill()
    assert [v["stage"] for v in values] == ["bridge", "bridge"]
    assert {v["source"] for v in values} == {stream.endpoint}
    assert values[0]["payload"] == [ZMQ_TOPIC.encode(), b"short"] and "3 frames" in values[0]["reason"]
    assert values[1]["payload"][2] == b"\x93\xcb\x00" and values[1]["reason"].startswith("DecodeError")
    assert {k for p, o, k, v in dlq.records} == {stream.endpoint.encode()}


# -- Kafka outage: a private single-node broker this test can stop and start -------------

def test_bridge_rides_out_a_kafka_outage(stack: Settings, tmp_path, monkeypatch, fleet: Fleet):
    """Kafka dies mid-stream: the engine is never slowed, the bridge holds what it can
    (librdkafka queue, then its backlog), sheds the rest, and once Kafka is back recovers
    the shed batches from the engine's replay buffer: every batch lands, in order, once."""
    from kvbus.infra.dev_topics import ensure_topics
    from kvbus.schemas.topics import Topics

    kafka = PrivateKafka(tmp_path / "kafka-state", monkeypatch)
    bridge = None
    try:
        kafka.up()
        sfx = uuid.uuid4().hex[:8]
        topics = Topics(raw=f"out{sfx}.raw", dlq=f"out{sfx}.dlq", blocks=f"out{sfx}.blocks",
                        incomplete=f"out{sfx}.incomplete")
        ensure_topics(kafka.bootstrap, [topics.raw, topics.dlq], 4, 1)
        settings = Settings(bootstrap=kafka.bootstrap, registry_url=stack.registry_url, topics=topics)
        stream = fleet.streams()[0]
        bridge = BridgeProcess(settings, stream.endpoint, stream.replay_endpoint, "--max-backlog", "300",
                               "--producer-conf", "queue.buffering.max.messages=200", "--no-recover")
        bridge.wait_ready()

        def run(seconds: float, rate: float = 200.0) -> float:
            """Publish steps for ``seconds``; returns the slowest publish_step in seconds."""
            worst, end = 0.0, time.monotonic() + seconds
            while time.monotonic() < end:
                t = time.perf_counter()
                fleet.publish_step()
                worst = max(worst, time.perf_counter() - t)
                time.sleep(max(0.0, 1 / rate - (time.perf_counter() - t)))
            return worst

        run(2)
        kafka.kill()
        worst = run(6)  # Kafka down: ~1200 batches, more than queue + backlog hold
        assert worst < 0.5  # the engine side never waits for Kafka
        kafka.up()
        run(2)
        total = fleet.publisher(REPLICA).next_seq
        reader = RawReader(settings, topics.raw)
        try:
            values = reader.until(lambda vs: len(_data(vs)) >= total, timeout=90, what=f"{total} records")
        finally:
            reader.close()
        assert bridge.terminate() == 0, bridge.output()
        out = bridge.output()
        assert "shedding live batches" in out and "accepting live batches again" in out
        assert [v["seq"] for v in values] == list(range(total))  # nothing lost, nothing twice, in order
        assert len({v["epoch"] for v in values}) == 1
    finally:
        if bridge is not None and bridge.proc.poll() is None:
            bridge.kill()
        kafka.kill()


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_engine_format_read_back_field_for_field(test_settings: Settings, fmt: str):
    """Each supported engine/version: the fleet publishes in that wire format, the bridge decodes
    and produces it, and a plain registry-aware consumer reads back the normalized events."""
    engine = "sglang" if fmt.startswith("sglang") else "auto"
    fleet = Fleet(FleetConfig(replicas=1, base_port=0, format=fmt, topic=ZMQ_TOPIC, seed=5)).start()
    stream = fleet.streams()[0]
    model, pub = fleet.models[(REPLICA, 0)], fleet.publisher(REPLICA)
    bridge = BridgeProcess(test_settings, stream.endpoint, stream.replay_endpoint, "--engine", engine,
                           "--keep-token-ids")  # every field as the engine sent it
    reader = RawReader(test_settings, test_settings.topics.raw)
    sent = []
    try:
        bridge.wait_ready()
        while len(sent) < 6:
            evs = model.step()
            if evs:
                pub.publish(evs, ts=1_750_000_000.0 + len(sent))
                sent.append(evs)
        values = _data(reader.until(lambda vs: len(_data(vs)) >= len(sent), what=f"{len(sent)} records"))
    finally:
        reader.close()
        if bridge.proc.poll() is None:
            bridge.kill()
        fleet.stop()
    assert [v["seq"] for v in values] == list(range(len(sent)))
    assert {v["engine"] for v in values} == {"sglang" if engine == "sglang" else "vllm"}
    for v, evs in zip(values, sent):
        assert v["events"] == [msgspec.structs.asdict(project(fmt, e)) for e in evs]
