"""Writing, or checking, a page of docs/ that a generator makes from the code (docs/topics.md from the
.avsc files, docs/configuration.md from the option declarations): the one ``--check`` rule both follow."""
from __future__ import annotations

from pathlib import Path


def write_or_check(doc: Path, text: str, command: str, check: bool) -> int:
    """``check``: whether ``doc`` holds ``text`` (0) or not (1, naming ``command``, which rewrites it);
    else write ``text`` to ``doc`` (0). Prints what it found or did."""
    name = f"{doc.parent.name}/{doc.name}"
    if check:
        ok = doc.is_file() and doc.read_text() == text
        print(f"{name} is up to date" if ok else f"{name} is out of date: run {command}")
        return 0 if ok else 1
    doc.write_text(text)
    print(f"wrote {doc}")
    return 0
