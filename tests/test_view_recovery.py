"""The view recovers from Kafka (issue 9, part 1): its Kafka offsets are stored with the applies,
a view that rolled back is replayed forward from them, and a view that is gone is rebuilt from the
latest snapshot in ``kvbus.snapshots`` and replayed from the snapshot's offsets: exact each time.

The first tests need only a private Redis; the last ones run the sink against the real Kafka and
registry, and kill or restart its Redis."""
from __future__ import annotations

import dataclasses
import uuid

import pytest
from confluent_kafka import TopicPartition
from confluent_kafka.admin import AdminClient

from kvbus.infra.scratch_redis import RedisServer
from kvbus.schemas.topics import Topics
from kvbus.sinks.config import SinkConfig
from kvbus.sinks.consumer import SinkConsumer
from kvbus.sinks.snapshot import SnapshotWriter
from kvbus.sinks.view.redis_store import RedisStore, ViewChanged
from tests.histories import random_streams
from tests.memory_store import InMemoryStore
from tests.test_sink_consumer import produce, wait_for

TOPICS = Topics(blocks="rt.blocks")


def fresh(redis_server, **kw) -> RedisStore:
    return RedisStore(redis_server.client(), f"v{uuid.uuid4().hex[:8]}:", **kw)


def copy_view(src: RedisStore, dst: RedisStore) -> None:
    """What a snapshot + rebuild does, without Kafka: every holder dumped from ``src``, restored into ``dst``."""
    for hid, name in src.holder_ids().items():
        replica, _, dp = name.rpartition("#")
        dst.restore_holder(replica, int(dp), src.dump_holder(hid), max_hashes=5)


@pytest.mark.parametrize("seed", [1, 2, 3, 4, 5, 6])
def test_restored_view_replayed_from_an_earlier_point_is_exact(redis_server, seed):
    """A holder state read after offset O, replayed from O: the stored positions skip what it has.
    (The overlap is what a snapshot has: its offsets are read before its holders.)"""
    records = random_streams(seed, TOPICS, holders=5, batches=300, pool=25, models=("llama", "qwen", None))
    n = len(records)
    replay_from, dumped_at = n // 3, 2 * n // 3
    live, rebuilt, model = fresh(redis_server), fresh(redis_server), InMemoryStore()
    live.apply(records[:dumped_at])
    copy_view(live, rebuilt)  # tiers split in 5-hash pieces: several kvbus_restore calls per holder
    assert rebuilt.snapshot() == live.snapshot() and rebuilt.positions() == live.positions()
    assert rebuilt.models() == live.models() and live.models(), "the holders keep their models"
    res = rebuilt.apply(records[replay_from:])
    assert res.skipped >= dumped_at - replay_from  # the overlap is skipped, not applied twice
    model.apply(records)
    assert rebuilt.snapshot() == model.snapshot()
    assert rebuilt.positions() == model.positions()
    assert rebuilt.models() == model.models()
    assert rebuilt.reader().size()["entries"] == model.size()["entries"]


def test_apply_stores_offsets_with_the_last_call_and_refuses_another_view(redis_server):
    records = random_streams(7, TOPICS, holders=3, batches=60, pool=20)
    store = fresh(redis_server, max_events_per_call=4)  # the batch takes many calls
    store.set_view_id("one")
    store.apply(records[:30], view_id="one", offsets={("rt.blocks", 0): 30, ("rt.blocks.kvcr", 1): 7})
    assert store.offsets() == {("rt.blocks", 0): 30, ("rt.blocks.kvcr", 1): 7}
    before = (store.snapshot(), store.positions(), store.offsets())
    with pytest.raises(ViewChanged):
        store.apply(records[30:], view_id="two", offsets={("rt.blocks", 0): 99})
    with pytest.raises(ViewChanged):
        store.set_offsets({("rt.blocks", 0): 99}, "two")
    assert (store.snapshot(), store.positions(), store.offsets()) == before  # nothing written
    store.r.delete(store.prefix + "meta")  # the view is gone (FLUSHALL, restart without persistence)
    assert store.view_id() is None
    with pytest.raises(ViewChanged):
        store.apply(records[30:], view_id="one")


