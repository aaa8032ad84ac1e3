"""kvbus's function library (``sinks/view/lua/kvbus.lua``) runs identically on Redis 7.0 and on Valkey 9.1.

The same random histories, redelivered as Kafka may, are applied to a private Redis and a private
Valkey under the same prefix: every apply answers the same, the two keyspaces end byte for byte
equal, and lookups, dumps, restores, expiry and drops get the same replies. The errors the sink and
routers act on (a missing function, a changed view, a malformed call, a read-only replica) read the
same on both.

One difference is allowed, as neither server promises it: the order in which HGETALL returns a hash's
fields. A holder's dump lists its state fields, its tiers and their extra reference counts in that
order (Redis and Valkey differ there on some histories), so dumps are compared as maps; kvbus reads
them as maps (``RedisStore.dump_holder``, ``kvbus_restore``).
"""
from __future__ import annotations

import time
import uuid
from typing import Any

import pytest
import redis

from kvbus.infra.scratch_redis import VALKEY, RedisServer
from kvbus.schemas.topics import Topics
from kvbus.sinks.view import functions
from kvbus.sinks.view.redis_store import RedisStore, ViewChanged
from kvbus.sinks.view.refcounts import Weights
from kvbus.sinks.view.store import split_holder
from tests.histories import random_streams, redeliver

T = Topics(blocks="pb")
SPEC = Weights.parse("GPU=1,CPU=0.8").spec()


@pytest.fixture(scope="module")
def servers():
    """(a private Redis, a private Valkey)."""
    with RedisServer() as r, RedisServer(kind=VALKEY) as v:
        assert "valkey_version" not in r.client().info("server") and "valkey_version" in v.client().info("server")
        yield r, v


def keyspace(r: redis.Redis, prefix: str) -> dict[bytes, tuple[bytes, Any]]:
    """Every key under ``prefix``: its type and its whole content."""
    out: dict[bytes, tuple[bytes, Any]] = {}
    for key in r.scan_iter(prefix + "*", count=1000):
        kind = r.type(key)
        if kind == b"hash":
            value: Any = r.hgetall(key)
        elif kind == b"zset":
            value = r.zrange(key, 0, -1, withscores=True)
        elif kind == b"string":
            value = r.get(key)
        elif kind == b"set":
            value = r.smembers(key)
        else:
            value = r.lrange(key, 0, -1)
        out[key] = (kind, value)
    return out


def pairs(flat: list) -> dict:
    """``[k1, v1, k2, v2, ...]`` (an HGETALL reply) as a map."""
    return dict(zip(flat[::2], flat[1::2]))


def dump_maps(reply: list) -> tuple:
    """A ``kvbus_dump`` reply with its unordered parts as maps: (state fields, seen, tiers by code as
    (descriptor, ref-counted, raws held, extra counts))."""
    state, seen, tiers = reply
    return pairs(state), seen, {code: (desc, rc, raws, pairs(extra)) for code, desc, rc, raws, extra in tiers}


def _chains(records) -> list[list[bytes]]:
    """The hash chains the history stored or removed: the lookups to compare."""
    return [ev.event.block_hashes for _, ev in records if getattr(ev.event, "block_hashes", None)]


def _error(fn) -> str:
    with pytest.raises(redis.ResponseError) as info:
        fn()
    return f"{type(info.value).__name__}: {info.value}"


