"""What kvbus report shows while it reads: a bar over the planned offsets, records read, the time
they cover."""
from __future__ import annotations

import io

from rich.console import Console

from kvbus.analytics.progress import ReadProgress
from kvbus.analytics.reader import PartitionRange, Record

T0 = 1_767_225_600.0  # 2026-01-01 00:00:00 UTC


def test_bar_counts_records_against_the_plan_and_shows_the_time_covered() -> None:
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=160, color_system=None)
    with ReadProgress(enabled=True, console=console) as progress:
        progress.planned([PartitionRange("t", 0, 10, 15), PartitionRange("t", 1, 0, 3)])
        for i in range(6):
            progress.advance(Record("t", i % 2, i, T0 + 30 * i, None, None))
        progress.finish()
    text = out.getvalue()
    assert progress.records == 6
    assert "6/8 records" in text
    assert "2026-01-01 00:00:00 .. 2026-01-01 00:02:30 UTC (150 s)" in text
    assert "━" in text  # the bar


def test_nothing_is_drawn_when_disabled() -> None:
    out = io.StringIO()
    with ReadProgress(enabled=False, console=Console(file=out)) as progress:
        progress.planned([PartitionRange("t", 0, 0, 2)])
        progress.advance(Record("t", 0, 0, T0, None, None))
        progress.finish()
    assert out.getvalue() == "" and progress.covered().startswith("2026-01-01 00:00:00")
