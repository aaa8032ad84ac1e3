"""kvbus.runtime.kafka_clients: every stage's client configuration from one base, one handling of
what Kafka refuses, and topics created as declared."""
from __future__ import annotations

import logging
import uuid

import pytest
from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient, ConfigResource

from kvbus.runtime.kafka_clients import (
    CONSUMER_CONF,
    PRODUCER_CONF,
    DeliveryErrors,
    GroupOffsets,
    consumer_conf,
    ensure_topics,
    producer_conf,
    reader_conf,
    until_coordinator_answers,
)
from kvbus.runtime.security import Security
from kvbus.runtime.settings import Settings
from kvbus.schemas.topics import REBUILD_GROUP_PREFIX, record_spec, snapshot_spec

SASL = {"KVBUS_KAFKA_SECURITY_PROTOCOL": "SASL_PLAINTEXT", "KVBUS_KAFKA_SASL_USERNAME": "sink",
        "KVBUS_KAFKA_SASL_PASSWORD": "pw"}


def secured_kafka() -> dict:
    return Settings(security=Security.from_env(SASL)).kafka()


def test_a_role_lays_its_properties_over_the_base_and_never_over_the_connection() -> None:
    role = {"linger.ms": 20, "security.protocol": "PLAINTEXT", "bootstrap.servers": "elsewhere:1"}
    conf = producer_conf(secured_kafka(), role, {"acks": "1"}, error_cb=print)
    assert conf["linger.ms"] == 20 and conf["enable.idempotence"] is True and conf["partitioner"] == "murmur2_random"
    assert (conf["security.protocol"], conf["sasl.username"]) == ("SASL_PLAINTEXT", "sink")
    assert conf["bootstrap.servers"] == Settings().bootstrap
    assert conf["acks"] == "1" and conf["error_cb"] is print  # an operator's override, then the callbacks
    assert {k: conf[k] for k in PRODUCER_CONF if k not in ("linger.ms", "acks")} == \
        {k: v for k, v in PRODUCER_CONF.items() if k not in ("linger.ms", "acks")}


def test_consumers_commit_only_explicitly_and_readers_get_a_group_of_their_own() -> None:
    conf = consumer_conf("h:1", "kvbus-sink", {"session.timeout.ms": 10_000})
    assert conf["group.id"] == "kvbus-sink" and conf["enable.auto.commit"] is False
    assert conf["session.timeout.ms"] == 10_000 and conf["bootstrap.servers"] == "h:1"
    assert {k: conf[k] for k in CONSUMER_CONF} == dict(CONSUMER_CONF)
    a, b = reader_conf("h:1", REBUILD_GROUP_PREFIX), reader_conf("h:1", REBUILD_GROUP_PREFIX)
    assert a["group.id"].startswith(REBUILD_GROUP_PREFIX) and a["group.id"] != b["group.id"]


def test_the_stages_clients_are_built_from_the_factory() -> None:
    from kvbus.producers.record_producer import (
        BRIDGE_PRODUCER_CONF,
        DEFAULT_PRODUCER_CONF,
        producer_conf as bridge_conf,
    )

    conf = bridge_conf(secured_kafka(), {"linger.ms": 7})  # an operator's override wins over the role's
    assert conf["message.timeout.ms"] == 0 and conf["linger.ms"] == 7 and conf["sasl.username"] == "sink"
    assert bridge_conf("h:1")["linger.ms"] == BRIDGE_PRODUCER_CONF["linger.ms"] == 1  # the role's over the common 5
    assert {k: DEFAULT_PRODUCER_CONF[k] for k in PRODUCER_CONF if k not in BRIDGE_PRODUCER_CONF} == \
        {k: v for k, v in PRODUCER_CONF.items() if k not in BRIDGE_PRODUCER_CONF}


