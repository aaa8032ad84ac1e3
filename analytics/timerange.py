"""The time range of a report: ``--since`` / ``--until`` values and what they select.

A value is an ISO 8601 time (``2026-12-01T13:00:00``, ``2026-12-01 13:00``, a ``Z`` or ``+01:00``
suffix; without one it is UTC), seconds since the Unix epoch (``1764594000``), or an age before now
(``15m``, ``2h``, ``1d``, ``90s``, also written ``-15m``). The range selects Kafka records by their
record timestamp (the producing stage's clock when it wrote the record), which is what Kafka can
seek by (``offsets_for_times``), and the report times everything by the same clock (its series are
per minute of record time), so the range and the charts agree whatever the engines' clocks say.
"""
from __future__ import annotations

import re
import time
from dataclasses import dataclass
from datetime import datetime, timezone

_AGE = re.compile(r"-?(\d+(?:\.\d+)?)\s*([smhd])")
_UNIT_S = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_time(text: str, now: float | None = None) -> float:
    """Seconds since the Unix epoch that ``text`` names (see the module doc); ``now`` for ages
    (default: the current time). Raises ValueError for anything else."""
    text = text.strip()
    m = _AGE.fullmatch(text)
    if m:
        return (time.time() if now is None else now) - float(m.group(1)) * _UNIT_S[m.group(2)]
    try:
        return float(text)
    except ValueError:
        pass
    try:
        dt = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(f"not a time: {text!r} (ISO 8601, epoch seconds, or an age like 15m)") from None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return dt.timestamp()


@dataclass(frozen=True)
class TimeRange:
    """Records with ``since <= record timestamp < until``; None = from the beginning / to the end
    (the end offsets when reading starts)."""

    since: float | None = None
    """Seconds since the Unix epoch, or None."""
    until: float | None = None
    """Seconds since the Unix epoch, or None."""

    def __post_init__(self) -> None:
        if self.since is not None and self.until is not None and self.until <= self.since:
            raise ValueError("--until must be after --since")

    def contains(self, ts: float) -> bool:
        """Whether a record time ``ts`` (seconds since the epoch) is in the range."""
        return (self.since is None or ts >= self.since) and (self.until is None or ts < self.until)

    def describe(self) -> str:
        """``from the beginning to the end``, or the bounds in UTC."""
        def fmt(t: float | None, none: str) -> str:
            return none if t is None else datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
        return f"{fmt(self.since, 'from the beginning')} .. {fmt(self.until, 'the end')}"
