"""How a kvbus process logs: every stage logs through :mod:`logging`; ``kvbus`` configures it once,
in the format ``KVBUS_LOG_FORMAT`` says (:data:`LOG_FORMAT_SETTING`).

A JSON line has ``time`` (ISO 8601, UTC), ``level``, ``logger``, ``message`` and ``stage`` (the
subcommand: bridge, worker, sink, ...), plus the context of the line where there is one: ``holder``
(``<replica>#<dp_rank>``: every line of a bridge), ``topic`` / ``partition`` / ``offset`` (a record),
``partitions`` (an assignment), and ``exc_info`` (a traceback, as one string). Context goes on a record
as ``log.info(..., extra={"partition": 3})``, or for a whole process through :func:`bind`. The JSON is
written by python-json-logger; librdkafka's own log lines reach the same handler (``logger`` in
:meth:`kvbus.runtime.settings.Settings.kafka`).
"""
from __future__ import annotations

import logging
import os
import sys
import threading
from typing import Any, Mapping

from kvbus.runtime.env import Setting, one_of

LOG_FORMAT = one_of("text", "json")
"""The forms of ``KVBUS_LOG_FORMAT``."""
LOG_FORMAT_SETTING = Setting("KVBUS_LOG_FORMAT", LOG_FORMAT, "text",
                             "text: <time> <LEVEL> <logger>: <message> lines; json: one JSON object per line (time, "
                             "level, logger, message, stage, and holder / topic / partition / offset / partitions "
                             "where a line has one)")
"""How every kvbus command logs."""
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
"""Format of a text log line."""
_configured = "text"
"""The format :func:`configure` set last."""


class _Bound(logging.Filter):
    """Lays the fields given to :func:`bind` on every record that does not carry them itself."""

    fields: dict[str, Any] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        for key, value in self.fields.items():
            if not hasattr(record, key):
                setattr(record, key, value)
        return True


class _Stderr(logging.StreamHandler):
    """A handler writing to the ``sys.stderr`` of the moment (not the one it was created with)."""

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass


def log_format(environ: Mapping[str, str] | None = None) -> str:
    """``KVBUS_LOG_FORMAT`` of ``environ`` (default the process's): "text" or "json"."""
    return LOG_FORMAT_SETTING.read(os.environ if environ is None else environ)


def configure(stage: str, level: int = logging.INFO, fmt: str = "text") -> logging.Handler:
    """Make the root logger write to stderr in format ``fmt`` ("text" or "json") at ``level``;
    JSON lines carry ``stage``. Replaces any handler configured before; returns the handler. In
    JSON mode uncaught exceptions (main thread and others) and warnings are logged, not printed."""
    global _configured
    _configured = fmt
    handler = _Stderr()
    handler.addFilter(_Bound())
    if fmt == "json":
        from pythonjsonlogger.json import JsonFormatter

        handler.setFormatter(JsonFormatter("%(levelname)s %(name)s %(message)s", timestamp="time",
                                           rename_fields={"levelname": "level", "name": "logger"},
                                           static_fields={"stage": stage}))
        sys.excepthook = _log_uncaught
        threading.excepthook = lambda a: _log_uncaught(a.exc_type, a.exc_value, a.exc_traceback)
        logging.captureWarnings(True)
    else:
        handler.setFormatter(logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    return handler


def bind(**fields: Any) -> None:
    """Context every later log line of this process carries (a field a line sets itself wins), e.g.
    the bridge's ``holder``."""
    _Bound.fields = {**_Bound.fields, **fields}


def json_enabled() -> bool:
    """Whether the root logger writes JSON lines (:func:`configure` with "json")."""
    return _configured == "json"


def _log_uncaught(kind: type[BaseException], value: BaseException, tb: Any) -> None:
    if issubclass(kind, KeyboardInterrupt):
        sys.__excepthook__(kind, value, tb)
        return
    logging.getLogger("kvbus").critical("uncaught %s: %s", kind.__name__, value, exc_info=(kind, value, tb))
