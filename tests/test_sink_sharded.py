"""The sharded view on a real 3-master Redis Cluster (sinks/view/sharded_store.py): the same answers as
the single-node view on the same events (random histories with redelivery), ``kvbus lookup``'s code
path on a ``redis+cluster://`` URL, and a slot migration while applying (TRYAGAIN costs a retry,
never an error or a lost event). The cluster is started by infra/redis_cluster.py."""
from __future__ import annotations

import random
import threading
import time
import uuid

import pytest
import redis

from kvbus.cli import build_parser
from kvbus.client.lookup_cli import lookup_answer
from kvbus.infra.scratch_cluster import RedisClusterServer, wait_replicas_in_sync
from kvbus.runtime.settings import Settings
from kvbus.schemas.lookup import meta_key, shard_prefix
from kvbus.schemas.topics import Topics
from kvbus.sinks.view.cluster import parse_cluster_url
from kvbus.sinks.view.redis_store import RedisStore
from kvbus.sinks.view.refcounts import Weights
from kvbus.sinks.view.sharded_store import ShardedRedisStore
from kvbus.sinks.view.store_url import open_store
from tests.histories import random_streams, redeliver
from tests.memory_store import InMemoryStore

T = Topics(blocks="tb")


@pytest.fixture(scope="module")
def cluster():
    with RedisClusterServer(3) as cl:
        yield cl


def _pair(redis_server, cluster, **kw):
    prefix = f"q{uuid.uuid4().hex[:8]}:"
    return prefix, RedisStore(redis_server.client(), prefix), ShardedRedisStore(cluster.url, prefix, **kw)


def _chains(records, rng: random.Random) -> list[list[bytes]]:
    stored = [list(ev.event.block_hashes) for _, ev in records if getattr(ev.event, "block_hashes", None)]
    pool = sorted({h for c in stored for h in c})
    out = [c for c in stored[::3]]
    out += [rng.sample(pool, min(len(pool), rng.randint(1, 8))) for _ in range(40)]
    return out


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_same_answers_as_the_single_node_view(redis_server, cluster, seed):
    _, single, sharded = _pair(redis_server, cluster)
    records = random_streams(seed, T, holders=12, batches=150, pool=30, models=("llama", "qwen", None))
    for batch in redeliver(records, seed, max_batch=40):
        a, b = single.apply(batch), sharded.apply(batch)
        assert (a.applied, a.skipped, a.entries_delta, a.resets, a.clears) == \
               (b.applied, b.skipped, b.entries_delta, b.resets, b.clears)
    assert sharded.snapshot() == single.snapshot()
    assert sharded.positions() == single.positions()
    assert sharded.reader().summary() == single.reader().summary()
    assert sharded.reader().size() == single.reader().size()
    assert sharded.models() == single.models() and sharded.models()
    used = {s for s in range(sharded.nshards) if sharded.shards[s].reader().size()["holders"]}
    assert len(used) > 3, "the holders are spread over the shards"
    rng = random.Random(seed)
    names = sorted({ev.replica for _, ev in records})
    w = Weights.parse("GPU=2,CPU=1,*=0.25")
    for chain in _chains(records, rng):
        assert sharded.lookup(chain) == single.lookup(chain)
        assert sharded.lookup(chain, weights=w) == single.lookup(chain, weights=w)
        cands = rng.sample(names, 2) + [f"{names[0]}#1"]
        assert sharded.lookup(chain, candidates=cands) == single.lookup(chain, candidates=cands)
        for model in ("llama", "qwen"):
            assert sharded.lookup(chain, model=model) == single.lookup(chain, model=model)
            assert sharded.lookup(chain, model=model, candidates=cands) == \
                single.lookup(chain, model=model, candidates=cands)
    now = records[-1][1].ts + 50
    assert sorted(sharded.expire_stale(100.0, now=now)) == sorted(single.expire_stale(100.0, now=now))
    assert sharded.reader().stale() == single.reader().stale() and sharded.snapshot() == single.snapshot()


def test_kvbus_lookup_on_a_cluster_url_reads_the_sharded_view(redis_server, cluster):
    prefix, single, sharded = _pair(redis_server, cluster)
    records = random_streams(7, T, holders=10, batches=80, pool=20)
    single.apply(records)
    sharded.apply(records)
    assert isinstance(open_store(cluster.url, prefix, load=False), ShardedRedisStore)
    assert isinstance(open_store(redis_server.url, prefix, load=False), RedisStore)
    chains = _chains(records, random.Random(7))[:15]
    for chain in chains:
        hashes = ",".join(str(int.from_bytes(h, "big")) for h in chain)
        args = build_parser("lookup").parse_args(["lookup", "--hashes", hashes, "--weights", "GPU=1,CPU=0.5",
                                                  "--prefix", prefix])
        want = lookup_answer(args, Settings(redis_url=redis_server.url))
        assert lookup_answer(args, Settings(redis_url=cluster.url)) == want
    assert parse_cluster_url("redis+cluster://10.0.0.1:7000,10.0.0.2:7001/0?shards=32") == \
        ([("10.0.0.1", 7000), ("10.0.0.2", 7001)], {"shards": "32"})


