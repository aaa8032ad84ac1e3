"""``kvbus lookup`` run in-process, as the tests call it: its parser and its run, with the output captured."""
from __future__ import annotations

import argparse

import pytest

from kvbus.client import lookup_cli as cli
from kvbus.runtime.settings import Settings


def lookup_args(argv: list[str]) -> argparse.Namespace:
    """``kvbus lookup``'s options parsed from ``argv`` (its own parser, so every flag is the real one)."""
    p = argparse.ArgumentParser()
    cli.add_lookup_args(p)
    return p.parse_args(argv)


def run_lookup(argv: list[str], settings: Settings, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """Run ``kvbus lookup ARGV`` with ``settings``: (exit code, stdout, stderr)."""
    code = cli.run_lookup(lookup_args(argv), settings)
    out = capsys.readouterr()
    return code, out.out, out.err


def lookup_json(argv: list[str], settings: Settings, prefix: str, capsys: pytest.CaptureFixture[str]) -> str:
    """``kvbus lookup ARGV --prefix PREFIX --json``'s stdout; fails unless it exits 0."""
    code, out, err = run_lookup([*argv, "--prefix", prefix, "--json"], settings, capsys)
    assert code == 0, f"kvbus lookup {argv} exited {code}: {err}"
    return out
