"""The locks of the secured stack hold (issue 12): each principal can do what its stage needs and
is refused, promptly and with an authorization or authentication error, what it must not do; a
wrong password and a plaintext client are refused; no secret reaches a file it should not.

Clients are confluent-kafka, redis-py and confluent-kafka's registry client, configured directly
from the stack's files (not through kvbus settings). The stack is the session's own
(``secure_stack`` in conftest: the code of ``infra/stack up --secure`` on free ports)."""
from __future__ import annotations

import socket
import ssl
import stat
import time
import uuid

import pytest
import redis
from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import NewTopic
from confluent_kafka.schema_registry import Schema, SchemaRegistryClient, SchemaRegistryError
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvbus.client import Load, LoadReporter, ViewClient
from kvbus.infra import secure
from kvbus.infra.secure_plan import ANALYTICS, BRIDGE, KAFKA_USERS, PRINCIPALS, ROUTER, SINK, STREAMS
from kvbus.infra.stack_env import read_env_file
from kvbus.schemas.events import BlockEvent, BlockStored, canonical_hash
from kvbus.schemas.topics import REPORT_GROUP_PREFIX, Topics
from kvbus.sinks.config import SinkConfig
from kvbus.sinks.view.redis_store import RedisStore
from kvbus.streams.options import StreamsOptions
from tests.secure_stack import Errors, first_message, kafka_conf, produce_one, wait_for

# the secured stack is a session fixture: its tests share one worker under pytest-xdist
pytestmark = [pytest.mark.secure, pytest.mark.xdist_group("secure")]

T = Topics()  # the secured stack runs with the default topic names
DENIED = KafkaError.TOPIC_AUTHORIZATION_FAILED
PROMPT = 20.0  # seconds within which a refusal must arrive (a hang fails the test)


def group_conf(layout, principal: str, group: str, errors: Errors | None = None, **conf) -> dict:
    return kafka_conf(layout, principal, errors, **{"group.id": group, "auto.offset.reset": "earliest",
                                                    "enable.auto.commit": False, **conf})


# ---------------------------------------------------------------------------- Kafka: what each stage may do


def test_bridge_produces_raw_and_dead_letters_but_not_consolidated_topics(secure_stack):
    conf = kafka_conf(secure_stack, BRIDGE, **{"enable.idempotence": True})
    assert produce_one(conf, T.raw) is None
    assert produce_one(conf, T.dlq) is None
    for topic in (T.packed, T.for_ownership("kvcr", packed=True), T.blocks, T.for_ownership("kvcr"), T.incomplete,
                  T.snapshots):
        err = produce_one(conf, topic)
        assert err is not None and err.code() == DENIED, (topic, err)


def test_analytics_reads_every_topic_and_produces_nothing(secure_stack):
    value = uuid.uuid4().bytes
    assert produce_one(kafka_conf(secure_stack, BRIDGE), T.raw, value) is None
    c = Consumer(group_conf(secure_stack, ANALYTICS, f"{REPORT_GROUP_PREFIX}{uuid.uuid4().hex[:8]}"))
    try:
        parts = c.list_topics(T.raw, timeout=PROMPT).topics[T.raw].partitions
        c.assign([TopicPartition(T.raw, p, 0) for p in parts])
        deadline = time.monotonic() + PROMPT
        seen = False
        while not seen and time.monotonic() < deadline:
            msg = c.poll(0.5)
            assert msg is None or msg.error() is None, msg.error()
            seen = msg is not None and msg.value() == value
        assert seen, "analytics did not read the bridge's record"
    finally:
        c.close()
    for topic in (T.raw, T.packed, T.blocks, T.incomplete, T.dlq):  # (the snapshot topic exists once a sink made it)
        err = produce_one(kafka_conf(secure_stack, ANALYTICS), topic)
        assert err is not None and err.code() == DENIED, (topic, err)


