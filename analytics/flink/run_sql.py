"""Run a Flink SQL file with PyFlink (in the PyFlink venv: this file imports only pyflink).

``python run_sql.py SQL_FILE JARS``: executes the file's statements in order (``SET`` lines set
the table config, others go to ``execute_sql``); each query introduced by a ``-- name: <name>``
comment has its rows printed to stdout as JSON lines ``{"query": name, "row": {column: value}}``
(timestamps as ISO 8601 strings). ``JARS``: ``;``-separated jar paths for ``pipeline.jars``.
Batch mode, parallelism 1: a bounded read of the topics (``scan.bounded.mode``), then exit.
"""
from __future__ import annotations

import json
import re
import sys
from datetime import datetime
from pathlib import Path

from pyflink.table import EnvironmentSettings, TableEnvironment

_SET = re.compile(r"SET\s+'([^']+)'\s*=\s*'([^']*)'", re.I)
_NAME = re.compile(r"^--\s*name:\s*(\S+)", re.M)


def statements(text: str) -> list[tuple[str | None, str]]:
    """(query name or None, statement) of every ``;``-terminated statement, comments dropped."""
    out = []
    for chunk in re.split(r";\s*$", text, flags=re.M):
        m = _NAME.search(chunk)
        body = "\n".join(line for line in chunk.splitlines() if not line.lstrip().startswith("--")).strip()
        if body:
            out.append((m.group(1) if m else None, body))
    return out


def _plain(v: object) -> object:
    return v.isoformat() if isinstance(v, datetime) else v


def main(sql_path: str, jars: str) -> int:
    env = TableEnvironment.create(EnvironmentSettings.in_batch_mode())
    conf = env.get_config()
    conf.set("pipeline.jars", ";".join(Path(j).resolve().as_uri() for j in jars.split(";") if j))
    conf.set("parallelism.default", "1")
    for name, stmt in statements(Path(sql_path).read_text()):
        m = _SET.fullmatch(stmt)
        if m:
            conf.set(m.group(1), m.group(2))
            continue
        result = env.execute_sql(stmt)
        if name is None:
            result.wait()
            continue
        columns = result.get_resolved_schema().get_column_names()
        with result.collect() as rows:
            for row in rows:
                print(json.dumps({"query": name, "row": {c: _plain(v) for c, v in zip(columns, row)}}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1], sys.argv[2]))
