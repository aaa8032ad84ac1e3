"""CHANGELOG.md's Compatibility section states what the code defines: the view's key layout version,
the schemas' compatibility level, the subcommands, the topic names and the install extras; its newest
version is the package's."""
from __future__ import annotations

import re
import tomllib
from pathlib import Path

import kvbus
from kvbus.cli import SUBCOMMANDS
from kvbus.schemas.registry import KVBUS_COMPATIBILITY
from kvbus.schemas.topics import Topics
from kvbus.sinks.view.functions import layout_version

ROOT = Path(__file__).resolve().parent.parent
CHANGELOG = (ROOT / "CHANGELOG.md").read_text()


def today(contract: str) -> list[str]:
    """The backticked values in the "today" column of the Compatibility table's row ``contract``."""
    rows = [line for line in CHANGELOG.splitlines() if line.startswith(f"| {contract} |")]
    assert len(rows) == 1, f"CHANGELOG.md has {len(rows)} Compatibility rows named {contract!r}"
    cells = [c.strip() for c in re.split(r"(?<!\\)\|", rows[0])[1:-1]]
    return re.findall(r"`([^`]+)`", cells[1]) or cells[1].split()


def test_the_newest_version_is_the_package_version():
    versions = re.findall(r"^## \[([^\]]+)\]", CHANGELOG, re.M)
    assert versions and versions[0] == kvbus.__version__, versions


def test_the_layout_and_schema_rule_are_the_code_s():
    assert today("view key layout") == [layout_version()]
    assert today("lookup protocol") == [layout_version()]
    assert today("Avro schemas") == [KVBUS_COMPATIBILITY]


def test_the_stable_names_are_the_code_s():
    cli = today("CLI")
    assert cli[0].split()[0] == "kvbus" and sorted(cli[0].split()[1:]) == sorted(SUBCOMMANDS)
    assert cli[1:] == ["kvbus --version", "-V"]
    t = Topics()
    assert today("topic names and keys") == [t.raw, t.packed, f"{t.packed}.<ownership>", t.blocks,
                                             f"{t.blocks}.<ownership>", t.incomplete, t.dlq, t.snapshots,
                                             "<replica>#<dp_rank>"]
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert sorted(today("install extras")[0].split()) == sorted(extras)