def test_an_incomplete_snapshot_is_not_restored(redis_server):
    """A manifest naming a holder whose record is older than it (two snapshot writers interleaved,
    a record lost): restoring it and replaying from its offsets would miss that holder's events, so
    the view is rebuilt by replaying the topics from their start instead."""
    from kvbus.schemas.events import ViewOffset, ViewSnapshot
    from kvbus.sinks.rebuild import rebuild
    from kvbus.sinks.snapshot import holder_record

    live = fresh(redis_server)
    live.apply(random_streams(9, TOPICS, holders=2, batches=40, pool=20))
    (h0, n0), (h1, n1) = sorted(live.holder_ids().items())
    manifest = ViewSnapshot(snapshot=200, taken=0.0, holders=[n0, n1],
                            offsets=[ViewOffset(topic=TOPICS.blocks, partition=0, offset=77)])
    records = {n0: holder_record(200, n0, live.dump_holder(h0)), n1: holder_record(199, n1, live.dump_holder(h1))}

    class Reader:
        def read(self):
            return manifest, records

    target = fresh(redis_server)
    rebuild(target, Reader(), lambda: {})
    assert target.view_id() is not None and target.offsets() == {} and target.reader().size()["entries"] == 0
    records[n1] = holder_record(200, n1, live.dump_holder(h1))  # complete: restored, offsets stored
    again = fresh(redis_server)
    rebuild(again, Reader(), lambda: {})
    assert again.snapshot() == live.snapshot() and again.offsets() == {(TOPICS.blocks, 0): 77}


def test_a_view_rebuilt_from_a_snapshot_keeps_the_holders_models(redis_server):
    """Each holder record of a snapshot (through its Avro encoding) brings the holder's model back:
    a lookup naming a model answers the same before the view was lost and after its rebuild."""
    from kvbus.schemas import codec
    from kvbus.schemas.events import ViewSnapshot
    from kvbus.sinks.rebuild import rebuild
    from kvbus.sinks.snapshot import holder_record

    live = fresh(redis_server)
    records = random_streams(12, TOPICS, holders=6, batches=80, pool=20, models=("llama", "qwen", None))
    live.apply(records)
    names = live.holder_ids()
    saved = {n: codec.decode("ViewSnapshot", codec.encode("ViewSnapshot", holder_record(300, n, live.dump_holder(h))))
             for h, n in names.items()}
    assert {n: r.model for n, r in saved.items() if r.model} == live.models() and len(set(live.models().values())) == 2

    class Reader:
        def read(self):
            return ViewSnapshot(snapshot=300, taken=0.0, holders=list(saved)), saved

    again = fresh(redis_server)
    rebuild(again, Reader(), dict)
    assert again.models() == live.models() and again.snapshot() == live.snapshot()
    held = sorted({h for tiers in live.snapshot().values() for blocks in tiers.values() for h in blocks})
    answered = set()
    for h in held:
        for model in ("llama", "qwen"):
            got = again.lookup([h], model=model)
            assert got == live.lookup([h], model=model)
            answered.update(got)
    assert len(answered) >= 2, "holders of both models answered"


def test_wipe_deletes_the_view_and_nothing_else(redis_server):
    a, b = fresh(redis_server), fresh(redis_server)
    records = random_streams(8, TOPICS, holders=3, batches=40, pool=20)
    a.apply(records)
    b.apply(records)
    a.set_status(state="rebuilding")
    assert a.wipe() > 0
    assert {k.decode() for k in a.r.scan_iter(match=a.prefix + "*")} == {a.prefix + "status"}
    model = InMemoryStore()
    model.apply(records)
    assert b.snapshot() == model.snapshot()


# ------------------------------------------------------------------ with the real Kafka and registry


@pytest.fixture
def topics(sink_topics) -> Topics:
    return sink_topics


def model_of(records) -> InMemoryStore:
    m = InMemoryStore()
    m.apply(records)
    return m


