"""A malformed ``KVBUS_*`` value or flag ends a command with exit code 2 and one line that names the
variable (or flag) and the form expected, never a traceback: every settings class reads its values
through kvbus.runtime.env, and ``kvbus`` turns the error into that line."""
from __future__ import annotations

import dataclasses
import functools
import os
import subprocess
import sys
from typing import Callable

import pytest

from kvbus.cli import main
from kvbus.configuration_doc import SECTIONS, resolve
from kvbus.runtime.env import COUNT, NATURAL, PORT, SECONDS, SettingError, declared, load, read
from kvbus.runtime.logs import log_format
from kvbus.runtime.security import Security
from kvbus.runtime.settings import Settings
from kvbus.sinks.config import SinkConfig
from kvbus.streams.options import StreamsOptions


def numeric_settings() -> list[tuple[Callable[[dict], object], str]]:
    """(the loader, the variable) of every declared numeric setting of an options class of
    docs/configuration.md: a numeric option added later is covered here without a new test case."""
    out = []
    for section in SECTIONS:
        for source in section.sources:
            cls = resolve(source)
            if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
                continue
            loader = getattr(cls, "from_env", functools.partial(load, cls))
            out += [(loader, s.variable) for _, s in declared(cls)
                    if s.variable and s.form in (COUNT, NATURAL, PORT, SECONDS)]
    return out


NUMERIC = numeric_settings()


def test_the_numeric_settings_are_found():
    """The introspected names are the declared variables (else the test below would test nothing)."""
    names = {name for _, name in NUMERIC}
    assert len(names) >= 20 and {"KVBUS_SINK_BATCH", "KVBUS_STREAMS_WINDOW", "KVBUS_PARTITIONS", "KVBUS_TOP_INTERVAL",
                                 "KVBUS_REPLICATION", "KVBUS_SINK_READY_LAG"} <= names


