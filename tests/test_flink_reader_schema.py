"""The reader schema kvbus.analytics.flink_job gives Flink's avro-confluent format: the record schemas
with each union of records (also one nested in the array items of a BlockEvents, block layout 2)
replaced by one record of nullable branch fields, everything else as written; and the SQL's tables
declare exactly those fields."""
from __future__ import annotations

import json
import re

import fastavro

from kvbus.analytics.flink_job import DEFAULT_SQL, EVENT_FIELDS, reader_schema
from kvbus.schemas.avro import SCHEMA_DIR, schema_str


def _strip(node):
    if isinstance(node, dict):
        return {k: _strip(v) for k, v in node.items() if k != "doc"}
    if isinstance(node, list):
        return [_strip(v) for v in node]
    return node


def test_unions_become_one_record_of_nullable_branch_fields() -> None:
    for record, field in (("BlockEvent", "event"), ("EventBatch", "events"), ("BlockEvents", "events")):
        writer = json.loads(schema_str(record))
        reader = json.loads(reader_schema(record))
        fastavro.parse_schema(reader)  # a valid schema, named types defined before use
        w_fields = {f["name"]: f for f in writer["fields"]}
        assert [f["name"] for f in reader["fields"]] == list(w_fields)
        for f in reader["fields"]:
            if f["name"] != field:
                assert _strip(f) == _strip(w_fields[f["name"]])
        union = next(f["type"] for f in reader["fields"] if f["name"] == field)
        flat = union["items"] if record != "BlockEvent" else union
        if record == "BlockEvents":  # the union is a field of the array's PositionedEvent records
            w_items = w_fields[field]["type"]["items"]
            assert [g["name"] for g in flat["fields"]] == [g["name"] for g in w_items["fields"]] == ["index", "event"]
            assert flat["name"] == w_items["name"] and flat["fields"][0] == _strip(w_items["fields"][0])
            flat = flat["fields"][1]["type"]
        assert [g["name"] for g in flat["fields"]] == list(EVENT_FIELDS)
        assert all(g["default"] is None and g["type"][0] == "null" for g in flat["fields"])
        hashes = flat["fields"][0]["type"][1]
        assert hashes == {"type": "array", "items": {"type": "fixed", "name": "kvbus.BlockHash", "size": 8}}


def test_the_sql_tables_declare_the_reader_schemas_fields() -> None:
    sql = DEFAULT_SQL.read_text()
    rows = re.findall(rf"ROW<({EVENT_FIELDS[0]}\b.*?)>\s*NOT NULL", sql, re.S)
    assert len(rows) == 3  # blocks.event, blocks_packed.events[].event, raw_batches.events[]
    for row in rows:
        names = [part.split()[0] for part in re.split(r",\s*(?![^<]*>)", row.replace("\n", " "))]
        assert names == list(EVENT_FIELDS)


def test_the_sql_tables_declare_every_field_of_their_records_in_order() -> None:
    """Flink refuses a reader schema whose fields are not the table's physical columns, so a field added
    to a record (e.g. ``model``) must be added to the table that reads it."""
    sql = DEFAULT_SQL.read_text()
    for table, record in (("blocks", "BlockEvent"), ("blocks_packed", "BlockEvents"), ("raw_batches", "EventBatch")):
        body = re.search(rf"CREATE TABLE {table} \((.*?)\n\) WITH", sql, re.S).group(1)
        columns = [m.group(1).strip("`") for m in re.finditer(r"^  (`?\w+`?) ", body, re.M)
                   if "METADATA" not in m.string[m.start():body.find("\n", m.start())]
                   and m.group(1) != "WATERMARK"]
        fields = [f["name"] for f in json.loads((SCHEMA_DIR / f"kvbus.{record}.avsc").read_text())["fields"]]
        assert columns == fields, (table, columns, fields)