def test_sink_reads_block_topics_in_its_group_but_not_raw(secure_stack):
    group = SinkConfig().group
    value = uuid.uuid4().bytes
    tiers = [T.for_ownership("lmcache", packed=packed) for packed in (True, False)]  # both block layouts
    admin = secure.dev_topics.admin_client(secure_stack.bootstrap, **secure.admin_conf(secure_stack))
    for tier, fut in admin.create_topics([NewTopic(tier, 1, 1) for tier in tiers]).items():
        try:
            fut.result(PROMPT)
        except KafkaException as e:  # made by an earlier run: fine
            assert e.args[0].code() == KafkaError.TOPIC_ALREADY_EXISTS, (tier, e)
    for tier in tiers:
        assert produce_one(kafka_conf(secure_stack, STREAMS), tier, value) is None, tier
    c = Consumer(group_conf(secure_stack, SINK, group))
    try:
        c.subscribe([T.blocks_pattern()])
        deadline = time.monotonic() + 60
        got = {}
        while set(got) != set(tiers) and time.monotonic() < deadline:
            msg = c.poll(0.5)
            if msg is not None and msg.error() is None and msg.value() == value:
                got[msg.topic()] = msg
        assert set(got) == set(tiers), got
        for msg in got.values():
            c.commit(msg, asynchronous=False)  # its group: READ allowed
    finally:
        c.close()
    c = Consumer(group_conf(secure_stack, SINK, group))
    try:
        c.subscribe([T.raw])
        msg = first_message(c, PROMPT)
        assert msg is not None and msg.error() is not None and msg.error().code() == DENIED, msg and msg.error()
    finally:
        c.close()


def test_sink_writes_dead_letters_and_snapshots_only(secure_stack):
    conf = kafka_conf(secure_stack, SINK)
    assert produce_one(conf, T.dlq) is None
    admin = secure.dev_topics.admin_client(secure_stack.bootstrap, **conf)
    fut = admin.create_topics([NewTopic(T.snapshots, 1, 1, config={"cleanup.policy": "compact"})])[T.snapshots]
    try:
        fut.result(PROMPT)
    except KafkaException as e:  # made by an earlier test or run: fine, the write below is the point
        assert e.args[0].code() == KafkaError.TOPIC_ALREADY_EXISTS, e
    # compacted: records need a key; this one is no view's (snapshot readers skip other prefixes)
    assert produce_one(conf, T.snapshots, key=b"test-probe") is None
    for topic in (T.raw, T.packed, T.blocks, T.incomplete):
        err = produce_one(conf, topic)
        assert err is not None and err.code() == DENIED, (topic, err)


def test_streams_reads_raw_writes_outputs_and_creates_tier_and_own_topics_only(secure_stack):
    app = StreamsOptions().app_id
    conf = kafka_conf(secure_stack, STREAMS)
    for topic in (T.packed, T.blocks, T.incomplete, T.dlq):
        assert produce_one(conf, topic) is None, topic
    err = produce_one(conf, T.raw)
    assert err is not None and err.code() == DENIED
    admin = secure.dev_topics.admin_client(secure_stack.bootstrap, **conf)
    ownership = f"t{uuid.uuid4().hex[:6]}"
    tiers = [T.for_ownership(ownership, packed=packed) for packed in (True, False)]  # both block layouts
    changelog, other = f"{app}-x{uuid.uuid4().hex[:6]}-changelog", f"x{uuid.uuid4().hex[:6]}"
    futs = admin.create_topics([NewTopic(t, 1, 1) for t in (*tiers, changelog, other)], operation_timeout=PROMPT)
    for name in (*tiers, changelog):
        futs[name].result(PROMPT)
    with pytest.raises(KafkaException) as refused:
        futs[other].result(PROMPT)
    assert refused.value.args[0].code() == KafkaError.TOPIC_AUTHORIZATION_FAILED
    c = Consumer(group_conf(secure_stack, STREAMS, app))
    try:
        c.subscribe([T.raw])
        deadline = time.monotonic() + 60
        while c.assignment() == [] and time.monotonic() < deadline:
            msg = c.poll(0.5)
            assert msg is None or msg.error() is None or msg.error().code() == KafkaError._PARTITION_EOF, msg.error()
        assert c.assignment(), "the worker's group got no partitions of the raw topic"
    finally:
        c.close()
    errors = Errors()
    c = Consumer(group_conf(secure_stack, STREAMS, SinkConfig().group, errors))  # another stage's group
    try:
        c.subscribe([T.raw])
        msg = first_message(c, PROMPT)
        assert msg is not None and msg.error() is not None, "joined the sink's group"
        assert msg.error().code() == KafkaError.GROUP_AUTHORIZATION_FAILED, msg.error()
    finally:
        c.close()


