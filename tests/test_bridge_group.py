"""Several engine streams in one bridge loop (kvbus.producers.bridge_group) against a real in-process
ZMQ fleet, no Kafka: each stream keeps its own sequencing, and the loop's adaptive batching reads
a lone batch in a pass of its own and a burst in large passes.

The group is stepped from the test's thread, so what a pass read is exactly what ``step`` returns.
"""
from __future__ import annotations

import time
from typing import Callable

import pytest
import zmq

from kvbus.producers.bridge import Bridge, BridgeConfig
from kvbus.producers.bridge_group import Batching, BridgeGroup
from kvbus.producers.metrics import BridgeMetrics
from kvbus.schemas.events import BlockStored, DeadLetter, EventBatch
from kvbus.simulator.fleet import Fleet, FleetConfig
from tests.callback_sink import CallbackSink

pytestmark = pytest.mark.timeout(60)


def stored(i: int) -> BlockStored:
    return BlockStored(block_hashes=[i.to_bytes(8, "big")], token_ids=list(range(16)), block_size=16, medium="GPU")


class Group:
    """A fleet of ``replicas`` and one bridge group serving all its streams."""

    def __init__(self, replicas: int, batching: Batching = Batching()) -> None:
        self.fleet = Fleet(FleetConfig(replicas=replicas, base_port=0)).start()
        self.batches: list[EventBatch] = []
        self.dead: list[DeadLetter] = []
        self.sink = CallbackSink(self.batches.append, self.dead.append)
        self.metrics = BridgeMetrics()
        poller = zmq.Poller()
        bridges = [Bridge(BridgeConfig(endpoint=s.endpoint, replica=s.replica, replay_endpoint=s.replay_endpoint,
                                       replay_timeout=1.0), self.sink, self.metrics, poller=poller)
                   for s in self.fleet.streams()]
        self.group = BridgeGroup(bridges, self.sink, self.metrics, poller, batching)
        self.group.open()

    def step_until(self, cond: Callable[[], bool], what: str, timeout: float = 20.0) -> list[int]:
        """Step the group until ``cond()``; returns the batches each pass that read any read."""
        reads = []
        deadline = time.monotonic() + timeout
        while not cond():
            assert time.monotonic() < deadline, f"timed out waiting for {what}; have {len(self.data())} batches"
            n = self.group.step(poll_ms=10)
            if n:
                reads.append(n)
        return reads

    def data(self) -> list[EventBatch]:
        return [b for b in self.batches if b.seq >= 0]

    def subscribed(self) -> None:
        """Publish probes on every stream until one of each arrived (ZMQ's slow joiner: a batch
        published before the subscription is live is lost live, and replayed only once a later one
        shows the gap), then wait for every probe."""
        self.step_until(lambda: all(not b.sequencer.replay_pending for b in self.group.bridges), "start-up replays")
        for name in self.fleet.names:
            pub = self.fleet.publisher(name)
            while not any(b.replica == name for b in self.data()):
                pub.publish([stored(1_000_000 + pub.next_seq)], ts=999.0)
                deadline = time.monotonic() + 0.2
                while not any(b.replica == name for b in self.data()) and time.monotonic() < deadline:
                    self.group.step(poll_ms=10)
            self.step_until(lambda: sum(b.replica == name for b in self.data()) == pub.next_seq, f"{name}'s probes")

    def close(self) -> None:
        self.group.close(1)
        self.fleet.stop()


@pytest.fixture
def groups():
    made: list[Group] = []

    def make(*a, **kw) -> Group:
        g = Group(*a, **kw)
        made.append(g)
        return g

    yield make
    for g in made:
        g.close()


def test_batching_pauses_only_after_a_large_pass():
    b = Batching(wait=0.002, large=8)
    assert [b.pause(n) for n in (0, 1, 7)] == [0.0, 0.0, 0.0]
    assert b.pause(8) == b.pause(500) == 0.002
    assert Batching(wait=0.0, large=1).pause(1000) == 0.0


def test_batching_pauses_after_every_pass_while_busy_and_stops_below_half_the_rate():
    now = [0.0]
    b = Batching(wait=0.002, large=8, busy=400.0, busy_wait=0.01, clock=lambda: now[0])

    def passes(per_second: float, seconds: float, per_pass: int = 2) -> list[float]:
        """Pauses of the passes of ``seconds`` at ``per_second`` engine batches, ``per_pass`` at a time."""
        pauses = []
        for _ in range(int(per_second * seconds / per_pass)):
            now[0] += per_pass / per_second
            pauses.append(b.pause(per_pass))
        return pauses

    assert set(passes(300, 2.0)) == {0.0} and not b.is_busy  # light: a batch goes out as it arrives
    assert passes(700, 2.0)[-10:] == [0.01] * 10 and b.is_busy  # busy: every pass pauses
    assert passes(250, 2.0)[-10:] == [0.01] * 10  # above half the rate: still busy (no flapping)
    assert set(passes(150, 2.0)[-10:]) == {0.0} and not b.is_busy  # below half: idle again
    assert b.pause(8) == 0.002  # a large pass still pauses the short wait
    never = Batching(busy=0.0, clock=lambda: now[0])
    for _ in range(2000):
        now[0] += 0.001
        assert never.pause(2) == 0.0  # 2,000 batches/s, never busy


