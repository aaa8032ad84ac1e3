"""kvbus report's --since/--until values (Kafka record times) and its clock-skew threshold."""
from __future__ import annotations

import argparse

import pytest

from kvbus.analytics.cli import add_report_args
from kvbus.analytics.timerange import TimeRange, parse_time

NOW = 1_767_225_600.0  # 2026-01-01 00:00:00 UTC


@pytest.mark.parametrize("text, expected", [
    ("2026-01-01T00:00:00", NOW), ("2026-01-01 00:00", NOW), ("2026-01-01T00:00:00Z", NOW),
    ("2026-01-01T01:00:00+01:00", NOW), ("1767225600", NOW), ("1767225600.5", NOW + 0.5),
    ("15m", NOW - 900), ("-15m", NOW - 900), ("2h", NOW - 7200), ("1d", NOW - 86400), ("90s", NOW - 90),
    ("1.5h", NOW - 5400),
])
def test_times_ages_and_epoch_seconds(text: str, expected: float) -> None:
    assert parse_time(text, now=NOW) == expected


@pytest.mark.parametrize("text", ["yesterday", "15 minutes", "2026-13-01", ""])
def test_anything_else_is_refused(text: str) -> None:
    with pytest.raises(ValueError):
        parse_time(text, now=NOW)


def test_until_must_follow_since_and_the_flags_parse() -> None:
    with pytest.raises(ValueError):
        TimeRange(since=NOW, until=NOW)
    p = argparse.ArgumentParser()
    add_report_args(p)
    args = p.parse_args(["--since", "2026-01-01", "--until", "1767229200"])
    assert (args.since, args.until) == (NOW, NOW + 3600)
    assert TimeRange(args.since, args.until).describe() == "2026-01-01 00:00:00 UTC .. 2026-01-01 01:00:00 UTC"
    assert TimeRange().describe() == "from the beginning .. the end"


def test_the_range_holds_record_times_from_since_up_to_until() -> None:
    span = TimeRange(since=NOW, until=NOW + 60)
    assert [span.contains(t) for t in (NOW - 0.001, NOW, NOW + 59.999, NOW + 60)] == [False, True, True, False]
    assert TimeRange().contains(0.0) and TimeRange(until=NOW).contains(NOW - 86400 * 365)
    assert not TimeRange(since=NOW).contains(NOW - 1)


def test_clock_skew_threshold_flag() -> None:
    p = argparse.ArgumentParser()
    add_report_args(p)
    assert p.parse_args([]).clock_skew == 300.0
    assert p.parse_args(["--clock-skew", "30"]).clock_skew == 30.0
