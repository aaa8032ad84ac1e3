"""Strimzi resources of a kvbus deployment: one ``KafkaTopic`` per kvbus topic and one ``KafkaUser``
per Kafka principal, derived from the topic declarations (:func:`kvbus.schemas.topics.topic_specs`)
and the access plan (:mod:`kvbus.infra.secure_plan`), for the settings of one deployment (its
``KVBUS_*`` variables: topic names, ``KVBUS_PARTITIONS``, ``KVBUS_REPLICATION``, the Faust app id,
the sinks' group).

Pure data (dicts in the shape of the Strimzi ``kafka.strimzi.io/v1`` API);
:mod:`kvbus.infra.manifests` writes them under ``deploy/kubernetes/components/strimzi``.

Users authenticate with SCRAM-SHA-512. The User Operator stores each user's password in a Secret
named like the user (key ``password``), which the stages mount as a file
(``KVBUS_KAFKA_SASL_PASSWORD_FILE``). ``admin`` is no ``KafkaUser``: no kvbus stage runs as it (the
Topic Operator manages the topics), and a super user is the Kafka cluster's own setting.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvbus.runtime.settings import Settings
from kvbus.schemas.topics import Topics, TopicSpec, topic_specs
from kvbus.sinks.config import SinkConfig  # the sink's public options (its group)
from kvbus.streams.options import StreamsOptions  # the worker's public options (app id, replication)

from .secure_plan import ADMIN, KAFKA_USERS, Grant, kafka_grants

API_VERSION = "kafka.strimzi.io/v1"
"""Strimzi's API (``v1`` since Strimzi 0.49; the older ``v1beta2`` is gone in Strimzi 1.0)."""
CLUSTER_LABEL = "strimzi.io/cluster"
"""The label that tells Strimzi's Topic and User Operators which ``Kafka`` cluster a resource is for."""
DEFAULT_CLUSTER = "kvbus"
"""Name of the Strimzi ``Kafka`` cluster in the example (bootstrap ``kvbus-kafka-bootstrap``)."""
USER_PREFIX = "kvbus-"
"""Kafka user name = this prefix + the principal (``kvbus-bridge``, ...): SCRAM users are cluster-wide,
so a shared cluster tells kvbus's users apart from others."""
MECHANISM = "scram-sha-512"
"""Strimzi's authentication type of every user (``KVBUS_KAFKA_SASL_MECHANISM=SCRAM-SHA-512``)."""
LABELS = {"app.kubernetes.io/part-of": "kvbus"}


def user_name(principal: str) -> str:
    """The Kafka user (and ``KafkaUser`` / Secret name) of a principal of the access plan."""
    return USER_PREFIX + principal


def resource_name(topic: str) -> str:
    """A Kubernetes object name for a Kafka topic name (lower case; ``_`` is not allowed in object
    names, ``.`` and ``-`` are); the topic name itself is ``spec.topicName``."""
    return topic.lower().replace("_", "-")


def strimzi_operation(op: str) -> str:
    """Strimzi's spelling of a Kafka operation of the plan: ``READ`` -> ``Read``, ``DESCRIBE_CONFIGS`` ->
    ``DescribeConfigs``."""
    return "".join(word.capitalize() for word in op.split("_"))


def _metadata(name: str, cluster: str) -> dict[str, Any]:
    return {"name": name, "labels": {CLUSTER_LABEL: cluster, **LABELS}}


def partitions(env: Mapping[str, str]) -> int:
    """``KVBUS_PARTITIONS`` of ``env``, parsed by :class:`~kvbus.runtime.settings.Settings` (given that
    variable alone: the security settings name files that exist only inside the pods)."""
    return Settings.from_env({k: v for k, v in env.items() if k == "KVBUS_PARTITIONS"}).partitions


def specs(env: Mapping[str, str]) -> tuple[TopicSpec, ...]:
    """The topic declarations for the settings ``env`` (names, ``KVBUS_PARTITIONS``, ``KVBUS_REPLICATION``)."""
    return topic_specs(Topics.from_env(env), partitions(env), StreamsOptions.from_env(env).replication)


def kafka_topics(env: Mapping[str, str], cluster: str = DEFAULT_CLUSTER) -> list[dict[str, Any]]:
    """One ``KafkaTopic`` per topic of :func:`~kvbus.schemas.topics.topic_specs` for the settings ``env``."""
    return [{
        "apiVersion": API_VERSION, "kind": "KafkaTopic", "metadata": _metadata(resource_name(spec.name), cluster),
        "spec": {"topicName": spec.name, "partitions": spec.partitions, "replicas": spec.replicas,
                 "config": dict(spec.config)},
    } for spec in specs(env)]


def acl(grant: Grant) -> dict[str, Any]:
    """A Strimzi ``simple`` authorization rule (allow) of one grant of the plan."""
    return {
        "resource": {"type": grant.resource, "name": grant.name,
                     "patternType": "prefix" if grant.prefixed else "literal"},
        "operations": [strimzi_operation(op) for op in grant.operations],
    }


def kafka_users(env: Mapping[str, str], cluster: str = DEFAULT_CLUSTER) -> list[dict[str, Any]]:
    """One ``KafkaUser`` per principal with a Kafka user but ``admin``, with the plan's ACLs for the
    settings ``env``."""
    grants = kafka_grants(Topics.from_env(env), StreamsOptions.from_env(env), SinkConfig.from_env(env))
    return [{
        "apiVersion": API_VERSION, "kind": "KafkaUser", "metadata": _metadata(user_name(principal), cluster),
        "spec": {"authentication": {"type": MECHANISM},
                 "authorization": {"type": "simple", "acls": [acl(g) for g in grants.get(principal, [])]}},
    } for principal in KAFKA_USERS if principal != ADMIN]