def test_offsets_are_stored_in_every_shard_and_resume_from_the_lowest(redis_server, cluster):
    _, _, sharded = _pair(redis_server, cluster)
    sharded.set_view_id("v1")
    records = random_streams(4, T, holders=3, batches=10, pool=10)
    sharded.apply(records, view_id="v1", offsets={("tb", 0): 10}, expected={})
    assert sharded.shard_offsets() == [{("tb", 0): 10}] * sharded.nshards, "untouched shards get the offsets too"
    sharded.apply([], view_id="v1", offsets={("tb", 0): 12}, expected={("tb", 0): 10})
    # one shard rolls back (its master failed over to a lagging replica): the sink resumes from the minimum
    sharded.rc.hset(shard_prefix(sharded.prefix, 5) + "off", "tb:0", 11)
    assert sharded.offsets() == {("tb", 0): 11}
    from kvbus.sinks.view.store import ViewChanged
    with pytest.raises(ViewChanged):
        sharded.apply(records[:1], view_id="v1", offsets={("tb", 0): 13}, expected={("tb", 0): 12})
    exp = sharded.shard_offsets()
    sharded.apply(records[:1], view_id="v1", offsets={("tb", 0): 13}, expected=exp)
    assert sharded.offsets() == {("tb", 0): 13} and sharded.view_id() == "v1"


def _node_id(r: redis.Redis) -> str:
    return r.execute_command("CLUSTER", "MYID").decode()


def test_a_slot_migration_while_applying_costs_retries_not_errors(redis_server, cluster):
    """The busiest shard's slot moves to another master key by key (CLUSTER SETSLOT + MIGRATE, as
    redis-cli --cluster reshard does) while batches are applied; the migration waits for an apply
    attempt after each key, so applies do hit the half-moved slot."""
    _, single, sharded = _pair(redis_server, cluster, retry_for=20.0)
    records = random_streams(11, T, holders=16, batches=300, pool=40)
    batches = list(redeliver(records, 11, max_batch=30))
    warm, rest = batches[:len(batches) // 3], batches[len(batches) // 3:]
    for b in warm:
        sharded.apply(b)
    sizes = [st.reader().size()["entries"] for st in sharded.shards]
    s = max(range(sharded.nshards), key=sizes.__getitem__)
    key = meta_key(sharded.shards[s].prefix)
    slot = sharded.rc.keyslot(key)
    src_node = sharded.rc.get_node_from_key(key)
    dst_node = next(n for n in sharded.rc.get_primaries() if n.name != src_node.name)
    src, dst = cluster.node_client(src_node.port), cluster.node_client(dst_node.port)

    attempts = [0]
    cond = threading.Condition()
    send = sharded.calls.send

    def counting_send(calls, idxs):
        with cond:
            attempts[0] += 1
            cond.notify_all()
        return send(calls, idxs)

    sharded.calls.send = counting_send
    done, errors = threading.Event(), []

    def migrate():
        try:
            dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", _node_id(src))
            src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", _node_id(dst))
            moved = 0
            while True:
                keys = src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 1)
                if not keys:
                    break
                with cond:
                    seen = attempts[0]
                src.execute_command("MIGRATE", "127.0.0.1", dst_node.port, "", 0, 5000, "KEYS", *keys)
                moved += 1
                if moved <= 20:  # the first keys: wait until an apply tried the half-moved slot
                    with cond:
                        cond.wait_for(lambda: attempts[0] > seen, timeout=5)
            for r in (dst, src):
                r.execute_command("CLUSTER", "SETSLOT", slot, "NODE", _node_id(dst))
        except Exception as e:  # noqa: BLE001
            errors.append(e)
        finally:
            done.set()

    th = threading.Thread(target=migrate, daemon=True)
    th.start()
    for b in rest:
        sharded.apply(b)
    probe = next(ev.event.block_hashes for _, ev in records if getattr(ev.event, "block_hashes", None))
    while not done.is_set():  # lookups (retried too) while the last keys move
        sharded.lookup(probe)
    th.join(timeout=30)
    assert not errors, errors
    assert sharded.retries > 0, "an apply met the migrating slot"
    assert src.execute_command("CLUSTER", "COUNTKEYSINSLOT", slot) == 0
    assert dst.execute_command("CLUSTER", "COUNTKEYSINSLOT", slot) > 0
    sharded.apply(rest[-1])  # MOVED now: the client follows the slot to its new master
    for b in batches:
        single.apply(b)
    assert sharded.snapshot() == single.snapshot()
    assert sharded.positions() == single.positions()
    for _, ev in records[::7]:
        if getattr(ev.event, "block_hashes", None):
            assert sharded.lookup(ev.event.block_hashes) == single.lookup(ev.event.block_hashes)