@pytest.mark.parametrize("seed", [3, 17, 42])
def test_random_histories_leave_the_same_keyspace_and_answers(servers, seed):
    prefix = f"q{uuid.uuid4().hex[:8]}:"
    clients = [s.client() for s in servers]
    stores = [RedisStore(c, prefix) for c in clients]
    records = random_streams(seed, T, holders=6, batches=300)
    for n, batch in enumerate(redeliver(records, seed)):
        a, b = (s.apply(batch, offsets={(T.blocks, 0): n}) for s in stores)
        assert a == b, f"batch {n}: Redis applied {a}, Valkey {b}"
        assert a.applied + a.skipped == len(batch)
    ka, kb = (keyspace(c, prefix) for c in clients)
    assert ka == kb
    assert len(ka) > 20, "the history wrote a view"

    # lookups: every run of the hashes the history used, answered byte for byte the same
    chains = _chains(records)
    assert len(chains) > 100
    for chain in chains:
        ra, rb = (functions.call(c, "kvbus_lookup", prefix, b"".join(chain), SPEC, readonly=True) for c in clients)
        assert ra == rb

    # dumps of every holder, restored under a new prefix: the same replies and keyspaces again
    holders = stores[0].holder_ids()
    assert holders == stores[1].holder_ids() and len(holders) == 6
    copy = f"{prefix}copy:"
    for hid, name in holders.items():
        da, db = (functions.call(c, "kvbus_dump", prefix, hid, readonly=True) for c in clients)
        assert dump_maps(da) == dump_maps(db)
        replica, dp = split_holder(name)
        dump = stores[0].dump_holder(hid)
        assert RedisStore(clients[0], copy).restore_holder(replica, dp, dump) == \
            RedisStore(clients[1], copy).restore_holder(replica, dp, dump)
    assert keyspace(clients[0], copy) == keyspace(clients[1], copy)

    # expiry, heartbeats and drops
    name = next(iter(holders.values()))
    replica, dp = split_holder(name)
    for s in stores:
        s.heartbeat(replica, dp, 1_800_000_000.0)
    expired = [s.expire_stale(600, 1_800_000_100.0, batch=2) for s in stores]
    assert expired[0] == expired[1] and len(expired[0]) == 5, "all but the holder that beat are stale"
    assert stores[0].drop_holder(replica, dp, 1.0) == stores[1].drop_holder(replica, dp, 1.0)
    assert keyspace(clients[0], prefix) == keyspace(clients[1], prefix)


def test_the_errors_the_sink_acts_on_read_the_same(servers):
    prefix = f"e{uuid.uuid4().hex[:8]}:"
    clients = [s.client() for s in servers]
    stores = [RedisStore(c, prefix) for c in clients]
    for c in clients:
        c.function_delete("kvbus")
    missing = [_error(lambda c=c: c.fcall_ro("kvbus_version", 0)) for c in clients]
    assert missing[0] == missing[1] and all(functions.is_missing(redis.ResponseError(m)) for m in missing)
    for c in clients:
        functions.ensure_library(c)
        assert c.fcall_ro("kvbus_version", 0).decode() == functions.library_version()

    for s in stores:
        s.set_view_id("v1")
    changed = []
    for s in stores:
        with pytest.raises(ViewChanged) as info:
            s.set_offsets({(T.blocks, 0): 5}, view_id="v2")
        changed.append(str(info.value))
    assert changed[0] == changed[1]

    malformed = [_error(lambda c=c: c.fcall("kvbus_apply", 0, prefix, "x")) for c in clients]
    assert malformed[0] == malformed[1] and "kvbus: malformed arguments" in malformed[0]


def test_a_replica_refuses_writes_alike_and_answers_lookups(servers):
    answers, refusals = [], []
    prefix = f"r{uuid.uuid4().hex[:8]}:"
    records = random_streams(5, T, holders=3, batches=60)
    for srv in servers:
        primary = srv.client()
        primary.config_set("repl-diskless-sync-delay", 0)  # both default to waiting 5 s for more replicas
        store = RedisStore(primary, prefix)
        store.apply(records)
        with RedisServer(["--replicaof", "127.0.0.1", str(srv.port)], kind=srv.kind) as rep:
            r = rep.client()
            deadline = time.monotonic() + 20
            while r.info("replication").get("master_link_status") != "up":
                assert time.monotonic() < deadline, f"{srv.kind.name} replica did not sync: {r.info('replication')}"
                time.sleep(0.05)
            assert primary.execute_command("WAIT", 1, 5000) >= 1
            on_replica = RedisStore(r, prefix, load=False)
            answer = {tuple(ch): on_replica.lookup(ch) for ch in _chains(records)}
            assert any(answer.values()), "the replica answers lookups from the replicated view"
            answers.append((answer, store.reader().summary()))
            with pytest.raises(redis.exceptions.ReadOnlyError) as info:
                r.fcall("kvbus_apply", 0, prefix, "a", 0)
            refusals.append(str(info.value))
    assert answers[0] == answers[1]
    assert refusals[0] == refusals[1]
