"""docs/configuration.md is what kvbus.configuration_doc makes of the settings' declarations; every
``KVBUS_*`` name the code holds is in it, every flag the docs show a ``kvbus`` command with exists, and
every declared option is read from its variable and from its flag."""
from __future__ import annotations

import argparse
import ast
import dataclasses
import re
from pathlib import Path

import pytest

from kvbus.cli import SUBCOMMANDS, build_parser
from kvbus.configuration_doc import DOC, SECTIONS, render, resolve, settings_of
from kvbus.runtime.env import SWITCH, TEXT, Setting, add_flags, declared, from_flags

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ["kvbus", "schemas", "producers", "streams", "sinks", "infra", "analytics", "simulator"]
"""The folders of the wheel's package (pyproject.toml's package-dir)."""
VARIABLE = re.compile(r"KVBUS_[A-Z0-9_]*")


def test_committed_doc_is_up_to_date() -> None:
    assert DOC.read_text() == render(), \
        "docs/configuration.md is out of date: run .venv/bin/python -m kvbus.configuration_doc"


def documented() -> set[str]:
    return set(VARIABLE.findall(DOC.read_text()))


def names_in_code() -> dict[tuple[str, str], list[str]]:
    """Every ``KVBUS_*`` name in a string of the product code (messages and docstrings too), with how it
    is written, -> where: ``"prefix"`` when it ends with ``_`` or ends a string part followed by a
    formatted value (an f-string's ``KVBUS_TOP_{role}``), ``"whole"`` when it is a whole string (a
    declaration, or a prefix handed to code that appends to it), else ``"text"``."""
    found: dict[tuple[str, str], list[str]] = {}
    for folder in PRODUCT:
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.JoinedStr):
                    parts = node.values
                    texts = [(p.value, i + 1 < len(parts) and isinstance(parts[i + 1], ast.FormattedValue))
                             for i, p in enumerate(parts) if isinstance(p, ast.Constant) and isinstance(p.value, str)]
                elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                    texts = [(node.value, False)]
                else:
                    continue
                for text, formatted_next in texts:
                    for m in VARIABLE.finditer(text):
                        name = m.group()
                        how = ("prefix" if name.endswith("_") or (formatted_next and m.end() == len(text))
                               else "whole" if text == name else "text")
                        found.setdefault((name, how), []).append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def test_every_variable_the_code_names_is_documented() -> None:
    names, docs = names_in_code(), documented()
    assert len({n for n, how in names if how != "prefix"}) >= 60, sorted(names)

    def known(name: str, how: str) -> bool:
        if how == "prefix":  # a family: some documented variable starts with it
            return any(d.startswith(name) for d in docs)
        return name in docs or (how == "whole" and any(d.startswith(name + "_") for d in docs))

    missing = {name: where[:3] for (name, how), where in names.items() if not known(name, how)}
    assert not missing, f"named in the code, not in docs/configuration.md: {missing}"


NOT_SETTINGS = {"KVBUS_EXTRAS": "the Dockerfile's build argument", "KVBUS_KEEP_STACK": "the tests' own variable",
                "KVBUS_ENGINE_TESTS": "the tests' own variable (0 skips the real vLLM engine's tests)"}
"""``KVBUS_*`` names the docs use that are no setting of a kvbus command."""


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "deploy" / "kubernetes" / "README.md"]


def test_every_variable_the_docs_name_is_a_setting() -> None:
    docs = documented()
    named = {(name, path.name) for path in doc_files() for name in VARIABLE.findall(path.read_text())}
    assert len(named) >= 60
    missing = sorted((name, f) for name, f in named if name not in docs and name not in NOT_SETTINGS
                     and not (name.endswith("_") and any(d.startswith(name) for d in docs)))
    assert not missing, f"the docs name variables no command has: {missing}"


def all_settings() -> list[Setting]:
    return [s for section in SECTIONS for source in section.sources for s in settings_of(source)]


def test_the_doc_names_exactly_the_declared_variables() -> None:
    names = {s.variable for s in all_settings() if s.variable}
    assert documented() == names | {f"{s.variable}_FILE" for s in all_settings() if s.variable and s.secret}