def _fcall_ro_calls(r: redis.Redis) -> int:
    return int(r.info("commandstats").get("cmdstat_fcall_ro", {}).get("calls", 0))


def test_reads_from_replicas_answer_like_the_masters_and_avoid_a_migrating_shard(redis_server, cluster):
    """``?read_from=replica``: lookups go to the replicas (READONLY), answer what the masters and the
    single node answer once the replicas caught up, and a shard whose slot is being migrated is
    read from its master instead."""
    prefix, single, sharded = _pair(redis_server, cluster)
    records = random_streams(13, T, holders=12, batches=100, pool=25)
    single.apply(records)
    sharded.apply(records)
    reader = open_store(f"{cluster.url}?read_from=replica", prefix, load=False)
    assert isinstance(reader, ShardedRedisStore) and reader.read_from == "replica"
    reader.migration_check = 0.0
    wait_replicas_in_sync(cluster, reader.rc)
    clients = {n.port: cluster.node_client(n.port) for n in cluster.nodes}
    for r in clients.values():
        r.config_resetstat()
    chains = _chains(records, random.Random(13))[:20]
    for chain in chains:
        assert reader.lookup(chain) == single.lookup(chain) == sharded.lookup(chain)
    on_masters = sum(_fcall_ro_calls(clients[n.port]) for n in cluster.nodes if n.master)
    on_replicas = sum(_fcall_ro_calls(clients[n.port]) for n in cluster.nodes if not n.master)
    assert on_replicas == len(chains) * reader.nshards, "every shard of every lookup was read from a replica"
    assert on_masters == len(chains) * sharded.nshards, "only the primary-reading store read the masters"

    s = 0
    key = meta_key(reader.shards[s].prefix)
    slot = reader.rc.keyslot(key)
    src_node = reader.rc.get_node_from_key(key)
    dst_node = next(n for n in reader.rc.get_primaries() if n.name != src_node.name)
    src, dst = clients[src_node.port], clients[dst_node.port]
    dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", _node_id(src))
    src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", _node_id(dst))
    answers: list = []
    try:
        assert reader.migrating_shards() == {s}
        # the master refuses calls on a migrating slot (the guard key), so the lookup waits for the
        # migration to end rather than read the half-moved shard's replica
        th = threading.Thread(target=lambda: answers.append(reader.lookup(chains[0])), daemon=True)
        th.start()
        deadline = time.monotonic() + 10
        while not reader.retries:
            assert time.monotonic() < deadline, "the lookup was not refused by the migrating shard's master"
            time.sleep(0.01)
        refused = int(src.info("commandstats").get("cmdstat_fcall_ro", {}).get("rejected_calls", 0))
        assert refused > 0, "the migrating shard was read from its master"
        assert not answers
    finally:
        for r in (src, dst):
            r.execute_command("CLUSTER", "SETSLOT", slot, "STABLE")
    th.join(timeout=30)
    assert answers == [single.lookup(chains[0])]
    assert reader.migrating_shards() == set()


def test_the_sharded_store_reloads_its_library_over_one_that_refuses_its_calls(cluster):
    """Every master runs a library of an older release (a sink of that release started later): the
    shards' calls are refused before they write, the library is loaded again, they are sent again."""
    from kvbus.sinks.view import functions
    from tests.test_sink_redis import older_library

    prefix = f"o{uuid.uuid4().hex[:8]}:"
    store = ShardedRedisStore(cluster.url, prefix)
    records = random_streams(4, T, holders=8, batches=60, pool=20, models=("llama", "qwen"))
    masters = [n.redis_connection for n in store.rc.get_primaries()]
    for r in masters:
        r.function_load(older_library(), replace=True)
    res = store.apply(records)
    assert not res.failed and res.applied == len(records)
    assert {r.fcall_ro("kvbus_version", 0).decode() for r in masters} == {functions.library_version()}
    model = InMemoryStore()
    model.apply(records)
    assert store.snapshot() == model.snapshot() and store.models() == model.models()
    assert len(set(store.models().values())) == 2
