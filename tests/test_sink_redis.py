"""Redis-specific behaviour of the view: function (re)loading, read-only lookups (ACL user, replica),
clear cost proportional to the holder, compact encodings. Private redis-servers only."""
from __future__ import annotations

import time
import uuid

import msgspec
import pytest
import redis

from kvbus.infra.scratch_redis import RedisServer
from kvbus.schemas.events import AllBlocksCleared, BlockEvent, BlockStored, canonical_hash
from kvbus.sinks.view import functions
from kvbus.sinks.view.redis_store import RedisStore

TOPIC = "kvbus.blocks"
H = [canonical_hash(0xABC000 + i * 104729) for i in range(3000)]


@pytest.fixture(scope="module")
def server():
    with RedisServer() as srv:
        yield srv


def ev(replica: str, seq: int, event, dp: int = 0) -> BlockEvent:
    return BlockEvent(replica=replica, dp_rank=dp, epoch=1, seq=seq, index=0, ts=time.time(), event=event)


def gpu(hashes) -> BlockStored:
    return BlockStored(block_hashes=list(hashes), medium="GPU")


def prefix() -> str:
    return f"r{uuid.uuid4().hex[:8]}:"


def test_missing_functions_are_loaded_again_on_the_next_call(server):
    r = server.client()
    store = RedisStore(r, prefix())
    store.apply([(TOPIC, ev("a", 0, gpu(H[:3])))])
    r.function_delete("kvbus")
    res = store.apply([(TOPIC, ev("a", 1, gpu(H[3:5])))])  # pipelined FCALLs: "Function not found"
    assert res.applied == 1 and not res.failed
    r.function_delete("kvbus")
    assert store.lookup(H[:5])["a"].matched == 5
    r.function_delete("kvbus")
    assert store.expire_stale(10**9, now=1.0) == []


def test_an_older_library_version_is_replaced(server):
    r = server.client()
    r.function_load("#!lua name=kvbus\nredis.register_function{function_name='kvbus_version', "
                    "callback=function() return 'old' end, flags={'no-writes'}}", replace=True)
    RedisStore(r, prefix())
    assert r.fcall_ro("kvbus_version", 0).decode() == functions.library_version()


def older_library() -> str:
    """This library as a release before models had it: kvbus_apply and kvbus_restore refuse the
    holders' models (the trailing arguments it did not take), another version string."""
    code = functions.library_code()
    for taken in (" and (nH == 0 or #args ~= last + 2 + nH)", " and #args ~= base + 1 and #args ~= ag + 2 * nG"):
        assert taken in code
        code = code.replace(taken, "")
    return code.replace(functions.library_version(), "older-release")


def test_a_sink_reloads_its_library_when_another_release_loaded_one_that_refuses_its_calls(server):
    """A sink of an older release started later and loaded its library: this sink's writes are refused
    before anything is written; it loads its own again (which takes the older sink's calls too)."""
    r = server.client()
    store = RedisStore(r, prefix())
    def older():
        r.function_load(older_library(), replace=True)

    older()
    recs = [(TOPIC, msgspec.structs.replace(ev(n, 0, gpu(H[:3])), model="llama")) for n in ("a", "b")]
    res = store.apply(recs)
    assert (res.applied, res.failed) == (2, []) and store.models() == {"a#0": "llama", "b#0": "llama"}
    assert r.fcall_ro("kvbus_version", 0).decode() == functions.library_version()
    dump = store.dump_holder(0)
    older()
    again = RedisStore(r, prefix(), load=False)
    assert again.restore_holder("a", 0, dump) == 3 and again.models() == {"a#0": "llama"}
    older()
    with pytest.raises(redis.ResponseError, match="malformed arguments"):  # refused by this library too: raised
        functions.call(r, "kvbus_apply", store.prefix, 0, 0, 0)  # no event blob
    assert r.fcall_ro("kvbus_version", 0).decode() == functions.library_version()


def test_lookup_works_for_a_user_with_only_read_commands_and_fcall_ro(server):
    r = server.client()
    p = prefix()
    store = RedisStore(r, p)
    store.apply([(TOPIC, ev("a", 0, gpu(H[:4]))), (TOPIC, ev("b", 0, gpu(H[:2])))])
    r.execute_command("ACL", "SETUSER", "router", "reset", "on", ">s3cret", f"%R~{p}*", "-@all", "+@read",
                      "+fcall_ro")
    ro = redis.Redis(host="127.0.0.1", port=server.port, username="router", password="s3cret")
    lookup = RedisStore(ro, p, load=False)
    got = lookup.lookup(H[:4])
    assert {k: v.matched for k, v in got.items()} == {"a": 4, "b": 2}
    with pytest.raises(redis.exceptions.NoPermissionError):
        ro.fcall("kvbus_apply", 0, p, "a", 0)
    with pytest.raises(redis.exceptions.NoPermissionError):
        ro.set(p + "x", 1)
    r.function_delete("kvbus")
    with pytest.raises(functions.FunctionsUnavailable):
        lookup.lookup(H[:4])
    functions.load_library(r)


