"""Schema evolution on the real registry: kvbus adds fields with defaults (as vLLM added
``locality`` and ``ownership``); old and new readers read each other's records, and the
registry refuses breaking changes with its reason."""
from __future__ import annotations

import io
import json
import uuid

import msgspec
import pytest
from confluent_kafka.schema_registry import Schema
from fastavro import parse_schema, schemaless_reader, schemaless_writer

from kvbus.schemas.avro import batch_to_avro, schema_str
from kvbus.schemas.codec import FastSerde, batch_scanner, confluent_header
from kvbus.schemas.events import BlockRemoved, BlockStored, EventBatch
from kvbus.schemas.registry import check_schema, register_schema, set_compatibility
from kvbus.schemas.serde import RecordSerde, registry_client

NEW_FIELDS = {"locality", "ownership"}


def _schema_without(fields: set[str]) -> dict:
    """EventBatch as it was before ``fields`` were added to the events (a 'v1')."""
    schema = json.loads(schema_str("EventBatch"))
    events = next(f for f in schema["fields"] if f["name"] == "events")
    for branch in events["type"]["items"]:
        if isinstance(branch, dict) and branch.get("type") == "record":
            branch["fields"] = [f for f in branch["fields"] if f["name"] not in fields]
    return schema


def _schema_before_split_batches() -> dict:
    """EventBatch as it was before ``first_index`` (one record per engine batch)."""
    schema = json.loads(schema_str("EventBatch"))
    assert schema["fields"][-1]["name"] == "first_index"  # added at the end, with a default
    schema["fields"] = schema["fields"][:-1]
    return schema


def _old_record(batch: EventBatch) -> dict:
    record = batch_to_avro(batch)
    del record["first_index"]
    return record


def _batch(ownership: str | None) -> EventBatch:
    h = (7).to_bytes(8, "big")
    return EventBatch(
        replica="r1", seq=1, ts=2.5,
        events=[
            BlockStored(block_hashes=[h], token_ids=list(range(16)), block_size=16, medium="CPU",
                        locality="LOCAL", ownership=ownership),
            BlockRemoved(block_hashes=[h], medium="CPU", ownership=ownership),
        ],
    )


def _write(schema: dict, record: dict) -> bytes:
    buf = io.BytesIO()
    schemaless_writer(buf, parse_schema(schema), record)
    return buf.getvalue()


def _read(writer: dict, reader: dict, data: bytes) -> dict:
    return schemaless_reader(io.BytesIO(data), parse_schema(writer), parse_schema(reader))


def test_old_records_read_with_new_schema_get_defaults() -> None:
    v1, current = _schema_without(NEW_FIELDS), json.loads(schema_str("EventBatch"))
    old = batch_to_avro(_batch(None))
    for e in old["events"]:
        e.pop("locality"), e.pop("ownership")
    out = _read(v1, current, _write(v1, old))
    assert [e["ownership"] for e in out["events"]] == [None, None]
    assert [e["locality"] for e in out["events"]] == [None, None]
    assert out["events"][0]["token_ids"] == list(range(16))


def test_new_records_read_with_old_schema_drop_new_fields() -> None:
    v1, current = _schema_without(NEW_FIELDS), json.loads(schema_str("EventBatch"))
    out = _read(current, v1, _write(current, batch_to_avro(_batch("kvcr"))))
    assert all("ownership" not in e for e in out["events"])
    assert out["events"][0]["medium"] == "CPU" and out["replica"] == "r1"


@pytest.mark.integration
def test_registry_accepts_additions_and_refuses_breaking_changes(stack) -> None:
    url = stack.registry_url
    subject = f"evolution-{uuid.uuid4().hex[:8]}-value"
    set_compatibility(url, subject)
    v1 = json.dumps(_schema_without(NEW_FIELDS))
    first = register_schema(url, subject, v1)
    assert check_schema(url, subject, schema_str("EventBatch"))[0] == "compatible"
    second = register_schema(url, subject, schema_str("EventBatch"))
    assert second != first

    removed = json.loads(schema_str("EventBatch"))
    removed["fields"] = [f for f in removed["fields"] if f["name"] != "replica"]
    status, reasons = check_schema(url, subject, json.dumps(removed))
    assert status == "incompatible" and "replica" in " ".join(reasons)
    with pytest.raises(ValueError, match="409"):
        register_schema(url, subject, json.dumps(removed))

    retyped = json.loads(schema_str("EventBatch"))
    for f in retyped["fields"]:
        if f["name"] == "seq":
            f["type"] = "string"
    assert check_schema(url, subject, json.dumps(retyped))[0] == "incompatible"
    with pytest.raises(ValueError, match="409"):
        register_schema(url, subject, json.dumps(retyped))


