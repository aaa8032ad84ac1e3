"""A full Redis, and a Redis that evicts keys, on real servers: under ``noeviction`` at ``maxmemory``
the sink stops applying (nothing dead-lettered, nothing lost), says why (an ERROR, the
``kvbus_sink_redis_oom`` gauge, ``/readyz``) and catches up exactly once memory is raised; a sink
refuses to start on a server whose ``maxmemory-policy`` evicts (read from ``INFO memory`` where
``CONFIG`` is forbidden), on Redis and on Valkey; keys evicted under a running sink make it rebuild
the view."""
from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from dataclasses import replace
from pathlib import Path

import pytest
import redis

from kvbus.children import Children, free_port
from kvbus.infra.scratch_redis import REDIS, VALKEY, RedisServer
from kvbus.runtime.settings import Settings
from kvbus.schemas.topics import Topics
from kvbus.sinks.consumer import FULL_LOG_EVERY
from kvbus.sinks.view.protocol import chain_broken, with_extra
from kvbus.sinks.view.redis_memory import RedisFull
from kvbus.sinks.view.redis_store import RedisStore
from tests.histories import growing_streams, random_streams
from tests.memory_store import InMemoryStore
from tests.test_probes import get, readyz, wait_until
from tests.test_sink_consumer import produce

T = Topics(blocks="rm.blocks")
TP = (T.blocks, 0)


def model_of(records) -> InMemoryStore:
    m = InMemoryStore()
    m.apply(records)
    return m


def used(r) -> int:
    return int(r.info("memory")["used_memory"])


# ------------------------------------------------------------------ the stores on a full Redis


@pytest.fixture(params=["redis", "valkey", "cluster"])
def full_view(request):
    """A view (its store) on a Redis, a Valkey or a 3-master Redis Cluster under ``noeviction``."""
    if request.param != "cluster":
        kind = VALKEY if request.param == "valkey" else REDIS
        with RedisServer(["--maxmemory-policy", "noeviction"], kind=kind) as srv:
            yield RedisStore(srv.client(), "kvbus:", max_events_per_call=8)
        return
    from kvbus.infra.scratch_cluster import RedisClusterServer
    from kvbus.sinks.view.sharded_store import ShardedRedisStore

    with RedisClusterServer(3) as cluster:
        yield ShardedRedisStore(cluster.client(), "kvbus:", max_events_per_call=8)


def apply_from(store, records, at: int, step: int):
    """Apply ``records[at:at + step]`` as the sink does (offsets stored with the batch, fenced)."""
    return store.apply(records[at:at + step], view_id="v", offsets={TP: at + step}, expected=store.checkpoint([TP]))


def test_a_full_redis_refuses_batches_whole_and_loses_nothing_once_memory_is_raised(full_view):
    """Batches applied as the sink applies them (offsets stored with the last call, each batch many
    calls) into servers a little above their current use: one is refused with RedisFull (never an
    event in ``failed``: those would be dead-lettered), the stored offset is where the refused batch
    began (a cluster: the least of the shards'), and applying again from it after ``CONFIG SET
    maxmemory`` gives exactly the model's view."""
    store = full_view
    records = growing_streams(T, holders=6, events=300)
    store.set_view_id("v")
    servers = [r for _, r in store.servers()]
    for r in servers:
        assert r.config_get("maxmemory-policy")["maxmemory-policy"] == "noeviction"
        r.config_set("maxmemory", used(r) + 200_000)
    step, at, full = 100, 0, None
    while at < len(records):
        try:
            res = apply_from(store, records, at, step)
        except RedisFull as e:
            full = e
            break
        assert res.failed == [], "a full Redis is not a reason to dead-letter good events"
        at += step
    assert full is not None, f"Redis never filled up: used {[used(r) for r in servers]}"
    assert "maxmemory" in str(full) and "CONFIG SET maxmemory" in str(full)
    assert store.offsets() == ({TP: at} if at else {}), "the refused batch stored no offset"
    with pytest.raises(RedisFull):  # still full: the same batch is refused again
        apply_from(store, records, at, step)
    for r in servers:
        r.config_set("maxmemory", 0)
    at = store.offsets().get(TP, 0)
    while at < len(records):
        assert apply_from(store, records, at, step).failed == []
        at += step
    model = model_of(records)
    assert store.snapshot() == model.snapshot() and store.positions() == model.positions()