def test_the_readme_rows_say_the_declared_defaults() -> None:
    rows = re.findall(r"^\| `(KVBUS_[A-Z0-9_]+)` \| `([^`]*)` \|", (ROOT / "README.md").read_text(), re.M)
    declared_as = {s.variable: s for s in all_settings()}
    assert len(rows) >= 5, rows
    for name, default in rows:
        assert declared_as[name].show(declared_as[name].default) == default, name


def parser_flags(command: str) -> set[str]:
    """Every flag of ``kvbus <command>`` (of its sub-subcommands too) and of ``kvbus`` itself."""
    parser = build_parser(command)
    flags = {o for a in parser._actions for o in a.option_strings}

    def walk(p: argparse.ArgumentParser) -> None:
        for a in p._actions:
            flags.update(a.option_strings)
            if isinstance(a, argparse._SubParsersAction):
                for sub in a.choices.values():
                    walk(sub)

    walk(next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command])
    return flags


COMMAND = re.compile(r"\bkvbus (" + "|".join(SUBCOMMANDS) + r")\b([^`\n|;#]*)")
"""``kvbus <command>`` and what follows it up to the end of its code span, line, pipe, or comment."""
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def flags_named() -> list[tuple[str, str, str]]:
    """(file, command, flag) of every flag written after a ``kvbus`` command in the README and docs/."""
    out = []
    for path in doc_files():
        text = re.sub(r"\\\n\s*", " ", path.read_text())  # shell continuation lines
        for m in COMMAND.finditer(text):
            out += [(path.name, m.group(1), flag) for flag in FLAG.findall(m.group(2))]
    return out


def test_every_flag_the_docs_show_exists() -> None:
    named = flags_named()
    assert len(named) >= 40 and {c for _, c, _ in named} >= {"bridge", "sink", "lookup", "top"}, named
    flags = {command: parser_flags(command) for command in SUBCOMMANDS}
    missing = sorted({(f, c, flag) for f, c, flag in named if flag not in flags[c]})
    assert not missing, f"flags the docs show that kvbus does not have: {missing}"


def options_classes() -> list[type]:
    return [c for section in SECTIONS for c in map(resolve, section.sources)
            if isinstance(c, type) and dataclasses.is_dataclass(c)]


def sample(form) -> str:
    """A value of ``form`` other than any default here."""
    if form.choices:
        return form.choices[-1]
    for text in ("7", "7.5", "127.0.0.1:7777", "x7", "x7=/y7", "on"):
        try:
            form.parse(text)
            return text
        except (ValueError, TypeError):
            continue
    raise AssertionError(f"no sample for {form.expected}")


@pytest.mark.parametrize("cls", options_classes(), ids=lambda c: c.__name__)
def test_each_option_comes_from_its_variable_and_its_flag_wins(cls) -> None:
    both = [(name, s) for name, s in declared(cls) if s.variable and s.flag and s.form is not SWITCH and not s.many]
    variables = [(name, s) for name, s in declared(cls) if s.variable]
    required = [a for _, s in declared(cls) if s.default is dataclasses.MISSING for a in (s.flag, "x")]
    needed = {n: "x" for n, s in declared(cls) if s.default is dataclasses.MISSING}  # a flag-only required one
    for name, s in variables:  # from the environment alone
        value = sample(s.form)
        want = (s.form.parse(value),) if s.many else s.form.parse(value)
        assert getattr(cls.from_env({s.variable: value}) if hasattr(cls, "from_env") else
                       from_flags(cls, argparse.Namespace(), {s.variable: value}, **needed), name) == want
    for name, s in both:
        env = {s.variable: sample(s.form)}
        p = argparse.ArgumentParser()
        add_flags(p, cls, env)
        assert getattr(from_flags(cls, p.parse_args(required), env), name) == s.form.parse(env[s.variable]), name
        given = "9" if s.form is not TEXT and not s.form.choices else "given"
        given = s.form.choices[0] if s.form.choices else given
        got = getattr(from_flags(cls, p.parse_args([*required, s.flag, given]), env), name)
        assert got == s.form.parse(given), (name, got)
    if cls.__name__ in ("SinkConfig", "StreamsOptions", "TopConfig"):
        assert both, f"{cls.__name__} has no option with both a variable and a flag"