@pytest.mark.integration
def test_kvbus_schemas_check_reports_new_then_compatible(test_settings, capsys) -> None:
    import argparse

    from kvbus.schemas.cli import add_schemas_args, run_schemas

    p = argparse.ArgumentParser()
    add_schemas_args(p)
    assert run_schemas(p.parse_args(["check"]), test_settings) == 0
    assert "new" in capsys.readouterr().out
    assert run_schemas(p.parse_args(["register", "--ownership", "kvcr"]), test_settings) == 0
    capsys.readouterr()
    assert run_schemas(p.parse_args(["check", "--ownership", "kvcr", "--json"]), test_settings) == 0
    statuses = {r["subject"]: r["status"] for r in json.loads(capsys.readouterr().out)}
    assert statuses[f"{test_settings.topics.for_ownership('kvcr')}-value"] == "compatible"
    assert set(statuses.values()) == {"compatible"}


# -- first_index (split batches) ----------------------------------------------------------

def test_old_batches_without_first_index_read_as_first_index_0() -> None:
    old, current = _schema_before_split_batches(), json.loads(schema_str("EventBatch"))
    out = _read(old, current, _write(old, _old_record(_batch("kvcr"))))
    assert out["first_index"] == 0 and out["seq"] == 1 and len(out["events"]) == 2


def test_parts_read_with_the_old_schema_drop_first_index() -> None:
    old, current = _schema_before_split_batches(), json.loads(schema_str("EventBatch"))
    part = msgspec.structs.replace(_batch(None), first_index=7)
    out = _read(current, old, _write(current, batch_to_avro(part)))
    assert "first_index" not in out and out["seq"] == 1 and out["events"][0]["token_ids"] == list(range(16))


def _confluent_value(registry, topic: str, schema: dict, record: dict) -> bytes:
    schema_id = registry.register_schema(f"{topic}-value", Schema(json.dumps(schema), "AVRO"))
    return confluent_header(schema_id) + _write(schema, record)


def _old_and_current_values(registry, topic: str) -> tuple[EventBatch, bytes, bytes]:
    batch = _batch("kvcr")
    old = _confluent_value(registry, topic, _schema_before_split_batches(), _old_record(batch))
    current = FastSerde(registry, "EventBatch").dumps(msgspec.structs.replace(batch, first_index=3), topic)
    assert old[1:5] != current[1:5]
    return batch, old, current


@pytest.mark.parametrize("reader", ["fast", "scan", "record"])
def test_kvbus_readers_decode_old_batches_with_first_index_0(reader) -> None:
    """What the Faust worker (scanner), the sink-side fast codec and RecordSerde return for a record
    written before first_index existed: the batch, first_index 0; the fast decoder is not used for it."""
    registry = registry_client("mock://evolution-first-index")
    topic = f"evo.{reader}.raw"
    batch, old, current = _old_and_current_values(registry, topic)
    if reader == "record":
        serde = RecordSerde(registry, "EventBatch")
        assert serde.loads(old, topic) == batch
        assert serde.loads(current, topic).first_index == 3
        return
    serde = FastSerde(registry, "EventBatch", reader=batch_scanner(Raw) if reader == "scan" else None)
    got = serde.loads(old, topic)
    assert got.first_index == 0 and got.seq == batch.seq and len(got.events) == 2
    assert serde.is_current(int.from_bytes(old[1:5], "big")) is False
    if reader == "fast":
        assert got == batch
    assert serde.loads(current, topic).first_index == 3


class Raw:
    """A scanned block event (kvbus.schemas.codec.batch_scanner's ``raw`` factory)."""

    def __init__(self, avro, ownership, without_lora_name):
        self.avro = avro


