"""The Flink SQL job over kvbus's topics (``analytics/flink/*.sql``) and what it needs from kvbus:
the reader schemas, the settings filled into the SQL, and a run in the PyFlink venv.

Why reader schemas: a Flink table cannot declare a union of several records (kvbus's ``event``),
and the Avro schema Flink derives from a table turns ``BINARY``/``VARBINARY`` into ``bytes``, which
cannot read kvbus's ``fixed`` block hashes. :func:`reader_schema` derives from ``schemas/avro`` a schema
in which each such union is one record holding the listed fields of its branches, each made
nullable with default null; Avro's schema resolution reads every branch into it (fields a branch
lacks take their default, fields the reader lacks are skipped). The record schemas stay as they
are; the SQL file's tables declare these columns (Flink checks that they match).

``python -m kvbus.analytics.flink_job [SQL_FILE] [--group G] [--workdir DIR]`` prints each named query's rows as
JSON lines (Flink and its jars come from infra/flink.py, made on first use).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any, Iterable

from kvbus.runtime.settings import Settings
from kvbus.schemas.avro import schema_str

FLINK_DIR = Path(__file__).parent / "flink"
DEFAULT_SQL = FLINK_DIR / "stores_per_minute.sql"
EVENT_FIELDS = ("block_hashes", "block_size", "medium", "ownership", "reason")
"""Branch fields of the event union that the SQL tables declare, in this order."""


def _named_types(node: Any, found: dict[str, dict]) -> dict[str, dict]:
    """Every named type defined in ``node`` by full name."""
    if isinstance(node, dict):
        if node.get("type") in ("record", "fixed", "enum") and "name" in node:
            ns = node.get("namespace", "")
            full = node["name"] if "." in node["name"] or not ns else f"{ns}.{node['name']}"
            found.setdefault(full, node)
        for v in node.values():
            _named_types(v, found)
    elif isinstance(node, list):
        for v in node:
            _named_types(v, found)
    return found


def _define_first_use(node: Any, defs: dict[str, dict], done: set[str]) -> Any:
    """``node`` with the first reference to each named type of ``defs`` replaced by its definition
    (Avro needs a name defined before it is referenced)."""
    if isinstance(node, str) and node in defs and node not in done:
        done.add(node)
        return _define_first_use(copy.deepcopy(defs[node]), defs, done)
    if isinstance(node, dict):
        if node.get("type") in ("record", "fixed", "enum") and "name" in node:
            ns = node.get("namespace", "")
            done.add(node["name"] if "." in node["name"] or not ns else f"{ns}.{node['name']}")
        return {k: (_define_first_use(v, defs, done) if k in ("type", "items", "fields", "values") else v)
                for k, v in node.items()}
    if isinstance(node, list):
        return [_define_first_use(v, defs, done) for v in node]
    return node


def _strip_docs(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: _strip_docs(v) for k, v in node.items() if k != "doc"}
    if isinstance(node, list):
        return [_strip_docs(v) for v in node]
    return node


def _nullable(t: Any) -> Any:
    if isinstance(t, list):
        return t if "null" in t else ["null", *t]
    return ["null", t]


def _flatten_union(branches: list[Any], defs: dict[str, dict], fields: Iterable[str]) -> dict:
    """One record holding ``fields`` of the union's record branches (first definition of each),
    each nullable with default null."""
    records = [defs[b] if isinstance(b, str) else b for b in branches]
    out = []
    for name in fields:
        f = next((f for r in records for f in r.get("fields", []) if f["name"] == name), None)
        if f is None:
            raise KeyError(f"no branch of the union has a field {name!r}")
        out.append({"name": name, "type": _nullable(f["type"]), "default": None})
    return {"type": "record", "name": "EventFields", "namespace": "kvbus.flink", "fields": out}


def reader_schema(record: str, fields: Iterable[str] = EVENT_FIELDS) -> str:
    """The reader schema of ``kvbus.<record>`` (module doc): every union of several records, wherever it
    is (a field, array items, a field of a nested record such as ``BlockEvents.events[].event``), becomes
    one record of ``fields``; docs dropped. JSON text."""
    full = json.loads(schema_str(record))
    defs = _named_types(full, {})
    fields = tuple(fields)
    flat: dict | None = None

    def is_record_union(t: Any) -> bool:
        return isinstance(t, list) and sum(1 for b in t if b != "null") > 1

    def resolve(t: Any) -> Any:
        nonlocal flat
        if is_record_union(t):
            flat = flat or _flatten_union(t, defs, fields)
            return flat
        if isinstance(t, dict) and t.get("type") == "array":
            return {**t, "items": resolve(t["items"])}
        if isinstance(t, dict) and t.get("type") == "record":
            return {**t, "fields": [{**f, "type": resolve(f["type"])} for f in t["fields"]]}
        return t

    return json.dumps(_strip_docs(_define_first_use(resolve(full), defs, set())), separators=(",", ":"))


def render(sql: str, settings: Settings, group: str) -> str:
    """The SQL with its ``{placeholders}`` filled in outside comments (unknown ones are an error)."""
    t = settings.topics
    values = {
        "bootstrap": settings.bootstrap, "registry_url": settings.registry_url, "group": group,
        "blocks_topic_regex": t.layout_pattern(packed=False), "packed_topic_regex": t.layout_pattern(packed=True),
        "raw_topic": t.raw, "blocks_reader_schema": reader_schema("BlockEvent"),
        "packed_reader_schema": reader_schema("BlockEvents"), "raw_reader_schema": reader_schema("EventBatch"),
    }

    def fill(m: re.Match) -> str:
        if m.group(1) not in values:
            raise KeyError(f"unknown placeholder {{{m.group(1)}}} in the SQL")
        return values[m.group(1)].replace("'", "''")

    return "\n".join(line if line.lstrip().startswith("--") else re.sub(r"\{(\w+)\}", fill, line)
                     for line in sql.splitlines())


JOB_TIMEOUT_S = 600.0
"""How long :func:`run` waits for a job, seconds: a bounded job over the dev topics takes 20-60 s on
a 2-core machine, minutes when that machine is also running a test suite and a busy process."""


def run(sql_file: Path, settings: Settings, python: Path, jars: list[Path], workdir: Path,
        group: str | None = None, timeout: float = JOB_TIMEOUT_S) -> list[dict]:
    """Run ``sql_file`` with PyFlink (``python`` of the PyFlink venv, connector ``jars``); returns the
    rows printed, ``{"query": name, "row": {...}}``. Raises RuntimeError with Flink's output tail
    when the job fails or has not finished within ``timeout`` seconds."""
    workdir.mkdir(parents=True, exist_ok=True)
    rendered = workdir / sql_file.name
    rendered.write_text(render(sql_file.read_text(), settings, group or f"kvbus-flink-{uuid.uuid4().hex[:8]}"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    try:
        proc = subprocess.run([str(python), str(FLINK_DIR / "run_sql.py"), str(rendered), ";".join(map(str, jars))],
                              capture_output=True, text=True, timeout=timeout, env=env, cwd=workdir)
    except subprocess.TimeoutExpired as e:
        tail = (e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else e.stderr or "")[-4000:]
        raise RuntimeError(f"Flink job {sql_file.name} did not finish in {timeout:.0f} s; "
                           f"its log so far:\n{tail}") from e
    (workdir / "flink.log").write_text(proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"Flink job {sql_file.name} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def main(argv: list[str] | None = None) -> int:
    """``python -m kvbus.analytics.flink_job``: run the SQL file on the topics named by ``KVBUS_*``."""
    p = argparse.ArgumentParser(prog="python -m kvbus.analytics.flink_job", description=__doc__.splitlines()[0])
    p.add_argument("sql", nargs="?", type=Path, default=DEFAULT_SQL, help=f"SQL file (default {DEFAULT_SQL.name})")
    p.add_argument("--group", default=None, help="Kafka consumer group of the job (default: a fresh one)")
    p.add_argument("--workdir", type=Path, default=Path("kvbus-flink"), help="rendered SQL and Flink's log")
    args = p.parse_args(argv)
    from kvbus.infra.flink import ensure  # the PyFlink venv and jars, made on first use

    runtime = ensure()
    for row in run(args.sql, Settings.from_env(), runtime.python, runtime.jars, args.workdir, args.group):
        print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