def test_a_refusal_is_described_counted_logged_once_per_interval_and_raised_by_policy(caplog) -> None:
    errors = DeliveryErrors(secured_kafka(), logging.getLogger("test.delivery"), "sink: ", every=60)
    denied = KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED, "Topic authorization failed")
    with caplog.at_level(logging.INFO, "test.delivery"):
        text = errors.refused(denied, "kvbus.dlq")
        errors.refused(denied, "kvbus.dlq")
    assert "user 'sink'" in text and "ACLs" in text
    assert errors.refusals == 2 and errors.last.startswith("a record to kvbus.dlq was refused")
    assert [r.getMessage() for r in caplog.records] == [f"sink: record to kvbus.dlq refused: {text}"]
    with pytest.raises(KafkaException, match=r"dead letters not delivered \(0 pending"):
        errors.raise_if_undelivered("dead letters", 0)
    errors.raise_if_undelivered("dead letters", 0)  # taken: nothing new since
    with pytest.raises(KafkaException, match=r"\(3 pending"):
        errors.raise_if_undelivered("dead letters", 3)
    errors.error_cb(KafkaError(KafkaError._TRANSPORT, "brokers down"))
    assert errors.last_is_client and "brokers down" in errors.last
    errors.acknowledged()
    assert errors.last is None


@pytest.mark.integration
def test_topics_are_created_as_declared_once(stack: Settings) -> None:
    import uuid

    from tests.conftest import _delete_topics

    prefix = f"k{uuid.uuid4().hex[:8]}."
    specs = [record_spec(prefix + "blocks", 3, 1), snapshot_spec(prefix + "snapshots", 1)]
    try:
        assert sorted(ensure_topics(stack.bootstrap, specs)) == [prefix + "blocks", prefix + "snapshots"]
        assert ensure_topics(stack.kafka(), specs) == []
        admin = AdminClient({"bootstrap.servers": stack.bootstrap})
        md = admin.list_topics(timeout=10).topics
        assert (len(md[prefix + "blocks"].partitions), len(md[prefix + "snapshots"].partitions)) == (3, 1)
        for spec in specs:
            [fut] = admin.describe_configs([ConfigResource(ConfigResource.Type.TOPIC, spec.name)]).values()
            got = {k: v.value for k, v in fut.result(30).items()}
            assert {k: got[k] for k in spec.config} == dict(spec.config), spec.name
    finally:
        _delete_topics(stack, prefix)



def test_group_offsets_read_each_partitions_log_start_and_end_now(stack: Settings) -> None:
    """What table recovery asks for (kvbus.streams.faust_adapter, "The offsets beside the fetch"):
    (earliest offset, high watermark) per partition, current after a write, not a cached value."""
    from confluent_kafka import Producer

    from tests.conftest import _delete_topics

    prefix = f"w{uuid.uuid4().hex[:8]}."
    topic = prefix + "marks"
    ensure_topics(stack.bootstrap, [record_spec(topic, 2, 1)])
    offsets = GroupOffsets(stack.kafka(), "marks-" + uuid.uuid4().hex[:8])
    producer = Producer({"bootstrap.servers": stack.bootstrap})
    try:
        # written first: delivered records mean both partitions have a leader (a topic created an
        # instant ago may not have one yet, and a look-up then fails)
        for partition, count in ((0, 5), (1, 1)):
            for i in range(count):
                producer.produce(topic, value=b"%d" % i, partition=partition)
        assert producer.flush(30) == 0
        assert offsets.watermarks([(topic, 0), (topic, 1)]) == {(topic, 0): (0, 5), (topic, 1): (0, 1)}
        producer.produce(topic, value=b"more", partition=1)
        assert producer.flush(30) == 0
        assert offsets.watermarks([(topic, 1)]) == {(topic, 1): (0, 2)}  # asked again, not cached
    finally:
        offsets.close()
        _delete_topics(stack, prefix)


# -- GroupOffsets: a group's committed offsets, read while its coordinator is not ready ------