@pytest.mark.integration
def test_registry_accepts_first_index_and_old_records_still_read(stack) -> None:
    url = stack.registry_url
    topic = f"evolution-{uuid.uuid4().hex[:8]}"
    subject = f"{topic}-value"
    set_compatibility(url, subject)  # FULL_TRANSITIVE, as kvbus schemas register sets
    old_id = register_schema(url, subject, json.dumps(_schema_before_split_batches()))
    assert check_schema(url, subject, schema_str("EventBatch"))[0] == "compatible"
    new_id = register_schema(url, subject, schema_str("EventBatch"))
    assert new_id != old_id
    registry = registry_client(url)
    batch = _batch(None)
    old_value = confluent_header(old_id) + _write(_schema_before_split_batches(), _old_record(batch))
    serde = FastSerde(registry, "EventBatch", auto_register=False)
    assert serde.loads(old_value, topic) == batch  # first_index 0
    part = msgspec.structs.replace(batch, first_index=5)
    new_value = serde.dumps(part, topic)
    assert new_value[1:5] == new_id.to_bytes(4, "big")
    assert serde.loads(new_value, topic) == part


# -- model (EventBatch, BlockEvent, ViewSnapshot) ------------------------------------------------

MODEL_RECORDS = ("EventBatch", "BlockEvent", "ViewSnapshot")


def _schema_before_models(record: str) -> dict:
    """``kvbus.<record>`` as it was before records named the model."""
    schema = json.loads(schema_str(record))
    assert [f["default"] for f in schema["fields"] if f["name"] == "model"] == [None]  # added with a default
    schema["fields"] = [f for f in schema["fields"] if f["name"] != "model"]
    return schema


def _with_model(record: str, model: str | None):
    from kvbus.schemas.events import BlockEvent, ViewSnapshot, ViewTier

    if record == "EventBatch":
        return msgspec.structs.replace(_batch("kvcr"), model=model)
    if record == "BlockEvent":
        return BlockEvent(replica="r1", epoch=3, seq=4, index=0, ts=2.5, event=_batch(None).events[0], model=model)
    tier = ViewTier(descriptor="GPU||0", refcounted=False, origin="kvbus.blocks", blocks=b"\1" * 8)
    return ViewSnapshot(snapshot=7, taken=1.0, holder="r1#0", replica="r1", model=model, tiers=[tier])


@pytest.mark.parametrize("record", MODEL_RECORDS)
def test_records_before_models_read_with_the_model_unknown_and_new_ones_read_by_old_readers(record) -> None:
    from kvbus.schemas.avro import TO_AVRO

    old, current = _schema_before_models(record), json.loads(schema_str(record))
    value = TO_AVRO[record](_with_model(record, "llama"), None)
    old_value = {k: v for k, v in TO_AVRO[record](_with_model(record, None), None).items() if k != "model"}
    assert _read(old, current, _write(old, old_value))["model"] is None
    out = _read(current, old, _write(current, value))
    assert "model" not in out and out["replica"] == "r1"
    assert _read(current, current, _write(current, value))["model"] == "llama"


@pytest.mark.integration
@pytest.mark.parametrize("record", MODEL_RECORDS)
def test_registry_accepts_the_model_field_and_kvbus_readers_decode_both_versions(stack, record) -> None:
    """FULL_TRANSITIVE takes the model field; a value written before it decodes with model None (through
    RecordSerde: the fast decoder is only used for the current schema), a current one keeps it."""
    from kvbus.schemas.avro import TO_AVRO

    url = stack.registry_url
    topic = f"evolution-{uuid.uuid4().hex[:8]}"
    subject = f"{topic}-value"
    set_compatibility(url, subject)
    old_id = register_schema(url, subject, json.dumps(_schema_before_models(record)))
    assert check_schema(url, subject, schema_str(record))[0] == "compatible"
    assert register_schema(url, subject, schema_str(record)) != old_id
    registry = registry_client(url)
    old_record = {k: v for k, v in TO_AVRO[record](_with_model(record, None), None).items() if k != "model"}
    old_value = confluent_header(old_id) + _write(_schema_before_models(record), old_record)
    reader = batch_scanner(Raw) if record == "EventBatch" else None
    for serde in (FastSerde(registry, record, auto_register=False, reader=reader),
                  RecordSerde(registry, record, auto_register=False)):
        assert serde.loads(old_value, topic).model is None
    fast = FastSerde(registry, record, auto_register=False)
    current = fast.dumps(_with_model(record, "llama"), topic)
    assert fast.loads(current, topic) == _with_model(record, "llama")
    assert RecordSerde(registry, record, auto_register=False).loads(current, topic).model == "llama"