def test_each_stream_keeps_its_own_sequence_epoch_and_gap_replay(groups):
    g = groups(3)
    g.subscribed()
    before = {name: g.fleet.publisher(name).next_seq for name in g.fleet.names}
    for i in range(30):
        for k, name in enumerate(g.fleet.names):
            # replica-1 loses every fifth batch on the way: only its replay buffer has it
            g.fleet.publisher(name).publish([stored(10 * i + k)], ts=float(i), send_live=not (k == 1 and i % 5 == 2))
    total = sum(before.values()) + 90
    g.step_until(lambda: len(g.data()) == total, f"{total} batches")
    for name in g.fleet.names:
        mine = [b for b in g.data() if b.replica == name]
        assert [b.seq for b in mine] == list(range(before[name] + 30)), name
        assert len({b.epoch for b in mine}) == 1, name
        assert [b.events[0].block_hashes[0] for b in mine[before[name]:]] == \
            [(10 * i + g.fleet.names.index(name)).to_bytes(8, "big") for i in range(30)]
    assert g.batches == g.data() and g.dead == []  # no reset marker, nothing dead-lettered
    for b in g.group.bridges:
        b.sync_metrics()
    assert g.metrics.value("recovered") >= 6  # replica-1's six lost batches, replayed
    assert g.metrics.value("events_in") == total


def test_a_lone_batch_is_read_in_a_pass_of_its_own(groups):
    g = groups(2, Batching(wait=0.01, large=4))
    g.subscribed()
    base = len(g.data())
    reads = []
    for i in range(20):
        g.fleet.publisher(g.fleet.names[i % 2]).publish([stored(i)])
        reads += g.step_until(lambda: len(g.data()) == base + i + 1, f"batch {i}")
    assert reads == [1] * 20  # each produced in the pass that read it; no pass waited for more


def test_batches_grow_under_load(groups):
    g = groups(2, Batching(wait=0.005, large=4))
    g.subscribed()
    base = len(g.data())
    n = 2000
    for i in range(n // 2):  # a burst on both streams, far faster than one pass per batch
        for name in g.fleet.names:
            g.fleet.publisher(name).publish([stored(i)])
    reads = g.step_until(lambda: len(g.data()) == base + n, f"{n} batches")
    assert sum(reads) == n
    assert max(reads) >= 4 and len(reads) <= n // 4, reads  # few large passes, not one per batch
    assert g.group.passes[max(reads)] >= 1


def test_streams_file_names_each_stream_over_the_flags(tmp_path):
    import argparse
    import json

    from kvbus.producers.cli import add_bridge_args, configs_from_args
    from kvbus.runtime.env import SettingError

    def parsed(entries, *argv):
        path = tmp_path / "streams.json"
        path.write_text(json.dumps(entries))
        p = argparse.ArgumentParser()
        add_bridge_args(p)
        return configs_from_args(p.parse_args(["--streams", str(path), *argv]))

    cfgs = parsed([{"endpoint": "tcp://a:1", "replica": "a", "replay_endpoint": "tcp://a:2"},
                   {"endpoint": "tcp://b:1", "replica": "b", "worker_rank": 1, "model": "m2"}],
                  "--workers", "2", "--model", "m1")
    assert [(c.endpoint, c.replica, c.replay_endpoint, c.worker_rank, c.workers, c.model) for c in cfgs] == [
        ("tcp://a:1", "a", "tcp://a:2", 0, 2, "m1"), ("tcp://b:1", "b", None, 1, 2, "m2")]
    for bad, says in (([{"endpoint": "tcp://a:1"}], "needs an endpoint and a replica"),
                      ([{"endpoint": "tcp://a:1", "replica": "a", "color": "red"}], "unknown key 'color'"),
                      ([{"endpoint": "tcp://a:1", "replica": "a", "worker_rank": -1}], "worker_rank=-1"),
                      ([{"endpoint": "tcp://a:1", "replica": "a"}, {"endpoint": "tcp://b:1", "replica": "a"}],
                       "two streams of one"),
                      ({"endpoint": "tcp://a:1"}, "a JSON list of objects")):
        with pytest.raises(SettingError, match=says):
            parsed(bad)
    p = argparse.ArgumentParser()
    add_bridge_args(p)
    with pytest.raises(SettingError, match="--endpoint and --replica are required"):
        configs_from_args(p.parse_args([]))


def test_a_stream_that_went_quiet_after_shedding_gets_its_tail_replayed(groups):
    """Batches shed while the producer refused, with no live batch after them: once it accepts
    again, the group's next passes ask the engine for the tail, though no socket has anything."""
    g = groups(2)
    g.subscribed()
    name = g.fleet.names[0]
    pub = g.fleet.publisher(name)
    g.sink.accept = False
    for i in range(5):
        pub.publish([stored(2_000_000 + i)], ts=1.0)
    mine = lambda: [b.seq for b in g.data() if b.replica == name]  # noqa: E731
    have = len(mine())
    g.step_until(lambda: g.metrics.value("shed") >= 5, "the five batches shed")
    assert len(mine()) == have  # refused: nothing produced
    g.sink.accept = True  # the engine stays quiet from here on
    g.step_until(lambda: mine() == list(range(pub.next_seq)), f"{name}'s shed tail replayed")
