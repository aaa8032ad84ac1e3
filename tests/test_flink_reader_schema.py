"""The reader schema kvbus.analytics.flink_job gives Flink's avro-confluent format: the record schemas
with each union of records replaced by one record of nullable branch fields, everything else as
written; and the SQL's tables declare exactly those fields."""
from __future__ import annotations

import json
import re

import fastavro

from kvbus.analytics.flink_job import DEFAULT_SQL, EVENT_FIELDS, reader_schema
from kvbus.schemas.avro import schema_str


def _strip(node):
    if isinstance(node, dict):
        return {k: _strip(v) for k, v in node.items() if k != "doc"}
    if isinstance(node, list):
        return [_strip(v) for v in node]
    return node


def test_unions_become_one_record_of_nullable_branch_fields() -> None:
    for record, field in (("BlockEvent", "event"), ("EventBatch", "events")):
        writer = json.loads(schema_str(record))
        reader = json.loads(reader_schema(record))
        fastavro.parse_schema(reader)  # a valid schema, named types defined before use
        w_fields = {f["name"]: f for f in writer["fields"]}
        assert [f["name"] for f in reader["fields"]] == list(w_fields)
        for f in reader["fields"]:
            if f["name"] != field:
                assert _strip(f) == _strip(w_fields[f["name"]])
        union = next(f["type"] for f in reader["fields"] if f["name"] == field)
        flat = union["items"] if record == "EventBatch" else union
        assert [g["name"] for g in flat["fields"]] == list(EVENT_FIELDS)
        assert all(g["default"] is None and g["type"][0] == "null" for g in flat["fields"])
        hashes = flat["fields"][0]["type"][1]
        assert hashes == {"type": "array", "items": {"type": "fixed", "name": "kvbus.BlockHash", "size": 8}}


def test_the_sql_tables_declare_the_reader_schemas_fields() -> None:
    sql = DEFAULT_SQL.read_text()
    rows = re.findall(r"ROW<(.*?)>\s*NOT NULL", sql, re.S)
    assert len(rows) == 2
    for row in rows:
        names = [part.split()[0] for part in re.split(r",\s*(?![^<]*>)", row.replace("\n", " "))]
        assert names == list(EVENT_FIELDS)
