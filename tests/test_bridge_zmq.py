"""Bridge against a real in-process ZMQ engine (kvbus.simulator.fleet), no Kafka.

The sink is the unit seam: a CallbackSink collecting what the bridge would produce.
"""
from __future__ import annotations

import threading
import time
from typing import Callable

import msgspec
import pytest

from kvbus.producers.bridge import Bridge, BridgeConfig
from kvbus.producers.sequencer import REASON_ENGINE_RESTART, REASON_GAP
from kvbus.schemas.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    DeadLetter,
    EventBatch,
    Reset,
    without_tokens,
)
from kvbus.schemas.serde import RecordSerde, registry_client
from kvbus.simulator.engine_wire import project
from kvbus.simulator.fleet import Fleet, FleetConfig, ScriptBatch
from kvbus.simulator.vllm_shapes import VllmBlockRemoved, VllmBlockStored
from tests.callback_sink import CallbackSink
from tests.recording_producer import RecordingProducer
from tests.waiting import eventually

pytestmark = pytest.mark.timeout(60)

REPLICA = "replica-0"


def wait_for(cond: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    eventually(cond, timeout, what=what, interval=0.01)


def h(i: int) -> bytes:
    return i.to_bytes(8, "big")


def stored(i: int, parent: int | None = None, medium: str = "GPU") -> BlockStored:
    return BlockStored(block_hashes=[h(i)], parent_block_hash=None if parent is None else h(parent),
                       token_ids=list(range(i * 16, i * 16 + 16)), block_size=16, medium=medium)


def script_events(n: int) -> list[list]:
    """n batches of varied events."""
    out = []
    for i in range(n):
        evs: list = [stored(i + 1, i if i else None)]
        if i % 3 == 1:
            evs.append(BlockRemoved(block_hashes=[h(i)], medium="GPU"))
        if i % 7 == 6:
            evs.append(AllBlocksCleared())
        out.append(evs)
    return out


class Harness:
    """A fleet of one replica and a bridge running in a thread, collecting its output."""

    def __init__(self, fmt: str = "vllm-0.33", *, replay: bool = True, buffer_steps: int = 10_000,
                 topic: str = "", replay_timeout: float = 1.0, max_held: int = 200_000,
                 model: str | None = None) -> None:
        self.fleet = Fleet(FleetConfig(replicas=1, base_port=0, format=fmt, buffer_steps=buffer_steps, topic=topic))
        self.fleet.start()
        self.stream = self.fleet.streams()[0]
        self.pub = self.fleet.publisher(REPLICA)
        self.batches: list[EventBatch] = []
        self.dead: list[DeadLetter] = []
        self.sink = CallbackSink(self.batches.append, self.dead.append)
        self.cfg = BridgeConfig(endpoint=self.stream.endpoint, replica=REPLICA,
                                replay_endpoint=self.stream.replay_endpoint if replay else None,
                                topic=topic, replay_timeout=replay_timeout, max_held=max_held, model=model)
        self.bridge = Bridge(self.cfg, self.sink)
        self._thread: threading.Thread | None = None

    def start(self) -> "Harness":
        self._thread = threading.Thread(target=self.bridge.run, kwargs={"poll_ms": 10}, daemon=True)
        self._thread.start()
        return self

    def connected(self) -> None:
        """Publish probes until the bridge's subscription is live (slow joiner), then forget them."""
        wait_for(lambda: self.bridge.sub is not None, what="bridge open")
        # the start-up replay is answered quickly; wait until it is done
        wait_for(lambda: not self.bridge.sequencer.replay_pending, what="start-up replay")

    def subscribed(self) -> int:
        """Publish probe batches until one arrives (then the subscription is live: nothing published
        later is lost to the slow joiner); returns how many were published (all arrive: a lost one
        is replayed when a later one reveals the gap)."""
        n, base = 0, len(self.data())
        deadline = time.monotonic() + 10
        while True:
            assert time.monotonic() < deadline, "the bridge never received a probe"
            self.pub.publish([stored(10_000 + n)], ts=999.0)
            n += 1
            try:
                wait_for(lambda: len(self.data()) == base + n, timeout=0.2, what="the probe")
                return n
            except AssertionError:
                continue

    def stop(self) -> None:
        self.bridge.stop()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.bridge.close(1)
        self.fleet.stop()

    def data(self) -> list[EventBatch]:
        return [b for b in self.batches if b.seq >= 0]

    def markers(self) -> list[EventBatch]:
        return [b for b in self.batches if b.seq < 0]


@pytest.fixture
def harness_factory():
    made: list[Harness] = []

    def make(**kw) -> Harness:
        hs = Harness(**kw)
        made.append(hs)
        return hs

    yield make
    for hs in made:
        hs.stop()


def test_batches_published_before_and_after_connect_arrive_in_order(harness_factory):
    """Batches published before the bridge exists arrive through its start-up replay, batches
    published once it is subscribed arrive live; all in order, without markers.

    Between the two, probes are published until one arrives: a SUB socket misses what is published
    before its subscription reaches the PUB (ZMQ's slow joiner), and a batch lost at the very end
    of the stream has no successor to reveal the gap, so publishing the second half right after
    start() could leave it waiting forever (this test did, 1 run in ~20 under load)."""
    hs = harness_factory()
    batches = script_events(12)
    for evs in batches[:5]:  # before the bridge exists: only the replay buffer has them
        hs.pub.publish(evs, ts=1000.0)
    hs.start()
    wait_for(lambda: len(hs.data()) == 5, what="the start-up replay")
    probes = hs.subscribed()
    for evs in batches[5:]:
        hs.pub.publish(evs, ts=1001.0)
    n = 12 + probes
    wait_for(lambda: len(hs.data()) == n, what=f"{n} batches")
    data = hs.data()
    assert [b.seq for b in data] == list(range(n))
    assert hs.markers() == []
    assert len({b.epoch for b in data}) == 1 and data[0].epoch > 0
    for b, evs in zip(data[:5] + data[5 + probes:], batches):
        assert b.events == [without_tokens(project("vllm-0.33", e)) for e in evs]
        assert (b.replica, b.dp_rank, b.worker_rank, b.workers, b.engine, b.topic) == (REPLICA, 0, 0, 1, "vllm", "")
    assert hs.dead == []


@pytest.mark.parametrize("fmt, topic", [("vllm-0.24", ""), ("vllm-0.26", "kv@pod-a@model"), ("sglang-0.5.23", "kv")])
def test_dropped_live_messages_are_replayed_in_order(harness_factory, fmt, topic):
    """Both replay layouts: <= 0.25 replies without the topic frame, >= 0.26 / SGLang 0.5.23 with it."""
    hs = harness_factory(fmt=fmt, topic=topic).start()
    hs.connected()
    batches = script_events(30)
    lost = {3, 4, 5, 11, 20, 21}
    for i, evs in enumerate(batches):
        hs.pub.publish(evs, ts=1000.0 + i, send_live=i not in lost)
    wait_for(lambda: len(hs.data()) == 30, what="30 batches")
    data = hs.data()
    assert [b.seq for b in data] == list(range(30))
    assert hs.markers() == []
    assert [b.ts for b in data] == [1000.0 + i for i in range(30)]
    for b, evs in zip(data, batches):
        assert b.events == [without_tokens(project(fmt, e)) for e in evs]
        assert b.topic == topic
    stats = hs.bridge.sequencer.stats
    assert stats.gaps >= 1 and stats.recovered >= len(lost)


def test_gap_older_than_replay_buffer_gives_reset_marker(harness_factory):
    hs = harness_factory(buffer_steps=5).start()
    hs.connected()
    batches = script_events(12)
    hs.pub.publish(batches[0], ts=1.0)  # seq 0 live
    wait_for(lambda: len(hs.data()) == 1, what="seq 0")
    for i in range(1, 11):  # seq 1..10 lost live
        hs.pub.publish(batches[i], ts=1.0 + i, send_live=False)
    hs.pub.publish(batches[11], ts=12.0)  # seq 11 live -> gap 1..10; the buffer keeps only 7..11
    wait_for(lambda: len(hs.batches) == 1 + 1 + 5, what="reset + 5 batches")
    out = hs.batches
    assert out[0].seq == 0
    marker = out[1]
    assert marker.seq == -1 and marker.events == [Reset(reason=REASON_GAP, missing_from=1, missing_to=6)]
    assert marker.epoch > out[0].epoch
    assert [b.seq for b in out[2:]] == [7, 8, 9, 10, 11]
    assert {b.epoch for b in out[2:]} == {marker.epoch}


def test_gap_without_replay_endpoint_gives_reset_marker(harness_factory):
    hs = harness_factory(replay=False).start()
    wait_for(lambda: hs.bridge.sub is not None)
    # seq 0 may be lost to the slow joiner: probe until the subscription is live
    wait_for(lambda: (hs.pub.publish([stored(1)]) is not None and len(hs.batches) > 0), what="first batch")
    last = hs.pub.next_seq - 1
    hs.pub.publish([stored(2)], send_live=False)
    hs.pub.publish([stored(3)])
    wait_for(lambda: hs.data() and hs.data()[-1].seq == last + 2, what="after gap")
    marker = [m for m in hs.markers() if m.events[0].reason == REASON_GAP][-1]
    assert marker.events[0] == Reset(reason=REASON_GAP, missing_from=last + 1, missing_to=last + 1)


def test_every_record_names_the_model_the_bridge_was_told(harness_factory):
    """Data batches and the bridge's own reset markers carry ``--model``; a bridge told none writes None."""
    told = harness_factory(replay=False, model="meta-llama/Llama-3.1-8B-Instruct").start()
    wait_for(lambda: told.bridge.sub is not None)
    wait_for(lambda: (told.pub.publish([stored(1)]) is not None and len(told.data()) > 0), what="first batch")
    told.pub.publish([stored(2)], send_live=False)  # a gap: the bridge writes a reset marker
    told.pub.publish([stored(3)])
    wait_for(lambda: any(m.events[0].reason == REASON_GAP for m in told.markers()), what="the gap's marker")
    assert told.markers() and {b.model for b in told.batches} == {"meta-llama/Llama-3.1-8B-Instruct"}
    untold = harness_factory(replay=False).start()
    wait_for(lambda: untold.bridge.sub is not None)
    wait_for(lambda: (untold.pub.publish([stored(1)]) is not None and len(untold.data()) > 0), what="first batch")
    assert {b.model for b in untold.batches} == {None}


def test_bridge_model_flag_and_variable():
    import argparse

    from kvbus.producers.cli import add_bridge_args, config_from_args

    def parsed(argv, env):
        with pytest.MonkeyPatch.context() as mp:
            for k, v in env.items():
                mp.setenv(k, v)
            p = argparse.ArgumentParser()
            add_bridge_args(p)
            return config_from_args(p.parse_args(["--endpoint", "tcp://x:1", "--replica", "r", *argv]))

    assert parsed([], {}).model is None
    assert parsed([], {"KVBUS_BRIDGE_MODEL": " qwen "}).model == "qwen"
    assert parsed(["--model", "llama"], {"KVBUS_BRIDGE_MODEL": "qwen"}).model == "llama"  # the flag wins
    assert parsed([], {"KVBUS_BRIDGE_MODEL": ""}).model is None
    with pytest.raises(SystemExit):
        parsed(["--model", ""], {})


def test_engine_restart_gives_reset_marker_and_new_epoch(harness_factory):
    hs = harness_factory().start()
    hs.connected()
    for i in range(3):
        hs.pub.publish([stored(i + 1)], ts=float(i))
    wait_for(lambda: len(hs.data()) == 3, what="3 batches")
    old_epoch = hs.data()[0].epoch
    hs.pub.restart()  # seq back to 0, buffer emptied, sockets re-bound
    time.sleep(0.3)  # let the bridge reconnect
    for i in range(4):
        hs.pub.publish([stored(100 + i)], ts=10.0 + i)
    wait_for(lambda: len(hs.data()) == 7, what="7 batches")
    after = hs.batches[3:]
    assert after[0].seq == -1 and after[0].events == [Reset(reason=REASON_ENGINE_RESTART)]
    assert after[0].epoch > old_epoch
    assert [b.seq for b in after[1:]] == [0, 1, 2, 3]
    assert {b.epoch for b in after} == {after[0].epoch}
    assert hs.bridge.sequencer.stats.restarts == 1


def _restart_after(hs: Harness, produced: int) -> tuple[Bridge, list[EventBatch], threading.Thread]:
    """Stop ``hs``'s bridge and start another whose last record was the first ``produced`` events of
    the last batch (the first run stopped between the parts of a split batch)."""
    from kvbus.producers.recovery import Resume

    hs.bridge.stop()
    hs._thread.join(timeout=5)
    last = hs.data()[-1]
    part = msgspec.structs.replace(last, events=last.events[:produced])
    got: list[EventBatch] = []
    bridge = Bridge(hs.cfg, CallbackSink(got.append), resume=Resume(last.epoch, last.seq, part, 0, 0))
    thread = threading.Thread(target=bridge.run, kwargs={"poll_ms": 10}, daemon=True)
    thread.start()
    wait_for(lambda: bridge.sub is not None and not bridge.sequencer.replay_pending, what="start-up replay")
    return bridge, got, thread


@pytest.mark.parametrize("produced", [2, 5])
def test_restart_between_parts_of_a_split_batch_produces_the_rest(harness_factory, produced):
    """The start-up replay's copy of the last batch shows which of its events the last run did not
    produce; they follow at once as a part with their own first_index, then the stream goes on."""
    hs = harness_factory().start()
    hs.connected()
    hs.pub.publish([stored(1)], ts=1.0)
    hs.pub.publish([stored(i) for i in range(2, 7)], ts=2.0)  # seq 1: 5 events
    wait_for(lambda: len(hs.data()) == 2, what="2 batches")
    whole = hs.data()[-1]
    bridge, got, thread = _restart_after(hs, produced)
    try:
        hs.pub.publish([stored(9)], ts=3.0)
        wait_for(lambda: any(b.seq == 2 for b in got), what="seq 2 from the restarted bridge")
        data = [b for b in got if b.seq >= 0]
        if produced < len(whole.events):
            assert data[0] == msgspec.structs.replace(whole, events=whole.events[produced:], first_index=produced)
            data = data[1:]
        assert [(b.seq, b.epoch, b.first_index) for b in data] == [(2, whole.epoch, 0)]
        assert [b for b in got if b.seq < 0] == []  # the engine did not restart: no reset
    finally:
        bridge.stop()
        thread.join(timeout=5)
        bridge.close(1)


def test_bad_input_goes_to_dead_letters_and_the_bridge_continues(harness_factory):
    hs = harness_factory().start()
    hs.connected()
    hs.pub.publish([stored(1)])  # seq 0
    hs.pub.send_raw([b"only-one-frame"])  # wrong frame count (no seq consumed)
    hs.pub.send_raw([b"", b"\x00\x01", b"x"])  # seq frame not 8 bytes
    hs.pub.publish_payload(b"\xc1 not msgpack")  # seq 1: undecodable payload
    unknown = msgspec.msgpack.encode([5.0, [{"type": "BlockFrobbed", "x": 1},
                                            {"type": "BlockRemoved", "block_hashes": [7], "medium": "GPU"}], 0])
    hs.pub.publish_payload(unknown)  # seq 2: one unknown event type
    hs.pub.publish([stored(2)])  # seq 3
    wait_for(lambda: len(hs.data()) == 3 and len(hs.dead) == 4, what="3 batches + 4 dead letters")
    assert [b.seq for b in hs.data()] == [0, 2, 3]
    assert hs.markers() == []  # the undecodable seq 1 was consumed, not a gap
    assert hs.data()[1].events == [BlockRemoved(block_hashes=[h(7)], medium="GPU")]
    reasons = [d.reason for d in hs.dead]
    assert all(d.stage == "bridge" and d.source == hs.stream.endpoint for d in hs.dead)
    assert "3 frames" in reasons[0] and hs.dead[0].payload == [b"only-one-frame"]
    assert "8 bytes" in reasons[1]
    assert "msgpack" in reasons[2] and hs.dead[2].payload[2] == b"\xc1 not msgpack"
    assert "unknown" in reasons[3] and hs.dead[3].payload[2] == unknown
    assert hs.bridge.metrics.value("dlq") == 4


def test_shed_batches_while_backlog_full_are_recovered_by_replay(harness_factory):
    hs = harness_factory().start()
    hs.connected()
    for i in range(3):
        hs.pub.publish([stored(i + 1)])
    wait_for(lambda: len(hs.data()) == 3)
    hs.sink.accept = False  # Kafka down and backlog full
    for i in range(3, 8):
        hs.pub.publish([stored(i + 1)])
    wait_for(lambda: hs.bridge.metrics.value("shed") == 5, what="5 shed")
    hs.sink.accept = True
    hs.pub.publish([stored(9)])
    wait_for(lambda: len(hs.data()) == 9, what="9 batches")
    assert [b.seq for b in hs.data()] == list(range(9))
    assert hs.markers() == []


def test_fleet_generated_traffic_round_trips_exactly(harness_factory):
    """A generated workload (stores, evictions, CPU/kvcr offload) arrives unchanged."""
    hs = harness_factory().start()
    hs.connected()
    model = hs.fleet.models[(REPLICA, 0)]
    sent = []
    for _ in range(40):
        evs = model.step()
        hs.pub.publish(evs, ts=1.0)
        sent.append(evs)
    wait_for(lambda: len(hs.data()) == 40, what="40 batches")
    assert [b.events for b in hs.data()] == [[without_tokens(project("vllm-0.33", e)) for e in evs] for evs in sent]
    kinds = {(type(e).__name__, getattr(e, "medium", None), getattr(e, "ownership", None))
             for evs in sent for e in evs}
    assert ("BlockStored", "GPU", None) in kinds and ("BlockStored", "CPU", None) in kinds


def test_script_mode_ground_truth(harness_factory):
    hs = harness_factory()
    hs.fleet.play([
        ScriptBatch(REPLICA, [stored(1), stored(2, 1)]),
        ScriptBatch(REPLICA, [BlockRemoved(block_hashes=[h(1)], medium="GPU"), stored(1, medium="CPU")]),
    ])
    truth = hs.fleet.truth(REPLICA)
    assert truth.snapshot() == {("GPU", None): {h(2)}, ("CPU", None): {h(1)}}


# -- the in-process publisher (no Kafka: its producer is replaced by a recording double) -------



class PlainCleared:
    """A non-msgspec object: the generic path."""


PlainCleared.__name__ = "AllBlocksCleared"


class VllmBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list
    data_parallel_rank: object = None


def _vllm_events():
    digest = bytes(range(32))
    return [
        VllmBlockStored(block_hashes=[1, 2**64 - 1], parent_block_hash=None, token_ids=list(range(32)), block_size=16,
                        lora_id=None, medium="GPU", lora_name=None, group_idx=0, kv_cache_spec_kind="full_attention"),
        VllmBlockStored(block_hashes=[3], parent_block_hash=2, token_ids=[5] * 16, block_size=16, lora_id=7,
                        medium="cpu", lora_name="sql", extra_keys=[["sql", ["mm", 0]]], ownership="kvcr",
                        session_id="s-1", lookahead_token_ids=[[1, 2]]),
        VllmBlockStored(block_hashes=[digest], parent_block_hash=digest[::-1], token_ids=[1] * 16, block_size=16,
                        lora_id=None, medium="GPU", lora_name=None),
        VllmBlockRemoved(block_hashes=[2**63 + 5], medium="GPU", group_idx=0),
        VllmBlockRemoved(block_hashes=[4, 5], medium=None, locality="REMOTE"),
        PlainCleared(),
    ]


def test_publisher_encodes_vllm_objects_like_the_normalized_structs():
    from kvbus.producers.publisher import encode_engine_events, to_kvbus_event
    from kvbus.schemas.codec import encode_events

    events = _vllm_events()
    converted = [to_kvbus_event(e) for e in events]
    assert converted[0].block_hashes == [h(1), b"\xff" * 8]
    assert converted[1].medium == "CPU" and converted[1].extra_keys == msgspec.msgpack.encode([["sql", ["mm", 0]]])
    assert converted[2].block_hashes == [bytes(range(24, 32))] and converted[2].block_digests == [bytes(range(32))]
    assert converted[2].parent_block_digest == bytes(range(32))[::-1]
    assert converted[5] == AllBlocksCleared()
    assert encode_engine_events(events) == encode_events(converted)
    with pytest.raises(ValueError):
        to_kvbus_event(object())


@pytest.fixture
def publisher_factory():
    from dataclasses import replace as dc_replace

    from kvbus.producers.publisher import KafkaEventPublisher
    from kvbus.runtime.settings import Settings
    from kvbus.schemas.topics import Topics

    serde = RecordSerde(registry_client("mock://publisher"), "EventBatch")
    topic = "pub.raw"
    schema_id = int.from_bytes(serde.dumps(EventBatch(replica="r", seq=0, ts=0.0, events=[]), topic)[1:5], "big")
    made = []

    def make(**kw):
        settings = dc_replace(Settings(), bootstrap="127.0.0.1:1", topics=Topics(raw=topic))
        fake = RecordingProducer()
        pub = KafkaEventPublisher(replica="pod-a", settings=settings, schema_id=schema_id, producer=fake, **kw)
        made.append(pub)
        return pub, fake, (lambda value: serde.loads(value, topic))

    yield make
    for pub in made:
        pub.shutdown(timeout=0.1)


def test_publisher_writes_monotonic_seqs_after_a_restart_marker(publisher_factory):
    pub, fake, loads = publisher_factory(data_parallel_rank=1, topic="kv@pod-a@m")
    pub.publish(VllmBatch(ts=5.0, events=_vllm_events()[:1]))
    pub.publish(VllmBatch(ts=6.0, events=_vllm_events()[3:4], data_parallel_rank=2))
    records = [(key, loads(value)) for _, value, key in fake.records]
    assert [k for k, _ in records] == [b"pod-a#1", b"pod-a#1", b"pod-a#2"]
    start = records[0][1]  # a new publisher is a new engine run
    assert start.seq == -1 and start.epoch == pub.epoch and start.events == [Reset(reason=REASON_ENGINE_RESTART)]
    b0, b1 = records[1][1], records[2][1]
    assert (b0.seq, b1.seq) == (0, 1) and b0.epoch == b1.epoch == pub.epoch
    assert (b0.replica, b0.dp_rank, b0.engine, b0.topic, b0.ts) == ("pod-a", 1, "kvbus", "kv@pod-a@m", 5.0)
    assert b1.dp_rank == 2 and b1.events == [BlockRemoved(block_hashes=[(2**63 + 5).to_bytes(8, "big")],
                                                          medium="GPU", group_idx=0)]


def test_publisher_names_its_model_in_every_record(publisher_factory):
    pub, fake, loads = publisher_factory(model="qwen")
    pub.publish(VllmBatch(ts=5.0, events=_vllm_events()[:1]))
    pub.publish(VllmBatch(ts=6.0, events=_vllm_events()[3:4], data_parallel_rank=2))
    assert [loads(v).model for _, v, _ in fake.records] == ["qwen", "qwen", "qwen"]  # the start marker too
    plain, fake, loads = publisher_factory()
    plain.publish(VllmBatch(ts=5.0, events=_vllm_events()[:1]))
    assert {loads(v).model for _, v, _ in fake.records} == {None}
    with pytest.raises(ValueError, match="non-empty"):
        publisher_factory(model="")


def test_publisher_never_blocks_and_announces_what_it_had_to_drop(publisher_factory):
    pub, fake, loads = publisher_factory(max_queue_size=2)
    del fake.records[:]  # the start marker
    fake.full = True  # Kafka down: librdkafka's queue is full
    t0 = time.perf_counter()
    for i in range(6):  # seq 0, 1 fit in the backlog; 2..5 are dropped
        pub.publish(VllmBatch(ts=float(i), events=_vllm_events()[3:4]))
    assert time.perf_counter() - t0 < 0.5
    assert pub.dropped == 4 and fake.records == []
    old_epoch = pub.epoch
    fake.full = False  # Kafka is back: the poll thread drains the backlog
    wait_for(lambda: len(fake.records) == 2, what="backlog drained")
    pub.publish(VllmBatch(ts=6.0, events=_vllm_events()[3:4]))
    batches = [loads(v) for _, v, _ in fake.records]
    assert [(b.seq, b.epoch) for b in batches[:2]] == [(0, old_epoch), (1, old_epoch)]
    marker, after = batches[2], batches[3]
    assert marker.seq == -1 and marker.events == [Reset(reason=REASON_GAP, missing_from=2, missing_to=5)]
    assert marker.epoch == after.epoch > old_epoch and after.seq == 6


def test_create_publisher_and_null_publisher():
    from kvbus.producers.publisher import NullEventPublisher, create_publisher

    null = create_publisher("null", replica="x", data_parallel_rank=0)
    assert isinstance(null, NullEventPublisher)
    null.publish(VllmBatch(ts=0.0, events=[]))
    null.shutdown()
    with pytest.raises(ValueError):
        create_publisher("zmq")


def test_publisher_metrics_count_records_drops_and_markers_and_are_served(publisher_factory):
    import urllib.error
    import urllib.request

    from kvbus.children import free_port

    port = free_port()
    pub, fake, _ = publisher_factory(max_queue_size=1, metrics_port=port)
    m = pub.metrics
    pub.publish(VllmBatch(ts=1.0, events=_vllm_events()[:2]))
    assert (m.batches_out._value.get(), m.events_in._value.get(), m.resets._value.get()) == (2, 2, 1)
    fake.full = True
    for i in range(3):  # one waits in the backlog, two are dropped
        pub.publish(VllmBatch(ts=2.0 + i, events=_vllm_events()[3:4]))
    assert m.shed._value.get() == 2
    wait_for(lambda: m.backlog._value.get() == 1, what="backlog gauge")
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert "kvbus_bridge_shed_batches_total 2.0" in body and "kvbus_bridge_backlog 1.0" in body
    with pytest.raises(urllib.error.HTTPError) as shedding:  # /readyz: the producer is failing
        urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5)
    assert shedding.value.code == 503 and "backlog full" in shedding.value.read().decode()


