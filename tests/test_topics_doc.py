"""docs/topics.md is what kvbus.analytics.topics_doc makes of the schemas, and shows every field."""
from __future__ import annotations

import json

from kvbus.analytics.topics_doc import DOC, current_examples, named_types, render
from kvbus.schemas.avro import SCHEMA_DIR


def test_committed_doc_is_up_to_date() -> None:
    assert DOC.read_text() == render(current_examples()), \
        "docs/topics.md is out of date: run .venv/bin/python -m kvbus.analytics.topics_doc"


def test_every_field_of_every_schema_is_documented_with_its_doc() -> None:
    text = render("")
    fields = [(r, f) for r, node in named_types().items() if node["type"] == "record" for f in node["fields"]]
    assert len(fields) > 60
    for record, f in fields:
        row = next((line for line in text.splitlines() if line.startswith(f"| `{f['name']}` |")
                    and f.get("doc", "").replace("|", "\\|") in line), None)
        assert row is not None, (record, f["name"])
    # every schema file's named type has its own section
    for path in SCHEMA_DIR.glob("*.avsc"):
        assert f"### {json.loads(path.read_text())['name']}\n" in text


def test_examples_are_kept_when_regenerated() -> None:
    assert current_examples() and render(current_examples()).count(current_examples()) == 1