def test_router_has_no_kafka_user(secure_stack):
    assert ROUTER not in KAFKA_USERS
    errors = Errors()
    p = Producer(kafka_conf(secure_stack, ROUTER, errors))
    assert wait_for(lambda: KafkaError._AUTHENTICATION in errors.codes(), PROMPT, lambda: p.poll(0.2))


def test_a_wrong_password_is_refused_with_an_authentication_error(secure_stack):
    errors = Errors()
    wrong = {"sasl.password": "not-" + secure.password(secure_stack, BRIDGE)}
    p = Producer(kafka_conf(secure_stack, BRIDGE, errors, **wrong))
    assert wait_for(lambda: KafkaError._AUTHENTICATION in errors.codes(), PROMPT, lambda: p.poll(0.2))
    auth = next(e for e in errors.seen if e.code() == KafkaError._AUTHENTICATION)
    assert "invalid credentials" in auth.str()
    with pytest.raises(KafkaException):
        p.list_topics(timeout=3)


def test_plaintext_and_unauthenticated_tls_clients_get_nothing(secure_stack):
    errors = Errors()
    p = Producer({"bootstrap.servers": secure_stack.bootstrap, "logger": kafka_conf(secure_stack, BRIDGE)["logger"],
                  "error_cb": errors})
    assert wait_for(lambda: errors.codes() & {KafkaError._TRANSPORT, KafkaError._ALL_BROKERS_DOWN}, PROMPT,
                    lambda: p.poll(0.2))
    with pytest.raises(KafkaException):
        p.list_topics(timeout=3)
    errors = Errors()
    p = Producer({"bootstrap.servers": secure_stack.bootstrap, "security.protocol": "SSL",
                  "ssl.ca.location": str(secure_stack.ca), "logger": kafka_conf(secure_stack, BRIDGE)["logger"],
                  "error_cb": errors})
    assert wait_for(lambda: bool(errors.seen), PROMPT, lambda: p.poll(0.2))  # TLS without SASL: dropped
    with pytest.raises(KafkaException):
        p.list_topics(timeout=3)


@pytest.mark.parametrize("listener", ["controller", "internal"])
def test_the_broker_only_listeners_require_the_brokers_certificate(secure_stack, listener):
    port = getattr(secure_stack.ports, listener)
    ctx = ssl.create_default_context(cafile=str(secure_stack.ca))  # trusts the server, has no client certificate
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
        with pytest.raises((ssl.SSLError, ConnectionError)):
            with ctx.wrap_socket(raw, server_hostname="127.0.0.1") as s:
                s.sendall(b"\x00\x00\x00\x01\x00")
                if not s.recv(1):  # TLS 1.3: the refusal arrives after the handshake
                    raise ConnectionError("closed by the broker")


# ---------------------------------------------------------------------------- Redis


def ev(replica: str, seq: int, hashes) -> BlockEvent:
    return BlockEvent(replica=replica, dp_rank=0, epoch=1, seq=seq, index=0, ts=time.time(),
                      event=BlockStored(block_hashes=list(hashes), medium="GPU"))


def test_sink_writes_the_view_and_the_router_reads_it_and_writes_only_its_load_and_predictions(secure_stack):
    prefix = SinkConfig().prefix
    hashes = [canonical_hash(0x5EC000 + i) for i in range(4)]
    replica = f"r{uuid.uuid4().hex[:6]}"
    with secure.redis_client(secure_stack, SINK) as r:
        store = RedisStore(r, prefix)  # FUNCTION LOAD (when missing) and FCALL kvbus_apply
        assert store.apply([(T.blocks, ev(replica, 0, hashes))]).applied == 1
    with secure.redis_client(secure_stack, ROUTER) as r:
        found = RedisStore(r, prefix, load=False).lookup(hashes)  # FCALL_RO kvbus_lookup, reads
        assert found[replica].matched == 4
        # its own keys: it reports its load and predicts (ViewClient over this connection)
        view = ViewClient(r, prefix)
        LoadReporter(view, "secure-router").started(replica, 8)
        assert view.load()[replica] == Load(1, 8)
        assert view.predict(f"{replica}#0", hashes=hashes + [canonical_hash(0x5EC0FF)], ttl=30) == 5
        # nothing else: a write function touching the view's own keys is refused, and so is any other write
        with pytest.raises(redis.exceptions.ResponseError, match="can't access at least one of the keys"):
            r.fcall("kvbus_drop", 0, prefix, f"{replica}#0", "1.0")
        assert RedisStore(r, prefix, load=False).lookup(hashes)[replica].matched == 4
        with pytest.raises(redis.exceptions.NoPermissionError):
            r.set(prefix + "x", "1")
        with pytest.raises(redis.exceptions.NoPermissionError):
            r.hset(prefix + "hname", "99", "evil")
        with pytest.raises(redis.exceptions.NoPermissionError):
            r.function_load("#!lua name=evil\nredis.register_function('evil', function() return 1 end)", replace=True)
        with pytest.raises(redis.exceptions.NoPermissionError):
            r.function_delete("kvbus")


