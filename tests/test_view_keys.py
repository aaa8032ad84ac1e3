"""The view's keys are declared once (kvbus.schemas.view_keys); the function library, the Go client and the
docs name exactly those: a key added, renamed or dropped in one of them without the declaration fails here."""
from __future__ import annotations

import re
from pathlib import Path

from kvbus.schemas import view_keys
from kvbus.schemas.lookup import guard_key, hname_key, meta_key, status_key
from kvbus.sinks.view import protocol as vp

ROOT = Path(__file__).resolve().parents[1]
DECLARED = {k.name for k in view_keys.KEYS}


def lua_keys() -> set[str]:
    """Every ``P .. '<name>'`` (and ``prefix .. "<name>"``) in the function library."""
    text = (ROOT / "sinks" / "view" / "lua" / "kvbus.lua").read_text()
    return set(re.findall(r"""\b(?:P|prefix) \.\. ['"]([A-Za-z]+:?)['"]""", text))


def go_keys() -> set[str]:
    """Every ``<prefix variable> + "<name>"`` in the Go package's sources (its tests left out)."""
    found: set[str] = set()
    for path in (ROOT / "clients" / "go" / "kvbuslookup").glob("*.go"):
        if not path.name.endswith("_test.go"):
            found |= set(re.findall(r"""(?:\bv|Prefix, 0\))\s*\+\s*"([A-Za-z]+:?)\"""", path.read_text()))
    return found


def doc_keys() -> set[str]:
    """Every key docs/sinks-layout.md's key tables list (``| `P name`, `P other` | ...``)."""
    text = (ROOT / "docs" / "sinks-layout.md").read_text()
    found: set[str] = set()
    for line in text.splitlines():
        if line.startswith("| `P "):
            first = line.split("|")[1]
            found |= {m.split("<")[0] for m in re.findall(r"`P ([A-Za-z]+:?(?:<[^`]*>)?)`", first)}
    return found


def test_the_function_library_names_the_declared_keys() -> None:
    used = lua_keys()
    assert used - DECLARED == set(), f"kvbus.lua names keys kvbus.schemas.view_keys does not declare: {used - DECLARED}"
    assert DECLARED - view_keys.WRITTEN_BY_PYTHON - used == set(), "declared keys kvbus.lua never names"


def test_the_go_client_reads_only_the_readers_keys() -> None:
    readers = {k.name for k in view_keys.KEYS if k.readers}
    used = go_keys()
    assert used, "the pattern finds the Go client's keys"
    assert used <= readers, f"the Go client reads keys that are not the lookup protocol's: {used - readers}"


def test_the_docs_list_every_declared_key() -> None:
    assert doc_keys() == DECLARED - {view_keys.GUARD.name}, (doc_keys() ^ (DECLARED - {view_keys.GUARD.name}))


def test_the_python_key_functions_are_the_declarations() -> None:
    p = "kvbus:"
    assert (meta_key(p), guard_key(p), hname_key(p), status_key(p)) == (
        "kvbus:meta", "kvbus:guard", "kvbus:hname", "kvbus:status")
    assert vp.holder_state_key(p, 7) == "kvbus:H:7" == view_keys.HOLDER(p, 7)
    assert vp.index_key(p, 7, 2, 5) == "kvbus:I:7:2:5"
    assert vp.refcount_key(p, 7, 2) == "kvbus:R:7:2"
    assert vp.block_key(p, 3) == "kvbus:B:3"
    assert vp.wide_key(p, b"\x00\x01") == b"kvbus:W:\x00\x01"
    assert {vp.off_key(p), vp.seen_key(p), vp.stale_key(p), vp.tname_key(p), vp.models_key(p)} == {
        "kvbus:off", "kvbus:seen", "kvbus:stale", "kvbus:tname", "kvbus:mh"}
