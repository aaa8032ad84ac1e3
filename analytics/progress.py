"""What ``kvbus report`` shows while it reads: records read, the span of time they cover, and a bar.

The offsets to read are known before reading starts (:func:`kvbus.analytics.reader.plan`), so the bar's
total is the number of offsets in the range (transaction markers and records whose time lies outside
the range included, so the bar may end a little short of full); with no total (nothing planned yet)
it shows the counts alone. Drawn with rich (already kvbus's terminal library) on stderr, so stdout
keeps only the summary; off when stderr is not a terminal unless forced.
"""
from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

from kvbus.analytics.reader import PartitionRange, Record


def _utc(ts: float) -> str:
    return datetime.fromtimestamp(ts, timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


class ReadProgress:
    """A live line ``reading [bar] n/N records <first> .. <last> UTC (<seconds> s)`` (record times).

    Use as a context manager; pass :meth:`planned` and :meth:`advance` to
    :func:`kvbus.analytics.reader.read` as ``on_plan`` / ``on_record``."""

    def __init__(self, enabled: bool | None = None, console: Console | None = None) -> None:
        self.console = console or Console(stderr=True)
        self.enabled = self.console.is_terminal if enabled is None else enabled
        self.records = 0
        """Records read so far."""
        self.ranges: list[PartitionRange] = []
        """The planned offset ranges (empty before :meth:`planned`)."""
        self.first: float | None = None
        """Earliest record timestamp seen (seconds since the Unix epoch)."""
        self.last: float | None = None
        """Latest record timestamp seen."""
        self._progress = Progress(
            TextColumn("reading"), BarColumn(bar_width=30), MofNCompleteColumn(), TextColumn("records"),
            TextColumn("{task.fields[covered]}"),
            console=self.console, disable=not self.enabled, transient=False,
        )
        self._task = self._progress.add_task("read", total=None, covered="")

    def __enter__(self) -> "ReadProgress":
        self._progress.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._progress.refresh()
        self._progress.stop()

    def planned(self, ranges: list[PartitionRange]) -> None:
        """The ranges to read: sets the bar's total."""
        self.ranges = ranges
        self._progress.update(self._task, total=sum(r.records for r in ranges))

    def advance(self, record: Record) -> None:
        """One more record read."""
        self.records += 1
        ts = record.timestamp
        self.first = ts if self.first is None else min(self.first, ts)
        self.last = ts if self.last is None else max(self.last, ts)
        if self.records % 500 == 0 or self.records == 1:
            self._progress.update(self._task, completed=self.records, covered=self.covered())

    def covered(self) -> str:
        """``<first> .. <last> UTC (<seconds> s)`` of the records read, or '' before the first."""
        if self.first is None or self.last is None:
            return ""
        return f"{_utc(self.first)} .. {_utc(self.last)} UTC ({self.last - self.first:.0f} s)"

    def finish(self) -> None:
        """Show the final counts."""
        self._progress.update(self._task, completed=self.records, covered=self.covered())