def test_sink_is_confined_to_the_views_keys_and_to_non_dangerous_commands(secure_stack):
    with secure.redis_client(secure_stack, SINK) as r:
        r.set(SinkConfig().prefix + "probe", "1")
        with pytest.raises(redis.exceptions.NoPermissionError):
            r.set("elsewhere:probe", "1")
        with pytest.raises(redis.exceptions.NoPermissionError):
            r.flushall()
        with pytest.raises(redis.exceptions.NoPermissionError):
            r.function_flush()
        with pytest.raises(redis.exceptions.NoPermissionError):
            r.function_delete("kvbus")
        with pytest.raises(redis.exceptions.NoPermissionError):
            r.config_get("*")


@pytest.mark.parametrize("principal", sorted(set(PRINCIPALS) - {"admin", SINK, ROUTER}))
def test_stages_without_redis_rights_have_no_redis_user(secure_stack, principal):
    with pytest.raises(redis.exceptions.AuthenticationError):
        with secure.redis_client(secure_stack, principal) as r:
            r.ping()


def test_redis_refuses_the_default_user_a_wrong_password_and_plaintext(secure_stack):
    port = secure_stack.ports.redis
    ca = str(secure_stack.ca)
    once = {"retry": Retry(NoBackoff(), 0), "socket_connect_timeout": 5, "socket_timeout": 5}
    with redis.Redis(host="127.0.0.1", port=port, ssl=True, ssl_ca_certs=ca, **once) as r:
        with pytest.raises(redis.exceptions.AuthenticationError):
            r.get(SinkConfig().prefix + "meta")  # NOAUTH: the default user is off
    with redis.Redis(host="127.0.0.1", port=port, ssl=True, ssl_ca_certs=ca, username=SINK, password="wrong",
                     **once) as r:
        with pytest.raises(redis.exceptions.AuthenticationError):
            r.ping()
    with redis.Redis(host="127.0.0.1", port=port, username=SINK, password=secure.password(secure_stack, SINK),
                     **once) as r:
        with pytest.raises(redis.exceptions.ConnectionError):
            r.ping()


# ---------------------------------------------------------------------------- registry


def registry(layout, principal: str | None = None, password: str | None = None) -> SchemaRegistryClient:
    conf = {"url": layout.registry.url, "ssl.ca.location": str(layout.ca), "timeout": 10}
    if principal:
        conf["basic.auth.user.info"] = f"{principal}:{password or secure.password(layout, principal)}"
    return SchemaRegistryClient(conf)


def test_registry_writes_need_a_developer_and_reads_are_open(secure_stack):
    subject = f"t{uuid.uuid4().hex[:8]}-value"
    schema = Schema('{"type": "record", "name": "T", "fields": [{"name": "a", "type": "int"}]}', "AVRO")
    sid = registry(secure_stack, BRIDGE).register_schema(subject, schema)
    for client, status in ((registry(secure_stack), 401), (registry(secure_stack, BRIDGE, "wrong"), 401),
                           (registry(secure_stack, ANALYTICS), 403)):
        with pytest.raises(SchemaRegistryError) as refused:
            client.register_schema(f"{subject}-2", schema)
        assert refused.value.http_status_code == status
    assert registry(secure_stack).get_schema(sid).schema_str.replace(" ", "") == schema.schema_str.replace(" ", "")
    assert subject in registry(secure_stack, ANALYTICS).get_subjects()


