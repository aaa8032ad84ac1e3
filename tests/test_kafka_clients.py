"""kvbus.schemas.kafka_clients: every stage's client configuration from one base, one handling of
what Kafka refuses, and topics created as declared."""
from __future__ import annotations

import logging

import pytest
from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient, ConfigResource

from kvbus.schemas.kafka_clients import (
    CONSUMER_CONF,
    PRODUCER_CONF,
    DeliveryErrors,
    consumer_conf,
    ensure_topics,
    producer_conf,
    reader_conf,
)
from kvbus.schemas.security import Security
from kvbus.schemas.settings import Settings
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
    from kvbus.producers.record_producer import DEFAULT_PRODUCER_CONF, producer_conf as bridge_conf

    conf = bridge_conf(secured_kafka(), {"linger.ms": 1})
    assert conf["message.timeout.ms"] == 0 and conf["linger.ms"] == 1 and conf["sasl.username"] == "sink"
    assert {k: DEFAULT_PRODUCER_CONF[k] for k in PRODUCER_CONF} == dict(PRODUCER_CONF)


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