def test_a_call_of_a_batch_does_not_run_unless_the_call_before_it_did():
    """What keeps a batch a prefix of its calls when memory comes free between two of them: call 2
    sent without call 1 (as if Redis had refused call 1 and accepted call 2) is refused as a broken
    chain and writes nothing, and so is the last call, which would store the batch's offsets."""
    records = random_streams(4, T, holders=3, batches=60, pool=20)
    with RedisServer() as srv:
        store = RedisStore(srv.client(), "kvbus:", max_events_per_call=4)
        store.set_view_id("v")
        calls = list(with_extra(store.packer.calls(records), "v", {TP: len(records)}, {TP: None}))
        assert len(calls) >= 3
        before = (store.snapshot(), store.positions(), store.offsets())
        for _, args in (calls[1], calls[-1]):
            with pytest.raises(Exception) as e:
                store.transport.call("kvbus_apply", *args)
            assert chain_broken(e.value), e.value
        assert (store.snapshot(), store.positions(), store.offsets()) == before, "nothing written"
        for _, args in calls:  # in order, every call runs
            store.transport.call("kvbus_apply", *args)
        assert store.offsets() == {TP: len(records)} and store.snapshot() == model_of(records).snapshot()


def test_a_call_refused_for_its_events_leaves_the_rest_of_the_batch_applied_one_by_one():
    """A refusal that is the events' own (a holder's tier table full) in the middle of a chained
    batch: the later calls refuse as a broken chain, and are applied event by event with the refused
    call's good events; only the bad event is returned for the dead-letter topic, and the batch's
    offsets are stored."""
    from kvbus.schemas.events import BlockEvent, BlockStored, canonical_hash

    def ev(replica: str, seq: int, group: int = 0) -> tuple[str, BlockEvent]:
        return T.blocks, BlockEvent(replica=replica, epoch=1, seq=seq, index=0, ts=1.0, event=BlockStored(
            block_hashes=[canonical_hash(ord(replica) * 1000 + seq)], medium="GPU", group_idx=group))
    full_tiers = [ev("a", g, group=g) for g in range(64)]
    bad = ev("a", 100, group=64)
    batch = [*(ev("b", i) for i in range(4)), bad, ev("a", 101), *(ev("c", i) for i in range(4)),
             *(ev("d", i) for i in range(4))]
    with RedisServer() as srv:
        store = RedisStore(srv.client(), "kvbus:", max_events_per_call=4)
        store.set_view_id("v")
        store.apply(full_tiers)
        assert len(list(with_extra(store.packer.calls(batch), "v", {TP: 14}, {TP: None}))) == 4
        res = store.apply(batch, view_id="v", offsets={TP: 14}, expected={TP: None})
        assert [e for _, e, _ in res.failed] == [bad[1]] and "tier table full" in res.failed[0][2]
        assert res.applied == len(batch) - 1 and store.offsets() == {TP: 14}
        model = model_of(full_tiers + batch)
        assert store.snapshot() == model.snapshot() and store.positions() == model.positions()


# ------------------------------------------------------------------ a sink refuses a server that evicts


def sink_argv(prefix: str) -> list[str]:
    return [sys.executable, "-m", "kvbus", "sink", "--group", f"g-{uuid.uuid4().hex}", "--prefix", prefix,
            "--snapshot-every", "0", "--stale-after", "0"]