def test_the_publisher_carries_every_kvbus_field_an_engine_event_sets():
    """The publisher copies the kvbus struct's fields by name (derived from kvbus.schemas.events, not
    listed by hand), and its common-shape fast path steps aside for any of them that is set: each
    optional field set on an engine event comes out in the kvbus event, through either path."""
    from kvbus.producers.publisher import _STORED_COPIED, encode_engine_event
    from kvbus.schemas.codec import decode_event

    base = dict(block_hashes=[7], parent_block_hash=None, token_ids=list(range(16)), block_size=16, lora_id=None,
                medium="gpu", lora_name=None)
    plain = decode_event(encode_engine_event(VllmBlockStored(**base)))
    assert plain == BlockStored(block_hashes=[(7).to_bytes(8, "big")], token_ids=list(range(16)), block_size=16,
                                medium="GPU")
    values = {"lora_id": 3, "lora_name": "a", "kv_cache_spec_sliding_window": 128, "locality": "LOCAL",
              "ownership": "kvcr", "session_id": "s", "lookahead_token_ids": [[1, 2]]}
    assert set(values) <= {f for f, _ in _STORED_COPIED}
    for field, value in values.items():
        got = decode_event(encode_engine_event(VllmBlockStored(**{**base, field: value})))
        assert getattr(got, field) == value, field
        assert msgspec.structs.replace(got, **{field: getattr(plain, field)}) == plain, field
