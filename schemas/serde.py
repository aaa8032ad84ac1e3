"""Confluent wire format (magic byte 0 + 4-byte schema id + Avro body) for kvbus records,
using confluent-kafka's AvroSerializer/AvroDeserializer and a schema registry.

Build a :class:`RecordSerde` once per (registry, record kind) and reuse it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from confluent_kafka.schema_registry import Schema, SchemaRegistryClient, topic_subject_name_strategy
from confluent_kafka.schema_registry.avro import AvroDeserializer, AvroSerializer
from confluent_kafka.serialization import MessageField, SerializationContext

from kvbus.schemas.avro import FROM_AVRO, TO_AVRO, schema_str

if TYPE_CHECKING:
    from kvbus.runtime.settings import Settings


REGISTRY_TIMEOUT_S = 10.0
"""Seconds one registry HTTP request may take before the client gives up on it and retries
(confluent-kafka's default is no timeout: a registry that stalls mid-request hangs the caller)."""


def registry_client(target: "str | Settings", timeout: float = REGISTRY_TIMEOUT_S) -> SchemaRegistryClient:
    """A registry client for ``target``: a URL (``mock://...`` gives confluent's in-process mock) or
    :class:`~kvbus.runtime.settings.Settings` (its URL and registry credentials, ``kvbus.runtime.security``);
    requests time out after ``timeout`` seconds and are retried (confluent's ``max.retries``)."""
    if isinstance(target, str):
        return SchemaRegistryClient.new_client({"url": target, "timeout": timeout})
    return SchemaRegistryClient.new_client({"url": target.registry_url, "timeout": timeout,
                                            **target.security.registry.client_conf()})


def value_schema_id(registry: SchemaRegistryClient, topic: str, record: str, auto_register: bool = True) -> int:
    """Id of ``kvbus.<record>``'s schema under ``<topic>-value`` (TopicNameStrategy), as
    :class:`RecordSerde` writes it: registered when ``auto_register`` (the registry refuses
    it if it breaks compatibility), else looked up (SchemaRegistryError 404 if absent).
    The client caches the answer; callers keep the id (see kvbus.schemas.codec.FastSerde)."""
    subject = f"{topic}-value"
    schema = Schema(schema_str(record), "AVRO")
    if auto_register:
        return registry.register_schema(subject, schema)
    return registry.lookup_schema(subject, schema).schema_id


class RecordSerde:
    """Serializer and deserializer of one kvbus record kind (``EventBatch``, ``BlockEvent``,
    ``Incomplete``, ``DeadLetter``) for Kafka record values.

    ``auto_register``: register the schema under ``<topic>-value`` on first use
    (the registry refuses it if it breaks compatibility).
    """

    def __init__(self, registry: SchemaRegistryClient, record: str, auto_register: bool = True):
        self.record = record
        self._ser = AvroSerializer(
            registry,
            schema_str(record),
            to_dict=TO_AVRO[record],
            conf={
                "auto.register.schemas": auto_register,
                # TopicNameStrategy, explicitly: confluent-kafka >= 2.13 defaults to
                # registry "associations", an API Apicurio's ccompat does not serve.
                "subject.name.strategy": topic_subject_name_strategy,
            },
        )
        self._de = AvroDeserializer(
            registry,
            schema_str(record),
            from_dict=FROM_AVRO[record],
            return_record_name=True,
            conf={"subject.name.strategy": topic_subject_name_strategy},
        )

    def dumps(self, obj: Any, topic: str) -> bytes:
        """Encode ``obj`` for ``topic`` in the Confluent wire format."""
        return self._ser(obj, SerializationContext(topic, MessageField.VALUE))

    def loads(self, data: bytes, topic: str) -> Any:
        """Decode a Confluent-wire-format value read from ``topic`` into its struct."""
        return self._de(data, SerializationContext(topic, MessageField.VALUE))
