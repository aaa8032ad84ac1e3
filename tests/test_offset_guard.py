"""A worker processes each raw partition's records in offset order from where it was rewound, none
skipped: kvbus.streams.offset_guard, and the runtime's handling of its verdicts."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from aiokafka.errors import IllegalStateError
from faust.types import TP

from kvbus.runtime.settings import Settings
from kvbus.streams.offset_guard import Admission, OffsetGuard
from kvbus.streams.options import StreamsOptions
from kvbus.streams.runtime import Runtime

P, G, R, H = Admission.PROCESS, Admission.GONE, Admission.REREAD, Admission.HOLD


def verdicts(guard: OffsetGuard, partition: int, offsets: list[int]) -> list[Admission]:
    return [guard.admit(partition, o) for o in offsets]


def test_records_in_order_from_the_rewind_are_processed():
    guard = OffsetGuard()
    guard.rewound({0: 10, 1: 0})
    assert verdicts(guard, 0, [10, 11, 12]) == [P, P, P]
    assert verdicts(guard, 1, [0, 1]) == [P, P]
    assert guard.next == {0: 13, 1: 2}


def test_a_partition_not_rewound_takes_any_first_record():
    guard = OffsetGuard()
    assert verdicts(guard, 3, [7, 8]) == [P, P] and guard.next == {3: 9}


def test_a_record_delivered_again_is_processed_without_moving_back():
    guard = OffsetGuard()
    guard.rewound({0: 5})
    assert verdicts(guard, 0, [5, 6, 5, 6, 7]) == [P, P, P, P, P]
    assert guard.next == {0: 8}


def test_a_gap_is_read_again_and_the_records_past_it_held_until_then():
    guard = OffsetGuard()
    guard.rewound({0: 349})
    # the stale fetch: records past the rewind's offset, then the same partition read again from 349
    assert verdicts(guard, 0, [664, 665, 666]) == [R, H, H]
    assert guard.next == {0: 349} and guard.rereading == {0: 664}
    assert verdicts(guard, 0, [349, 350]) == [P, P]
    assert guard.rereading == {} and guard.next == {0: 351}
    assert verdicts(guard, 0, list(range(351, 667))) == [P] * 316


def test_a_gap_the_log_no_longer_has_is_reported_gone_and_the_partition_goes_on():
    guard = OffsetGuard()
    guard.rewound({0: 100})  # committed 100, retention deleted up to 250 since
    assert verdicts(guard, 0, [250, 251]) == [R, H]
    assert verdicts(guard, 0, [250, 251, 252]) == [G, P, P]  # the re-read starts at the log's start
    assert guard.next == {0: 253} and guard.rereading == {}


def test_a_re_read_that_starts_inside_the_gap_processes_from_there():
    guard = OffsetGuard()
    guard.rewound({0: 100})
    assert verdicts(guard, 0, [300]) == [R]
    assert verdicts(guard, 0, [180, 181]) == [G, P]
    assert guard.next == {0: 182}


def test_a_new_rewind_forgets_the_gaps_being_read_again():
    guard = OffsetGuard()
    guard.rewound({0: 0, 1: 0})
    assert verdicts(guard, 0, [5]) == [R]
    guard.rewound({1: 40})
    assert guard.rereading == {} and guard.next == {1: 40}
    assert verdicts(guard, 0, [9]) == [P]  # no longer assigned here, nothing expected


# -- the runtime acts on the verdicts --------------------------------------------------------------


class Event:
    """A Faust event as the runtime reads it: ``.message`` and the final ``ack``."""

    def __init__(self, tp: TP, offset: int, acked: list[tuple[int, int]]):
        self.message = SimpleNamespace(tp=tp, topic=tp.topic, partition=tp.partition, offset=offset, value=b"x",
                                       key=b"k")
        self._acked = acked

    def ack(self) -> None:
        self._acked.append((self.message.partition, self.message.offset))


class DeliveringProducer:
    """Stands for the output producer: every record is acknowledged at the next poll."""

    def __init__(self) -> None:
        self.waiting: list[Any] = []

    def produce(self, topic: str, value: bytes, key: bytes, partition: int, on_delivery: Any) -> None:
        self.waiting.append(on_delivery)

    def poll(self, timeout: float) -> int:
        waiting, self.waiting = self.waiting, []
        for cb in waiting:
            cb(None, None)
        return len(waiting)

    def flush(self, timeout: float) -> int:
        return self.poll(timeout)


async def test_the_runtime_holds_back_records_past_a_gap_and_reads_the_partition_again():
    """Records delivered past a gap are neither processed nor acknowledged (so that no commit covers
    the gap), the partition is sought back to the offset expected, and the records read again are
    processed and acknowledged in order. The records here are not Avro (each becomes a dead letter,
    which is processing enough for the guard)."""
    settings = Settings.from_env({})
    tp = TP(settings.topics.raw, 2)
    sought: list[dict[TP, int]] = []
    acked: list[tuple[int, int]] = []

    async def seek_wait(offsets: dict[TP, int]) -> None:
        sought.append(dict(offsets))

    consumer = SimpleNamespace(assignment=lambda: {tp}, seek_wait=seek_wait, _gap={tp: "gap noted by Faust"})
    runtime = Runtime(SimpleNamespace(consumer=consumer), settings, StreamsOptions(), table={})
    runtime._started = True  # no Kafka, registry or admin client: the fakes below stand for them
    runtime._producer = DeliveringProducer()
    runtime._codec = SimpleNamespace(decode=lambda value, topic: 1 / 0, encode=lambda value, topic: b"dead letter")
    runtime._partitions = {settings.topics.dlq: 4}
    runtime.guard.rewound({2: 349})

    async def settle() -> None:
        for _ in range(200):
            if not runtime._inflight and not runtime._delivered:
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"batches still in flight after 2 s: {len(runtime._inflight)} + {len(runtime._delivered)}")

    await runtime.process([Event(tp, o, acked) for o in (664, 665)])
    await asyncio.sleep(0)  # the seek back runs as a task of its own
    await settle()
    assert sought == [{tp: 349}], f"expected one seek back to 349, saw {sought}"
    assert consumer._gap == {}, "Faust's gap for the jump was kept: its commits would pass the records re-read"
    assert acked == [], f"records past the gap were acknowledged: {acked}"
    assert runtime.metrics.offset_gaps.labels("reread")._value.get() == 1

    await runtime.process([Event(tp, o, acked) for o in (349, 350, 351)])
    await settle()
    assert acked == [(2, 349), (2, 350), (2, 351)] and runtime.guard.next == {2: 352}
    assert runtime.metrics.dead_letters.labels("decode")._value.get() == 3, "held-back records were processed"
    assert sought == [{tp: 349}], f"a second seek was made: {sought}"


async def test_a_partition_revoked_during_the_rebuild_leaves_the_worker_unready_without_failing():
    """The rebuild reads the committed offsets (slow while a broker is away), and a rebalance revokes a
    partition meanwhile: aiokafka then refuses the seek. The worker waits, unready, for the rebuild of
    the rebalance under way instead of failing (which made it exit)."""
    settings = Settings.from_env({})
    kept, revoked = TP(settings.topics.raw, 0), TP(settings.topics.raw, 3)

    async def seek_wait(offsets: dict[TP, int]) -> None:
        if revoked in offsets:
            raise IllegalStateError(f"No current assignment for partition {revoked}")

    app = SimpleNamespace(consumer=SimpleNamespace(seek_wait=seek_wait),
                          assignor=SimpleNamespace(assigned_actives=lambda: {kept, revoked}))
    runtime = Runtime(app, settings, StreamsOptions(), table={})
    runtime._started = True  # no Kafka, registry or admin client: the offsets reader below stands for them
    runtime._group_offsets = SimpleNamespace(committed=lambda tps: {tp: 100 for tp in tps})
    runtime.ready = True

    await runtime.rebuild()

    assert not runtime.ready, "the worker was ready with partitions it no longer holds"
    assert runtime.assigned == frozenset(), f"the stale assignment was taken: {runtime.assigned}"