COMMITTED_LOOP = """
import sys, time, uuid
from kvbus.runtime.kafka_clients import GroupOffsets
bootstrap, seconds = sys.argv[1], float(sys.argv[2])
answered = failed = 0
end = time.monotonic() + seconds
while time.monotonic() < end:
    offsets = GroupOffsets(bootstrap, "fresh-" + uuid.uuid4().hex[:8])
    try:
        got = offsets.committed([("never-committed", p) for p in range(4)], timeout=10)
        assert set(got.values()) == {None}, got
        answered += 1
    except Exception as e:
        failed += 1
        print("failed:", type(e).__name__, e, flush=True)
    finally:
        offsets.close()
print("answered", answered, "failed", failed, flush=True)
"""


def test_group_offsets_are_read_while_a_fresh_clusters_coordinators_load(stack: Settings, tmp_path, monkeypatch):
    """From the first second of a fresh cluster, the group coordinators answer NOT_COORDINATOR
    while they load: librdkafka's admin client dies of SIGSEGV there (the worker did, after
    rebalances), GroupOffsets retries and answers. Then it reads back what a group committed."""
    import subprocess
    import sys

    from confluent_kafka import Consumer, TopicPartition

    from tests.private_kafka import PrivateKafka

    kafka = PrivateKafka(tmp_path / "kafka-state", monkeypatch)
    try:
        kafka.up()
        loop = subprocess.run([sys.executable, "-c", COMMITTED_LOOP, kafka.bootstrap, "8"],
                              capture_output=True, text=True, timeout=120)
        out = loop.stdout + loop.stderr
        assert loop.returncode == 0, f"the reader exited with {loop.returncode} (-11: SIGSEGV): {out[-2000:]}"
        assert "answered" in out and not out.split("answered")[-1].strip().startswith("0 "), out[-2000:]

        ensure_topics(kafka.bootstrap, [record_spec("committed-here", 2, 1)])
        group = "committer-" + uuid.uuid4().hex[:8]
        committer = Consumer(consumer_conf(kafka.bootstrap, group))
        try:
            committer.commit(offsets=[TopicPartition("committed-here", 0, 5)], asynchronous=False)
        finally:
            committer.close()
        offsets = GroupOffsets(kafka.bootstrap, group)
        try:
            assert offsets.committed([("committed-here", 0), ("committed-here", 1)]) == {
                ("committed-here", 0): 5, ("committed-here", 1): None}
        finally:
            offsets.close()
    finally:
        kafka.kill()


# -- a coordinator that moved is asked again -------------------------------------------------

def _answers_after(errors: list[int]):
    """A call raising KafkaException with each code of ``errors`` in turn, then answering "ok";
    it records the seconds left it was given."""
    lefts: list[float] = []

    def call(left: float) -> str:
        lefts.append(left)
        if len(lefts) <= len(errors):
            raise KafkaException(KafkaError(errors[len(lefts) - 1]))
        return "ok"

    return call, lefts


def test_a_moved_or_loading_coordinator_is_asked_again_until_it_answers():
    call, lefts = _answers_after([KafkaError.NOT_COORDINATOR, KafkaError.COORDINATOR_LOAD_IN_PROGRESS,
                                  KafkaError.COORDINATOR_NOT_AVAILABLE])
    assert until_coordinator_answers(call, timeout=10.0, what="test") == "ok"
    assert len(lefts) == 4 and all(a > b for a, b in zip(lefts, lefts[1:])), lefts  # one deadline in all


def test_other_errors_and_a_coordinator_that_never_answers_propagate():
    call, lefts = _answers_after([KafkaError.GROUP_AUTHORIZATION_FAILED])
    with pytest.raises(KafkaException) as refused:
        until_coordinator_answers(call, timeout=10.0, what="test")
    assert refused.value.args[0].code() == KafkaError.GROUP_AUTHORIZATION_FAILED and len(lefts) == 1

    call, lefts = _answers_after([KafkaError.NOT_COORDINATOR] * 1000)
    with pytest.raises(KafkaException) as moving:
        until_coordinator_answers(call, timeout=0.5, what="test")
    assert moving.value.args[0].code() == KafkaError.NOT_COORDINATOR and 2 <= len(lefts) < 20, lefts