def test_lookup_works_on_a_replica(server):
    primary = server.client()
    functions.ensure_library(primary)
    with RedisServer(["--replicaof", "127.0.0.1", str(server.port)]) as rep:
        r = rep.client()
        deadline = time.time() + 20
        while r.info("replication").get("master_link_status") != "up":
            assert time.time() < deadline, "replica did not sync"
            time.sleep(0.1)
        p = prefix()
        store = RedisStore(primary, p)
        store.apply([(TOPIC, ev("a", 0, gpu(H[:6]))), (TOPIC, ev("a", 0, gpu(H[:3]), dp=1))])
        assert primary.execute_command("WAIT", 1, 5000) >= 1
        on_replica = RedisStore(r, p, load=False)
        assert on_replica.lookup(H[:6]) == store.lookup(H[:6])
        assert set(on_replica.lookup(H[:6])) == {"a#0", "a#1"}
        with pytest.raises(redis.exceptions.ReadOnlyError):
            r.fcall("kvbus_apply", 0, p, "a", 0)


def test_clearing_a_holder_touches_only_its_own_blocks(server):
    r = server.client()
    store = RedisStore(r, prefix())
    store.apply([(TOPIC, ev("big", 0, gpu(H[:3000])))])
    store.apply([(TOPIC, ev("small", 0, gpu(H[:20])))])
    r.config_resetstat()
    res = store.apply([(TOPIC, ev("small", 1, AllBlocksCleared()))])
    stats = r.info("commandstats")
    assert res.clears == 1 and res.entries_delta == -20
    hget = stats.get("cmdstat_hget", {}).get("calls", 0)
    gets = stats.get("cmdstat_get", {}).get("calls", 0)
    assert hget <= 20 + 5, f"{hget} HGETs to clear 20 blocks"
    assert gets <= 2, "one index bucket"
    assert "cmdstat_scan" not in stats and "cmdstat_keys" not in stats
    assert store.reader().summary() == {"big": {"GPU": 3000}}


def test_structures_use_compact_encodings(server):
    r = server.client()
    p = prefix()
    store = RedisStore(r, p)
    recs = [(TOPIC, ev(f"h{i}", 0, gpu(H[:2000]))) for i in range(30)]  # 30 holders: wide blocks
    store.apply(recs)
    encodings = {r.object("encoding", k) for k in r.scan_iter(p + "B:*", count=1000)}
    assert encodings == {b"listpack"}
    wide = list(r.scan_iter(p + "W:*", count=1000))
    assert wide and {r.type(k) for k in wide} == {b"string"}, "wide blocks: one packed member string each"
    assert {r.strlen(k) for k in wide} == {3 * 30}
    index = list(r.scan_iter(p + "I:*", count=1000))
    assert {r.type(k) for k in index} == {b"string"}, "index buckets: toggle logs of 8-byte raws"
    assert sum(r.strlen(k) for k in index) == 8 * 30 * 2000, "a store-only history leaves no garbage"
    assert r.object("encoding", p + "hname") == b"hashtable"
    assert store.lookup(H[:100])["h7"].matched == 100


def test_a_lookup_client_learns_holders_created_after_it_started(server):
    r = server.client()
    p = prefix()
    writer, reader = RedisStore(r, p), RedisStore(r, p, load=False)
    writer.apply([(TOPIC, ev("a", 0, gpu(H[:2])))])
    assert set(reader.lookup(H[:2])) == {"a"}
    writer.apply([(TOPIC, ev("n", 0, gpu(H[:2]))), (TOPIC, ev("a", 0, gpu(H[:1]), dp=1))])
    assert {k: v.matched for k, v in reader.lookup(H[:2]).items()} == {"a#0": 2, "a#1": 1, "n": 2}


def test_calls_are_streamed_and_a_failure_leaves_the_connection_in_step(server):
    """apply writes each FCALL as soon as it is packed: a record refused while packing (hash not 8
    bytes) after some calls went out raises, and the connection does not hand their unread replies
    to the next command."""
    r = redis.Redis(connection_pool=redis.ConnectionPool.from_url(server.url, max_connections=1))
    store = RedisStore(r, prefix(), max_events_per_call=1)
    bad = BlockStored(block_hashes=[b"1234567"], medium="GPU")
    with pytest.raises(ValueError, match="not 8 bytes"):
        store.apply([(TOPIC, ev("a", i, gpu(H[i:i + 1]))) for i in range(5)] + [(TOPIC, ev("a", 5, bad))])
    assert r.ping() is True
    res = store.apply([(TOPIC, ev("a", i, gpu(H[i:i + 1]))) for i in range(7)])
    assert res.applied + res.skipped == 7 and res.skipped <= 5  # the calls sent before the failure may have run
    assert store.lookup(H[:7])["a"].matched == 7


def test_a_connection_lost_mid_batch_is_retried_whole(server):
    """The streamed calls fall back to one pipeline when the connection drops; positions make the
    calls that ran twice duplicates."""
    r = server.client()
    store = RedisStore(r, prefix(), max_events_per_call=2)
    recs = [(TOPIC, ev("a", i, gpu(H[i:i + 1]))) for i in range(10)]
    calls = [args for _, args in store.packer.plan(recs)]

    def killed_after_two():
        for k, call in enumerate(calls):
            if k == 2:
                r.client_kill_filter(_type="normal", skipme=True)
            yield call

    sent: list = []
    replies = store.transport.run("kvbus_apply", killed_after_two(), sent)
    assert len(sent) == 5 and all(not isinstance(x, Exception) for x in replies)
    assert store.lookup(H[:10])["a"].matched == 10
    assert store.apply(recs).skipped == 10
