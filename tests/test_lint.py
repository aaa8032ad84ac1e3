"""The repository passes ``ruff check`` with the configuration in pyproject.toml (``[tool.ruff]``), and that
configuration holds lines to 120 characters. Runs the ruff of the venv that runs the tests (the ``dev`` extra)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def ruff(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    """``ruff ARGS`` in the repository (so pyproject.toml's ``[tool.ruff]`` applies), without a cache."""
    return subprocess.run([sys.executable, "-m", "ruff", *args, "--no-cache"], cwd=REPO, input=stdin,
                          capture_output=True, text=True, timeout=120)


def test_the_tree_passes_ruff() -> None:
    res = ruff("check", "--output-format", "concise", ".")
    assert res.returncode == 0, f"ruff check found problems (fix them, or `ruff check --fix` for the safe ones):\n" \
                                f"{res.stdout}{res.stderr}"


def test_a_line_over_120_characters_is_a_finding() -> None:
    """The check above can fail: the same configuration flags a 121-character line, not a 120-character one."""
    def findings(line: str) -> str:
        res = ruff("check", "--output-format", "concise", "--stdin-filename", "kvbus/lint_probe.py", "-",
                   stdin=line + "\n")
        assert res.returncode in (0, 1), res.stderr
        return res.stdout

    fits = 'X = "' + "x" * (120 - len('X = ""')) + '"'
    assert len(fits) == 120 and "E501" not in findings(fits)
    assert "E501" in findings(fits[:-1] + 'x"')
