"""Schema evolution on the real registry: kvbus adds fields with defaults (as vLLM added
``locality`` and ``ownership``); old and new readers read each other's records, and the
registry refuses breaking changes with its reason."""
from __future__ import annotations

import io
import json
import uuid

import pytest
from fastavro import parse_schema, schemaless_reader, schemaless_writer

from schemas.avro import batch_to_avro, schema_str
from schemas.events import BlockRemoved, BlockStored, EventBatch
from schemas.registry import check_schema, register_schema, set_compatibility

NEW_FIELDS = {"locality", "ownership"}


def _schema_without(fields: set[str]) -> dict:
    """EventBatch as it was before ``fields`` were added to the events (a 'v1')."""
    schema = json.loads(schema_str("EventBatch"))
    for branch in schema["fields"][-1]["type"]["items"]:
        if isinstance(branch, dict) and branch.get("type") == "record":
            branch["fields"] = [f for f in branch["fields"] if f["name"] not in fields]
    return schema


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
    from schemas.cli import add_schemas_args, run_schemas
    import argparse

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
