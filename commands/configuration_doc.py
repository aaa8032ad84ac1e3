"""docs/configuration.md from the declarations: every ``KVBUS_*`` setting and every flag of the stages'
commands, with its default and meaning, as :func:`kvbus.runtime.env.setting` declares them.

``python -m kvbus.configuration_doc`` rewrites docs/configuration.md; ``--check`` exits 1 when the
committed doc is not what the declarations give (tests/test_configuration_doc.py).

A new option is one declared field of its options class; a new options class (or module of
settings) is one entry of :data:`SECTIONS`, whose command's other flags are listed from its parser.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, is_dataclass
from pathlib import Path
from typing import Any, Iterator

from kvbus.runtime.env import MISSING, Setting, declared
from kvbus.schemas.generated_doc import write_or_check

DOC = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"


@dataclass(frozen=True)
class Section:
    """One table of the doc."""

    title: str
    intro: str
    sources: tuple[str, ...]
    """Where its settings are declared: ``module:Name``, a dataclass (its declared fields) or a Setting,
    or a tuple of Settings."""
    command: str | None = None
    """The ``kvbus`` subcommand whose flags the table lists too (those of its parser not declared above)."""


SECTIONS: tuple[Section, ...] = (
    Section("Every command", "Where the services are, the topic names and the log format: read by every `kvbus` "
            "command and by `infra/stack`.",
            ("kvbus.runtime.settings:Settings", "kvbus.schemas.topics:Topics",
             "kvbus.runtime.logs:LOG_FORMAT_SETTING")),
    Section("Security", "How every process authenticates to Kafka, Redis and the schema registry; unset: open. A "
            "secret's `*_FILE` variable names a file holding it (as Docker and Kubernetes mount secrets), and is "
            "preferred to the plain variable. The secured stack and the principals: [security.md](security.md).",
            ("kvbus.runtime.security:SETTINGS",)),
    Section("kvbus bridge", "One engine's ZMQ stream to `kvbus.raw`.",
            ("kvbus.producers.bridge:BridgeConfig", "kvbus.producers.cli:BridgeOptions"), "bridge"),
    Section("kvbus worker", "The Faust worker of the streams stage.",
            ("kvbus.streams.options:StreamsOptions",), "worker"),
    Section("kvbus sink", "The sink writing the residency view to Redis.",
            ("kvbus.sinks.config:SinkConfig",), "sink"),
    Section("kvbus serve", "The HTTP query API over the view ([serve.md](serve.md)); where the view is: the "
            "Redis settings of every command.", ("kvbus.serve.serve_config:ServeConfig",), "serve"),
    Section("kvbus top", "The live console; the groups and the view's prefix are the stages' own variables.",
            ("kvbus.top.top_config:TopConfig",), "top"),
    Section("The development stack", "`infra/stack up | down | status`, `kvbus demo` and the tests' stack, besides "
            "the settings of every command above ([development.md](development.md)).",
            ("kvbus.infra.stack_env:SETTINGS",)),
)
"""The doc's tables, in order."""


def resolve(source: str) -> Any:
    """The object ``module:Name`` names."""
    import importlib

    module, _, name = source.partition(":")
    return getattr(importlib.import_module(module), name)


def settings_of(source: str) -> Iterator[Setting]:
    """The Settings a source declares, in order."""
    obj = resolve(source)
    if isinstance(obj, Setting):
        yield obj
    elif is_dataclass(obj):
        yield from (s for _, s in declared(obj))
    else:
        yield from obj


def command_actions(command: str) -> list[argparse.Action]:
    """The flags of ``kvbus <command>``, help excluded, in the parser's order."""
    from kvbus.cli import build_parser

    parser = build_parser(command)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    return [a for a in sub._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _code(text: str) -> str:
    return f"`{text}`" if text else ""


def setting_row(s: Setting) -> str:
    """The table row of a declared setting: variable, flag, default, meaning."""
    variable = _code(s.variable or "")
    if s.secret and s.variable:
        variable += f" / `{s.variable}_FILE`"
    if s.default is MISSING:
        default = "required"
    elif s.shown is not None:
        default = s.shown
    else:
        shown = s.show(s.default)
        default = shown if shown in ("unset", "on", "off") else f"`{shown}`"
    return f"| {variable} | {_code(s.flag or '')} | {_cell(default)} | {_cell(s.doc)} |"


def action_row(action: argparse.Action) -> str:
    """The table row of a flag declared by no Setting: its argparse default and help."""
    default = "off" if action.nargs == 0 else ("unset" if action.default is None else f"`{action.default}`")
    return f"|  | {_code(action.option_strings[-1])} | {default} | {_cell(action.help or '')} |"


def section_text(section: Section) -> str:
    rows, seen = [], set()
    for source in section.sources:
        for s in settings_of(source):
            rows.append(setting_row(s))
            seen.add(s)
    if section.command is not None:
        for action in command_actions(section.command):
            s = getattr(action, "setting", None)
            if s is None:
                rows.append(action_row(action))
            elif s not in seen:
                rows.append(setting_row(s))
                seen.add(s)
    return "\n".join([f"## {section.title}", "", section.intro, "",
                      "| variable | flag | default | meaning |", "|---|---|---|---|", *rows, ""])


HEADER = """# Configuration

Every setting is an environment variable, and a stage's options are also flags of its command. A flag
defaults to its variable's value (`--help` names the variable and shows the value now); a flag given
wins. Unset or blank means the default. A malformed value or flag stops the command with exit code 2
and one line naming it and the form expected, e.g.
`kvbus sink: KVBUS_SINK_BATCH=2k: expected a whole number >= 1`.

The flags of `kvbus lookup`, `demo`, `fleet`, `report` and `schemas`: `kvbus <command> --help`.

<!-- generated by python -m kvbus.configuration_doc from the settings' declarations: edit those -->
"""


def render() -> str:
    """The whole doc."""
    return "\n".join([HEADER, *(section_text(s) for s in SECTIONS)])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvbus.configuration_doc", description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="exit 1 if docs/configuration.md is not up to date")
    args = p.parse_args(argv)
    return write_or_check(DOC, render(), "python -m kvbus.configuration_doc", args.check)


if __name__ == "__main__":
    sys.exit(main())