def sink_for(stack, topics, store, consumer_conf: dict | None = None) -> SinkConsumer:
    return SinkConsumer(stack, store, SinkConfig(group=f"g-{uuid.uuid4().hex}", batch=50, stale_after=0,
                                             poll_timeout=0.2), topics=topics, consumer_conf=consumer_conf)


def catch_up(sink: SinkConsumer, store: RedisStore, records, what: str, each=None) -> None:
    want = model_of(records).positions()

    def step() -> None:
        sink.step()
        if each:
            each()
    wait_for(lambda: store.positions() == want, 90, what, step=step)


@pytest.mark.integration
def test_a_view_that_rolled_back_is_replayed_forward_from_its_own_offsets(stack, topics):
    """Redis restarts from an older persisted state (what AOF everysec or a lagging replica loses):
    the view's stored offsets roll back with it, and the sink reads again from them."""
    records = random_streams(41, topics, holders=5, batches=600, pool=40)
    a, b = len(records) // 3, 2 * len(records) // 3
    with RedisServer() as srv:
        store = RedisStore(srv.client(), "kvbus:")
        sink = sink_for(stack, topics, store)
        try:
            produce(stack, records[:a])
            catch_up(sink, store, records[:a], "the first third")
            srv.client().save()  # the state Redis will come back with
            produce(stack, records[a:b])
            catch_up(sink, store, records[:b], "the second third")
            srv.kill()
            srv.start()
            assert store.positions() == model_of(records[:a]).positions(), "Redis came back rolled back"
            produce(stack, records[b:])
            catch_up(sink, store, records, "the rolled-back view to be replayed forward")
            assert store.snapshot() == model_of(records).snapshot()
            assert sink.metrics.resyncs._value.get() >= 1
        finally:
            sink.close()


@pytest.mark.integration
def test_a_lost_view_is_rebuilt_from_the_snapshot_beyond_the_topics_retention(stack, topics):
    """Redis restarts empty: the sink rebuilds the view from the snapshot and replays from the
    snapshot's offsets; the records before them were deleted from the block topics (retention), so
    only the snapshot has them. Routers see the view rebuilding, then ready."""
    records = random_streams(43, topics, holders=6, batches=600, pool=40, models=("llama", "qwen", None))
    half = len(records) // 2
    settings = dataclasses.replace(stack, topics=topics)
    with RedisServer() as srv:
        store = RedisStore(srv.client(), "kvbus:")
        sink = sink_for(stack, topics, store)
        try:
            produce(stack, records[:half])
            catch_up(sink, store, records[:half], "the first half")
            stats = SnapshotWriter(settings, store).take()
            assert stats.holders == 6 and stats.entries == store.reader().size()["entries"] > 0
            saved = store.offsets()
            admin = AdminClient({"bootstrap.servers": stack.bootstrap})
            for f in admin.delete_records([TopicPartition(t, p, o) for (t, p), o in saved.items()]).values():
                f.result(30)  # retention: the first half is gone from Kafka
            produce(stack, records[half:])
            catch_up(sink, store, records, "the second half")
            read_before = sink.metrics.records._value.get()
            rebuilds_before = sink.metrics.rebuilds._value.get()
            srv.kill()
            srv.start()  # no persistence: the view is gone
            assert store.reader().size()["entries"] == 0
            states: list[str] = []

            def note() -> None:  # the states the sinks record (status() says "missing" before the first)
                st = store.recorded_status().get("state")
                if st and (not states or states[-1] != st):
                    states.append(st)
            catch_up(sink, store, records, "the view to be rebuilt", each=note)
            wait_for(lambda: store.status().get("state") == "ready", 30, "the rebuilt view to be ready",
                     step=lambda: (sink.step(), note()))
            assert states[0] == "rebuilding" and states[-1] == "ready"
            assert store.snapshot() == model_of(records).snapshot()
            assert store.models() == model_of(records).models() and store.models(), "the holders keep their models"
            assert store.reader().size() == model_of(records).size()
            re_read = sink.metrics.records._value.get() - read_before
            assert re_read <= len(records) - half, "replayed from the snapshot's offsets, not from the start"
            assert sink.metrics.rebuilds._value.get() == rebuilds_before + 1
        finally:
            sink.close()