def run_sink_once(stack: Settings, url: str, **env: str) -> subprocess.CompletedProcess:
    """``kvbus sink`` against ``url``, expected to stop by itself."""
    full_env = {**os.environ, **replace(stack, redis_url=url).to_env(), **env}
    return subprocess.run(sink_argv(f"r{uuid.uuid4().hex[:6]}:"), env=full_env, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.integration
@pytest.mark.parametrize("kind", [REDIS, VALKEY], ids=lambda k: k.name)
def test_a_sink_refuses_a_server_that_evicts_keys(stack, kind):
    with RedisServer(["--maxmemory-policy", "allkeys-lru"], kind=kind) as srv:
        out = run_sink_once(stack, srv.url)
    assert out.returncode == 2, out
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    assert "maxmemory-policy allkeys-lru" in lines[0] and "maxmemory-policy noeviction" in lines[0], lines[0]
    assert lines[0].startswith("kvbus sink: ") and "(CONFIG GET)" in lines[0]


@pytest.mark.integration
def test_a_sink_reads_the_policy_from_info_where_config_is_forbidden(stack):
    """An ACL user without ``+config`` (as on managed offerings): the policy comes from INFO memory."""
    with RedisServer(["--maxmemory-policy", "volatile-lru"]) as srv:
        srv.client().acl_setuser("sink", enabled=True, passwords=["+pw"], keys=["*"], channels=["*"],
                                 commands=["+@all", "-config"])
        out = run_sink_once(stack, srv.url, KVBUS_REDIS_USERNAME="sink", KVBUS_REDIS_PASSWORD="pw")
    assert out.returncode == 2, out
    line = out.stderr.strip()
    assert "\n" not in line and "maxmemory-policy volatile-lru (INFO memory)" in line, line


# ------------------------------------------------------------------ a real sink process on a full Redis


@pytest.fixture
def children(tmp_path: Path):
    kids = Children(log_dir=tmp_path, log_prefix="")
    yield kids
    kids.stop_all()


def metric(port: int, name: str) -> float | None:
    """The value of an unlabelled metric on a process's /metrics (None: absent)."""
    for line in get(port, "/metrics")[1].splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


@pytest.mark.integration
def test_a_sink_stops_on_a_full_redis_and_catches_up_exactly_once_memory_is_raised(
        stack: Settings, sink_topics: Topics, children: Children, tmp_path: Path):
    records = growing_streams(sink_topics, holders=8, events=400)
    first = len(records) // 5
    prefix, port = f"f{uuid.uuid4().hex[:6]}:", free_port()
    with RedisServer(["--maxmemory-policy", "noeviction"]) as srv:
        r = srv.client()
        view = RedisStore(r, prefix, load=False)
        children.env = {**os.environ, **replace(stack, topics=sink_topics, redis_url=srv.url).to_env()}
        children.start("sink", "sink", "--group", f"g-{uuid.uuid4().hex}", "--prefix", prefix, "--metrics-port",
                       str(port), "--snapshot-every", "0", "--stale-after", "0", "--batch", "200")
        produce(stack, records[:first])
        want = model_of(records[:first]).positions()
        wait_until(lambda: readyz(port) == (200, []) and view.positions() == want, 90,
                   "the sink to be ready with the first fifth applied", children)
        r.config_set("maxmemory", used(r) + 300_000)
        filling = time.monotonic()
        produce(stack, records[first:])
        seen: list = []

        def says_full():
            seen[:] = [readyz(port)]
            return seen[0][0] == 503 and any("Redis is full" in x for x in seen[0][1])
        try:
            wait_until(says_full, 90, "/readyz to say that Redis is full", children)
        except AssertionError as e:
            raise AssertionError(f"{e}; /readyz last answered {seen}") from None
        status, reasons = seen[0]
        assert any("maxmemory" in x for x in reasons), reasons
        assert metric(port, "kvbus_sink_redis_oom") == 1.0
        log_text = (tmp_path / "sink.log").read_text()
        errors = [line for line in log_text.splitlines() if "ERROR" in line and "Redis is full" in line]
        assert errors and "CONFIG SET maxmemory" in errors[0], log_text[-3000:]
        behind = view.positions()
        assert behind != model_of(records).positions(), "Redis filled up before the sink applied everything"
        full_for = time.monotonic() - filling  # at most: it filled up after `filling`
        r.config_set("maxmemory", 0)  # the operator raises it (0: no limit)
        model = model_of(records)
        wait_until(lambda: readyz(port) == (200, []) and view.positions() == model.positions(), 120,
                   "the sink to catch up and be ready once maxmemory is raised", children)
        assert view.snapshot() == model.snapshot() and view.reader().size()["entries"] == model.size()["entries"]
        assert metric(port, "kvbus_sink_redis_oom") == 0.0
        assert metric(port, "kvbus_sink_redis_oom_refusals_total") >= 1
        assert "kvbus_sink_dead_letters_total{" not in get(port, "/metrics")[1], "no good event was dead-lettered"
        log_text = (tmp_path / "sink.log").read_text()
        assert "accepts the view's writes again" in log_text
        errors = [line for line in log_text.splitlines() if "ERROR" in line and "Redis is full" in line]
        assert len(errors) <= 1 + full_for / FULL_LOG_EVERY, f"the ERROR is rate-limited: {errors}"


def test_a_redis_refusing_and_taking_writes_in_turn_gets_one_error_per_interval(caplog):
    """At ``maxmemory`` Redis may take a small write between two refusals: each refusal after an
    accepted write is a new incident for the metric, but the ERROR keeps its rate limit (seen: two
    ERROR lines 0.2 s apart on a loaded machine)."""
    import logging
    from types import SimpleNamespace

    from kvbus.sinks.consumer import SinkConsumer

    class Gauge:
        value = 0.0

        def set(self, v: float) -> None:
            self.value = v

        def inc(self) -> None:
            self.value += 1

    sink = object.__new__(SinkConsumer)  # only the two methods' state: no Kafka, no Redis
    sink.metrics = SimpleNamespace(redis_full=Gauge(), redis_full_refusals=Gauge())
    sink.full_since, sink._full_refused, sink._full_logged = None, 0, float("-inf")
    with caplog.at_level(logging.WARNING, logger="kvbus.sinks"):
        for _ in range(3):
            sink._refused_for_memory(RedisFull("Redis is full"))
            assert sink.metrics.redis_full.value == 1
            sink._writes_accepted()
            assert sink.metrics.redis_full.value == 0
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and sink.metrics.redis_full_refusals.value == 3, [r.getMessage() for r in errors]


# ------------------------------------------------------------------ keys evicted under a running sink


@pytest.mark.integration
@pytest.mark.parametrize("evicted", ["bucket", "meta"])
def test_keys_evicted_under_a_running_sink_make_it_rebuild_the_view(stack: Settings, sink_topics: Topics, caplog,
                                                                    evicted: str):
    """The policy changed under a running sink (``volatile-lru``, and one key of the view given a TTL so
    that exactly it is evicted: a block-table bucket, blocks gone from lookups without a word; or the
    view's metadata, its id with it, which looks like a view lost). The sink sees ``evicted_keys``
    grow, says so naming ``maxmemory-policy``, drops the view (routers see it not ready) and rebuilds
    it: exact again once the operator put ``noeviction`` back."""
    from kvbus.schemas.lookup import meta_key
    from kvbus.sinks.config import SinkConfig
    from kvbus.sinks.consumer import SinkConsumer

    records = growing_streams(sink_topics, holders=4, events=60)
    model = model_of(records)
    produce(stack, records)
    with RedisServer(["--maxmemory-policy", "noeviction"]) as srv:
        r = srv.client()
        store = RedisStore(r, "kvbus:")
        sink = SinkConsumer(stack, store, SinkConfig(group=f"g-{uuid.uuid4().hex}", batch=100, stale_after=0,
                                                     poll_timeout=0.2), topics=sink_topics)
        try:
            wait_until(lambda: (sink.step(), store.positions() == model.positions())[1], 90,
                       "the sink to apply every record")
            wait_until(lambda: (sink.step(), sink.not_ready(store) is None)[1], 30, "the sink to be ready")
            bucket = next(k for k in r.scan_iter(match="kvbus:B:*")) if evicted == "bucket" else meta_key("kvbus:")
            assert r.pexpire(bucket, 3_600_000)
            r.config_set("maxmemory-policy", "volatile-lru")
            r.config_set("maxmemory", used(r) // 2)
            try:
                r.set("poke", "x")  # a write makes Redis evict (the one key it may), then refuse it: still full
            except redis.exceptions.OutOfMemoryError:
                pass
            wait_until(lambda: r.info("stats")["evicted_keys"] >= 1, 30, "Redis to evict the key with a TTL")
            assert not r.exists(bucket)
            r.config_set("maxmemory", 0)
            r.config_set("maxmemory-policy", "noeviction")
            rebuilds = sink.metrics.rebuilds._value.get()
            wait_until(lambda: (sink.step(), sink.metrics.evicted_keys._value.get() >= 1)[1], 30,
                       "the sink to notice the evicted key")
            if evicted == "bucket":  # the view's id gone with its metadata: the rebuild may be over already
                why = sink.not_ready(store)
                assert why is not None and "rebuilding, keys evicted" in why, why
            wait_until(lambda: (sink.step(), store.status().get("state") == "ready"
                                and store.positions() == model.positions())[1], 90,
                       "the view to be rebuilt and ready")
            assert store.snapshot() == model.snapshot() and store.reader().size() == model.size()
            assert r.exists(bucket), "the evicted bucket is back"
            assert sink.metrics.rebuilds._value.get() == rebuilds + 1
            assert sink.not_ready(store) is None
            assert any("Redis evicted keys" in m and "maxmemory-policy noeviction" in m
                       for m in caplog.messages), caplog.messages[-5:]
        finally:
            sink.close()
