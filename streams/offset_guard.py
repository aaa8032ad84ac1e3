"""Each raw partition's records processed in offset order, none skipped: :class:`OffsetGuard`.

The raw topic is written without transactions and never compacted, so the offsets of a partition
are consecutive from its log start. A worker rewinds each partition it is assigned to its committed
offset, and from there every record must reach the runtime, in order. A record delivered past the
offset expected next means that the consumer skipped records: Faust took a fetch's records that
arrived after a rewind for a gap in the log and dropped the records read again as already read
(docs/streams.md, "Skipped records"). The commit after that covered the skipped records, and the
partition's next owner never processed them.

The guard turns that into a visible, healed event. The record past the gap is held back (neither
processed nor acknowledged, so that no commit can cover the gap), the partition is read again from
the offset expected, and the records delivered past the gap meanwhile are held back too, until the
expected record arrives. If the log no longer has the records of the gap (retention deleted them
after the rewind's offset was committed), the first record the re-read delivers is taken as the
new start, and the gap is reported as gone.
"""
from __future__ import annotations

from enum import Enum
from typing import Mapping


class Admission(Enum):
    """What to do with one raw record (:meth:`OffsetGuard.admit`)."""

    PROCESS = "process"
    """The record expected next (or one already processed, delivered again): process it."""
    REREAD = "reread"
    """Records were skipped before this one: hold it back and read the partition again from
    :attr:`OffsetGuard.next`."""
    HOLD = "hold"
    """A record past a gap whose partition is being read again: hold it back (it comes again)."""
    GONE = "gone"
    """The partition was read again and the log starts past the gap: process it; the records of
    the gap are not in the log any more."""


class OffsetGuard:
    """Per raw partition, the offset of the record to process next, and the gaps being read again.
    Pure bookkeeping: the runtime holds back records and seeks (:mod:`kvbus.streams.runtime`)."""

    __slots__ = ("next", "rereading")

    def __init__(self) -> None:
        self.next: dict[int, int] = {}
        """Raw partition -> offset of the next record to process: where the partition was rewound
        to, then the offset after the last record processed (absent: not known, any record is taken)."""
        self.rereading: dict[int, int] = {}
        """Raw partition -> offset of the record delivered past the gap, while the partition is read
        again from :attr:`next`."""

    def rewound(self, offsets: Mapping[int, int]) -> None:
        """The assigned partitions were sought to ``offsets`` (raw partition -> offset): records
        are expected from there; partitions not in ``offsets`` are forgotten."""
        self.next.clear()
        self.next.update(offsets)
        self.rereading.clear()

    def admit(self, partition: int, offset: int) -> Admission:
        """Whether the record at ``offset`` of ``partition`` is to be processed now (its verdict
        also moves :attr:`next` and :attr:`rereading`)."""
        expected = self.next.get(partition)
        if expected is None or offset == expected:
            self.next[partition] = offset + 1
            if expected is not None:
                self.rereading.pop(partition, None)
            return Admission.PROCESS
        if offset < expected:
            return Admission.PROCESS  # processed already, delivered again: the state recognises it
        jumped = self.rereading.get(partition)
        if jumped is None:
            self.rereading[partition] = offset
            return Admission.REREAD
        if offset <= jumped:  # the re-read starts here: the log has nothing from `expected` to it
            del self.rereading[partition]
            self.next[partition] = offset + 1
            return Admission.GONE
        return Admission.HOLD