@pytest.mark.parametrize("load, name", [
    *NUMERIC,
    (Security.from_env, "KVBUS_KAFKA_SECURITY_PROTOCOL"),
    (log_format, "KVBUS_LOG_FORMAT"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_a_malformed_value_is_refused_naming_the_variable_and_the_form(load, name):
    with pytest.raises(SettingError) as e:
        load({name: "2k"})
    message = str(e.value)
    assert message.startswith(f"{name}=2k: expected ") and "\n" not in message


def test_sasl_mechanism_is_one_of_the_mechanisms():
    env = {"KVBUS_KAFKA_SECURITY_PROTOCOL": "SASL_SSL", "KVBUS_KAFKA_SASL_USERNAME": "u",
           "KVBUS_KAFKA_SASL_PASSWORD": "p", "KVBUS_KAFKA_SASL_MECHANISM": "GSSAPI"}
    with pytest.raises(SettingError, match="KVBUS_KAFKA_SASL_MECHANISM=GSSAPI: expected one of SCRAM-SHA-512"):
        Security.from_env(env)
    assert Security.from_env({**env, "KVBUS_KAFKA_SASL_MECHANISM": "scram-sha-256"}).kafka.mechanism == "SCRAM-SHA-256"


def test_unset_or_blank_is_the_default_and_a_good_value_is_parsed():
    assert read({}, "KVBUS_X", COUNT, 7) == 7
    assert read({"KVBUS_X": "  "}, "KVBUS_X", COUNT, 7) == 7
    assert read({"KVBUS_X": " 12 "}, "KVBUS_X", COUNT, 7) == 12
    sink = SinkConfig.from_env({"KVBUS_SINK_BATCH": "500", "KVBUS_SINK_STALE_AFTER": "0", "KVBUS_SINK_READY_LAG": "9"})
    assert (sink.batch, sink.stale_after, sink.ready_lag) == (500, 0.0, 9)
    opts = StreamsOptions.from_env({"KVBUS_STREAMS_WEB_PORT": "6067", "KVBUS_STREAMS_DATADIR": ""})
    assert (opts.web_port, opts.datadir) == (6067, None)


@pytest.mark.parametrize("value", ["0", "-3", "1.5", "nan"])
def test_counts_are_whole_numbers_from_one(value):
    with pytest.raises(SettingError, match="expected a whole number >= 1"):
        Settings.from_env({"KVBUS_PARTITIONS": value})


def test_ports_and_seconds_have_ranges():
    with pytest.raises(SettingError, match="KVBUS_SINK_METRICS_PORT=70000: expected a port number 0-65535"):
        SinkConfig.from_env({"KVBUS_SINK_METRICS_PORT": "70000"})
    for bad in ("-1", "inf", "soon"):
        with pytest.raises(SettingError, match="expected a number of seconds >= 0"):
            StreamsOptions.from_env({"KVBUS_STREAMS_WINDOW": bad})


@pytest.fixture
def kvbus_logging():
    """Calling ``kvbus``'s main() here configures this process's logging: put it back afterwards."""
    import logging
    import threading

    root = logging.getLogger()
    saved = (list(root.handlers), root.level, sys.excepthook, threading.excepthook)
    yield
    from kvbus.runtime import logs

    logs.configure("tests", saved[1], "text")
    root.handlers[:] = saved[0]
    root.setLevel(saved[1])
    sys.excepthook, threading.excepthook = saved[2], saved[3]
    logging.captureWarnings(False)


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment (the test stack's services) with ``extra`` laid over it."""
    return {**os.environ, **extra}


@pytest.mark.parametrize("argv, env, line", [
    (["sink"], {"KVBUS_SINK_BATCH": "2k"}, "kvbus sink: KVBUS_SINK_BATCH=2k: expected a whole number >= 1"),
    (["worker"], {"KVBUS_PARTITIONS": "four"}, "kvbus worker: KVBUS_PARTITIONS=four: expected a whole number >= 1"),
])
def test_the_command_exits_2_with_one_line_and_no_traceback(argv, env, line):
    """As an operator sees it: a real ``kvbus`` process."""
    out = subprocess.run([sys.executable, "-m", "kvbus", *argv], env=clean_env(**env), capture_output=True,
                         text=True, timeout=60)
    assert (out.returncode, out.stderr, out.stdout) == (2, line + "\n", "")


@pytest.mark.parametrize("argv, env, line", [
    (["sink", "--batch", "2k"], {},
     "kvbus sink: argument --batch: expected a whole number >= 1, got '2k' (see kvbus sink --help)"),
    (["sink", "--ready-lag", "0"], {},
     "kvbus sink: argument --ready-lag: expected a whole number >= 1, got '0' (see kvbus sink --help)"),
    (["sink"], {"KVBUS_STREAMS_WINDOW": "x", "KVBUS_SINK_SNAPSHOT_EVERY": "5m"},
     "kvbus sink: KVBUS_SINK_SNAPSHOT_EVERY=5m: expected a number of seconds >= 0, e.g. 2.5"),
    (["worker", "--window", "5s"], {},
     "kvbus worker: argument --window: expected a number of seconds >= 0, e.g. 2.5, got '5s' "
     "(see kvbus worker --help)"),
    (["worker"], {"KVBUS_STREAMS_BATCH": "lots"},
     "kvbus worker: KVBUS_STREAMS_BATCH=lots: expected a whole number >= 1"),
    (["bridge", "--endpoint", "tcp://127.0.0.1:1", "--replica", "r", "--dp-rank", "-1"], {},
     "kvbus bridge: argument --dp-rank: expected a whole number >= 0, got '-1' (see kvbus bridge --help)"),
    (["bridge", "--endpoint", "tcp://127.0.0.1:1", "--replica", "r", "--producer-conf", "linger.ms"], {},
     "kvbus bridge: argument --producer-conf: expected KEY=VALUE (a librdkafka producer setting), got 'linger.ms' "
     "(see kvbus bridge --help)"),
    (["bridge", "--endpoint", "tcp://127.0.0.1:1", "--replica", "r"], {"KVBUS_MAX_RECORD_BYTES": "1MB"},
     "kvbus bridge: KVBUS_MAX_RECORD_BYTES=1MB: expected a whole number >= 1"),
    (["top"], {"KVBUS_TOP_INTERVAL": "fast"},
     "kvbus top: KVBUS_TOP_INTERVAL=fast: expected a number of seconds >= 0, e.g. 2.5"),
    (["lookup", "--hashes", "1"], {"KVBUS_KAFKA_SECURITY_PROTOCOL": "TLS"},
     "kvbus lookup: KVBUS_KAFKA_SECURITY_PROTOCOL=TLS: expected one of PLAINTEXT, SSL, SASL_PLAINTEXT, SASL_SSL"),
    (["sink"], {"KVBUS_LOG_FORMAT": "yaml"}, "kvbus sink: KVBUS_LOG_FORMAT=yaml: expected one of text, json"),
])
def test_each_stage_refuses_a_bad_flag_or_variable_in_one_line(argv, env, line, monkeypatch, capsys, kvbus_logging):
    """The stages' own settings and flags (sink, worker, bridge, top) and the shared ones, through
    ``kvbus``'s entry point in this process (nothing is started: the value is refused first)."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert (captured.err, captured.out) == (line + "\n", "")


def test_in_json_mode_the_line_is_a_json_log_line(monkeypatch, capsys, kvbus_logging):
    import json

    monkeypatch.setenv("KVBUS_LOG_FORMAT", "json")
    monkeypatch.setenv("KVBUS_SINK_BATCH", "2k")
    assert main(["sink"]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1
    record = json.loads(lines[0])
    assert (record["level"], record["stage"], record["message"]) == \
        ("ERROR", "sink", "kvbus sink: KVBUS_SINK_BATCH=2k: expected a whole number >= 1")
