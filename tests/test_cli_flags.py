"""The flags of every ``kvbus`` subcommand are a contract: tests/cli_flags.json records each flag as it
was released (its dest, its default in an environment without ``KVBUS_*`` variables, whether it takes
a value, repeats or is required; a path default as its text). A flag may be added; none may
disappear or change."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from kvbus.cli import build_parser
from kvbus.streams.options import StreamsOptions

RECORD = json.loads((Path(__file__).resolve().parent / "cli_flags.json").read_text())

REQUIRED = {"bridge": ["--endpoint", "tcp://127.0.0.1:1", "--replica", "r"], "lookup": ["--hashes", "1"],
            "schemas": ["check"]}
"""What a command needs on its command line to parse at all."""

LAID_OVER = {"worker": StreamsOptions()}
"""Commands whose flags were recorded with the default None, meaning "the variable's value": that is
their declared default in an environment without variables (now also the flag's default)."""


def actions(command: str) -> dict[str, argparse.Action]:
    """Flag -> its action, for ``kvbus <command>`` and its own subcommands (``schemas check --x``: ``check --x``)."""
    parser = build_parser(command)
    found: dict[str, argparse.Action] = {}

    def walk(p: argparse.ArgumentParser, prefix: str) -> None:
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                for name, sub in a.choices.items():
                    walk(sub, prefix + name + " ")
            for o in a.option_strings:
                found[prefix + o] = a

    walk(next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command], "")
    return found


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in [n for n in os.environ if n.startswith("KVBUS_")]:
        monkeypatch.delenv(name)


def test_the_record_holds_the_stages_flags() -> None:
    assert {"bridge", "worker", "sink", "top", "lookup"} <= RECORD.keys()
    assert len(RECORD["sink"]) >= 10 and len(RECORD["bridge"]) >= 17 and len(RECORD["worker"]) >= 7


@pytest.mark.parametrize("command", sorted(RECORD))
def test_every_recorded_flag_still_exists_with_its_dest_and_default(command: str, clean_env: None) -> None:
    now = actions(command)
    parsed = build_parser(command).parse_args([command, *REQUIRED.get(command, [])])
    for flag, was in RECORD[command].items():
        assert flag in now, f"kvbus {command} {flag} is gone"
        a = now[flag]
        assert a.dest == was["dest"], (flag, a.dest)
        assert (a.required, a.nargs != 0, isinstance(a, argparse._AppendAction)) == \
            (was["required"], was["takes_value"], was["repeatable"]), flag
        if " " in flag or flag in REQUIRED.get(command, []):
            continue  # a sub-subcommand's flag, or one given above: no default to compare
        default = getattr(parsed, a.dest)
        expected = was["default"]
        if expected is None and command in LAID_OVER:
            expected = getattr(LAID_OVER[command], a.dest)
        elif isinstance(expected, str) and a.type is not None:
            expected = a.type(expected)  # argparse parses a string default as if it were given
        if isinstance(default, tuple):
            default = list(default)
        if isinstance(expected, tuple):
            expected = list(expected)
        assert default == expected, f"kvbus {command} {flag}: default {default!r}, was {was['default']!r}"