def test_registry_speaks_https_only(secure_stack):
    with socket.create_connection(("127.0.0.1", secure_stack.ports.registry), timeout=5) as s:
        s.sendall(b"GET /apis/ccompat/v7/subjects HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        s.settimeout(5)
        try:
            reply = s.recv(4096)
        except ConnectionError:
            reply = b""
    assert not reply.startswith(b"HTTP/1.1 200")


# ---------------------------------------------------------------------------- files and secrets


def test_env_files_hold_settings_not_secrets_and_secret_files_are_private(secure_stack):
    passwords = {p: secure.password(secure_stack, p) for p in PRINCIPALS}
    for p in PRINCIPALS:
        path = secure_stack.env_file(p)
        text = path.read_text()
        env = read_env_file(path)
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert not any(pw in text for pw in passwords.values()), p
        assert all(k.startswith("KVBUS_") for k in env)
        for key in [k for k in env if k.endswith("_PASSWORD_FILE")]:
            assert env[key] == str(secure_stack.password_file(p))
            assert stat.S_IMODE(secure_stack.password_file(p).stat().st_mode) == 0o600
        assert (p in KAFKA_USERS) == ("KVBUS_KAFKA_SASL_USERNAME" in env)
        assert env["KVBUS_BOOTSTRAP"] == secure_stack.bootstrap  # every file points at this stack only
    router = read_env_file(secure_stack.env_file(ROUTER))
    assert router["KVBUS_REDIS_USERNAME"] == ROUTER
    assert not {k for k in router if k.startswith("KVBUS_KAFKA_") or k.startswith("KVBUS_REGISTRY_USER")}
    assert read_env_file(secure_stack.env_file(SINK))["KVBUS_REDIS_URL"].startswith("rediss://")


def test_no_password_in_logs_configs_or_command_lines(secure_stack):
    passwords = [secure.password(secure_stack, p) for p in (*PRINCIPALS, secure.REGISTRY_KAFKA_USER)]
    public = [*secure_stack.paths.logs.glob("*"), *secure_stack.paths.run.glob("*"),
              *secure_stack.paths.kafka_conf.rglob("*.properties"), secure_stack.redis_acl]
    assert public
    for path in public:
        if path.is_file():
            text = path.read_text(errors="replace")
            assert not any(pw in text for pw in passwords), path
    st = secure.status(secure_stack)
    for svc in st["services"].values():
        cmdline = open(f"/proc/{svc['pid']}/cmdline", "rb").read().decode(errors="replace")
        assert not any(pw in cmdline for pw in passwords), svc


def test_status_reports_the_secured_services_ready(secure_stack):
    st = secure.status(secure_stack)
    assert st["ready"] and set(st["services"]) == {"kafka", "registry", "redis"}, st


def test_up_again_changes_nothing_and_a_restart_keeps_keys_users_and_schemas(secure_stack):
    before = {name: svc["pid"] for name, svc in secure.status(secure_stack)["services"].items()}
    ca = secure_stack.ca.read_bytes()
    subject = f"t{uuid.uuid4().hex[:8]}-value"
    schema = Schema('{"type": "record", "name": "R", "fields": [{"name": "b", "type": "long"}]}', "AVRO")
    sid = registry(secure_stack, SINK).register_schema(subject, schema)
    secure.up(secure_stack)
    assert {name: svc["pid"] for name, svc in secure.status(secure_stack)["services"].items()} == before
    stopped = secure.down(secure_stack)
    assert set(stopped.values()) <= {"stopped", "killed"} and len(stopped) == 3, stopped
    assert not secure.status(secure_stack)["ready"]
    secure.up(secure_stack)
    assert secure.status(secure_stack)["ready"]
    assert secure_stack.ca.read_bytes() == ca  # same CA: clients' trust survives a restart
    assert produce_one(kafka_conf(secure_stack, BRIDGE), T.raw) is None  # SCRAM users are in the metadata log
    err = produce_one(kafka_conf(secure_stack, BRIDGE), T.packed)
    assert err is not None and err.code() == DENIED  # and so are the ACLs
    assert registry(secure_stack).get_schema(sid).schema_str  # KafkaSQL replayed the journal
