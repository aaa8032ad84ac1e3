"""Sequencer: in-order, gaps filled by replay, partial fills, restarts, duplicates, epochs."""
from __future__ import annotations

import itertools

from kvbus.producers.sequencer import (
    REASON_BRIDGE_START,
    REASON_ENGINE_RESTART,
    REASON_GAP,
    Emit,
    ResetMarker,
    Sequencer,
    outputs_seqs,
)


def clock_from(start: int = 1000):
    """A deterministic ms clock that advances 1 ms per call."""
    counter = itertools.count(start)
    return lambda: next(counter)


def seq_of(replay: bool, **kw) -> Sequencer:
    return Sequencer(replay=replay, clock=clock_from(), **kw)


def emitted(outs) -> list[tuple[int, int, str]]:
    """(epoch, seq, item) of Emit outputs and (epoch, -1, reason) of markers."""
    rows = []
    for o in outs:
        if isinstance(o, Emit):
            rows.append((o.epoch, o.seq, o.item))
        else:
            rows.append((o.epoch, -1, o.reason))
    return rows


def test_in_order_stream_keeps_one_epoch_without_markers():
    s = seq_of(replay=False)
    outs = []
    for i in range(5):
        outs += s.on_live(i, f"b{i}").out
    assert outputs_seqs(outs) == [0, 1, 2, 3, 4]
    assert len({o.epoch for o in outs}) == 1
    assert s.stats.resets == 0 and s.stats.gaps == 0


def test_first_batch_not_zero_without_replay_gets_bridge_start_marker():
    s = seq_of(replay=False)
    outs = s.on_live(7, "b7").out + s.on_live(8, "b8").out
    assert isinstance(outs[0], ResetMarker) and outs[0].reason == REASON_BRIDGE_START
    assert outs[0].epoch == outs[1].epoch  # marker opens the epoch of the batches
    assert outputs_seqs(outs) == [-1, 7, 8]


def test_slow_joiner_filled_from_replay_at_start():
    s = seq_of(replay=True)
    a = s.start()
    assert a.replay_from == 0
    assert s.on_live(3, "b3").out == []  # held while the replay runs
    outs = []
    for i in range(4):
        outs += s.on_replayed(i, f"b{i}").out
    outs += s.on_replay_end(complete=True).out
    outs += s.on_live(4, "b4").out
    assert outputs_seqs(outs) == [0, 1, 2, 3, 4]
    assert [o.item for o in outs] == ["b0", "b1", "b2", "b3", "b4"]
    assert s.stats.duplicates == 1  # b3 came live and replayed
    assert s.stats.resets == 0


def test_gap_filled_by_replay_in_order_before_live_and_later_live_held():
    s = seq_of(replay=True, epoch=5, last_seq=2)
    outs = s.on_live(3, "b3").out
    a = s.on_live(6, "b6")
    assert a.replay_from == 4 and a.out == []
    assert s.on_live(7, "b7").out == []  # arrives during the replay: held
    outs += s.on_replayed(4, "b4").out + s.on_replayed(5, "b5").out + s.on_replayed(6, "b6").out
    outs += s.on_replay_end().out
    assert outputs_seqs(outs) == [3, 4, 5, 6, 7]
    assert {o.epoch for o in outs} == {5}
    assert [o.replayed for o in outs] == [False, True, True, True, False]
    assert s.stats.gaps == 1 and s.stats.replays == 1 and s.stats.recovered == 3
    assert s.stats.resets == 0


def test_partial_fill_emits_gap_reset_in_new_epoch_for_the_evicted_part():
    s = seq_of(replay=True, epoch=5, last_seq=9)
    a = s.on_live(20, "b20")
    assert a.replay_from == 10
    outs = []
    for i in range(15, 21):  # 10..14 were evicted from the engine's buffer
        outs += s.on_replayed(i, f"b{i}").out
    outs += s.on_replay_end().out
    rows = emitted(outs)
    assert rows[0][1:] == (-1, REASON_GAP)
    assert isinstance(outs[0], ResetMarker) and (outs[0].missing_from, outs[0].missing_to) == (10, 14)
    new_epoch = rows[0][0]
    assert new_epoch > 5
    assert rows[1:] == [(new_epoch, i, f"b{i}") for i in range(15, 21)]
    assert s.stats.lost == 5


def test_replay_timeout_without_anything_resets_and_continues():
    s = seq_of(replay=True, epoch=5, last_seq=1)
    assert s.on_live(4, "b4").replay_from == 2
    assert s.on_live(5, "b5").out == []
    outs = s.on_replay_end(complete=False).out
    assert [type(o) for o in outs] == [ResetMarker, Emit, Emit]
    assert (outs[0].reason, outs[0].missing_from, outs[0].missing_to) == (REASON_GAP, 2, 3)
    assert outputs_seqs(outs) == [-1, 4, 5]
    assert s.stats.replays_incomplete == 1
    # afterwards the stream just continues
    assert outputs_seqs(s.on_live(6, "b6").out) == [6]


def test_gap_without_replay_endpoint_is_reset_immediately():
    s = seq_of(replay=False, epoch=5, last_seq=1)
    outs = s.on_live(4, "b4").out
    assert (outs[0].reason, outs[0].missing_from, outs[0].missing_to) == (REASON_GAP, 2, 3)
    assert outs[1].epoch == outs[0].epoch > 5


def test_engine_restart_opens_new_epoch_with_marker():
    s = seq_of(replay=False)
    outs = []
    for i in range(3):
        outs += s.on_live(i, f"a{i}").out
    outs += s.on_live(0, "n0").out + s.on_live(1, "n1").out
    rows = emitted(outs)
    old = rows[0][0]
    assert rows[:3] == [(old, 0, "a0"), (old, 1, "a1"), (old, 2, "a2")]
    new = rows[3][0]
    assert new > old
    assert rows[3:] == [(new, -1, REASON_ENGINE_RESTART), (new, 0, "n0"), (new, 1, "n1")]
    assert s.stats.restarts == 1


def test_engine_restart_seen_late_replays_new_run_from_zero():
    s = seq_of(replay=True, epoch=5, last_seq=100)
    a = s.on_live(3, "n3")  # counter went back: restart, and we missed n0..n2
    assert isinstance(a.out[0], ResetMarker) and a.out[0].reason == REASON_ENGINE_RESTART
    assert a.replay_from == 0
    outs = list(a.out)
    for i in range(4):
        outs += s.on_replayed(i, f"n{i}").out
    outs += s.on_replay_end().out
    rows = emitted(outs)
    new = rows[0][0]
    assert rows == [(new, -1, REASON_ENGINE_RESTART)] + [(new, i, f"n{i}") for i in range(4)]


def test_duplicate_replayed_batches_are_dropped():
    s = seq_of(replay=True, epoch=5, last_seq=4)
    assert s.on_live(7, "b7").replay_from == 5
    outs = []
    for i in range(2, 8):  # the engine replays from further back than asked
        outs += s.on_replayed(i, f"b{i}").out
    outs += s.on_replayed(6, "b6-again").out
    outs += s.on_replay_end().out
    assert outputs_seqs(outs) == [5, 6, 7]
    assert [o.item for o in outs] == ["b5", "b6", "b7"]


def test_resume_from_kafka_replays_what_the_engine_still_buffers():
    s = seq_of(replay=True, epoch=42, last_seq=9)
    assert s.start().replay_from == 10
    outs = []
    for i in range(10, 13):
        outs += s.on_replayed(i, f"b{i}").out
    outs += s.on_replay_end().out + s.on_live(13, "b13").out
    assert outputs_seqs(outs) == [10, 11, 12, 13]
    assert {o.epoch for o in outs} == {42}


def test_resume_detects_restart_that_happened_while_bridge_was_down():
    s = seq_of(replay=True, epoch=42, last_seq=500)
    assert s.start().replay_from == 501
    s.on_live(0, "n0")  # held
    outs = s.on_replay_end().out  # nothing >= 501 in the engine's buffer
    rows = emitted(outs)
    assert rows[0][1:] == (-1, REASON_ENGINE_RESTART)
    assert rows[1] == (rows[0][0], 0, "n0")
    assert rows[0][0] > 42


def test_fresh_replay_timeout_then_first_live_still_tries_replay():
    s = seq_of(replay=True)
    assert s.start().replay_from == 0
    assert s.on_replay_end(complete=False).out == []  # engine not up yet
    a = s.on_live(2, "b2")
    assert a.replay_from == 0
    outs = s.on_replayed(0, "b0").out + s.on_replayed(1, "b1").out + s.on_replayed(2, "b2").out
    outs += s.on_replay_end().out
    assert outputs_seqs(outs) == [0, 1, 2]


def test_start_replay_unanswered_while_the_engine_came_up_is_asked_once_more():
    """The bridge started before its engine: the start's replay timed out just as the engine came
    up and its first live batches (past the slow joiner's loss) were held. They prove the engine is
    up: the replay from 0 is asked again, and the stream starts at 0 with no bridge-start marker.
    A second unanswered replay declares the past unknown."""
    s = seq_of(replay=True)
    assert s.start().replay_from == 0
    assert s.on_live(2, "b2").out == [] and s.on_live(3, "b3").out == []  # held: replay pending
    again = s.on_replay_end(complete=False)
    assert again.out == [] and again.replay_from == 0
    outs = s.on_replayed(0, "b0").out + s.on_replayed(1, "b1").out + s.on_replayed(2, "b2").out
    outs += s.on_replay_end().out + s.on_live(4, "b4").out
    assert outputs_seqs(outs) == [0, 1, 2, 3, 4] and s.stats.resets == 0

    s = seq_of(replay=True)
    s.start()
    s.on_live(2, "b2")
    assert s.on_replay_end(complete=False).replay_from == 0
    s.on_live(3, "b3")
    outs = s.on_replay_end(complete=False).out
    assert isinstance(outs[0], ResetMarker) and outs[0].reason == REASON_BRIDGE_START
    assert outputs_seqs(outs) == [-1, 2, 3]


def test_fresh_replay_that_cannot_reach_zero_emits_bridge_start_marker():
    s = seq_of(replay=True)
    s.start()
    outs = s.on_replayed(50, "b50").out + s.on_replayed(51, "b51").out + s.on_replay_end().out
    assert isinstance(outs[0], ResetMarker) and outs[0].reason == REASON_BRIDGE_START
    assert outputs_seqs(outs) == [-1, 50, 51]


def test_too_many_held_batches_abandon_the_replay():
    s = Sequencer(replay=True, epoch=5, last_seq=0, clock=clock_from(), max_held=3)
    assert s.on_live(5, "b5").replay_from == 1
    s.on_live(6, "b6")
    s.on_live(7, "b7")
    a = s.on_live(8, "b8")
    assert not s.replay_pending
    assert outputs_seqs(a.out) == [-1, 5, 6, 7, 8]
    assert s.on_replayed(1, "late").out == []  # a late reply is ignored


def test_epochs_strictly_increase_even_with_a_stuck_clock():
    s = Sequencer(replay=False, clock=lambda: 1000)
    epochs = []
    for _ in range(3):
        outs = s.on_live(0, "x").out
        epochs.append(outs[-1].epoch)
    assert epochs == sorted(set(epochs))


def test_empty_start_replay_then_late_first_batch_replays_again():
    """The start-up replay can be answered before the SUB subscription is effective:
    batches published in between are fetched by a second replay."""
    s = seq_of(replay=True)
    assert s.start().replay_from == 0
    assert s.on_replay_end(complete=True).out == []
    assert s.on_live(2, "b2").replay_from == 0
    outs = s.on_replayed(0, "b0").out + s.on_replayed(1, "b1").out + s.on_replayed(2, "b2").out
    outs += s.on_replay_end().out
    assert outputs_seqs(outs) == [0, 1, 2]
    assert s.stats.resets == 0


def test_second_gap_among_batches_held_during_a_replay_is_replayed_too():
    """The replay was answered at seq 15; 16..19 and 22 arrived live meanwhile, 20/21 were lost."""
    s = seq_of(replay=True, epoch=5, last_seq=2)
    assert s.on_live(6, "b6").replay_from == 3
    for i in range(7, 20):
        s.on_live(i, f"b{i}")
    s.on_live(22, "b22")
    outs = []
    for i in range(3, 16):
        outs += s.on_replayed(i, f"b{i}").out
    end = s.on_replay_end()
    outs += end.out
    assert end.replay_from == 20  # beyond what the first replay covered
    outs += s.on_replayed(20, "b20").out + s.on_replayed(21, "b21").out + s.on_replayed(22, "b22").out
    outs += s.on_replay_end().out
    assert outputs_seqs(outs) == list(range(3, 23))
    assert s.stats.resets == 0


def test_gap_inside_what_a_finished_replay_covered_is_not_replayed_again():
    s = seq_of(replay=True, epoch=5, last_seq=2)
    assert s.on_live(9, "b9").replay_from == 3
    outs = []
    for i in (3, 4, 7, 8, 9):  # 5 and 6 are gone from the engine too
        outs += s.on_replayed(i, f"b{i}").out
    end = s.on_replay_end()
    assert end.replay_from is None
    outs += end.out
    assert outputs_seqs(outs) == [3, 4, -1, 7, 8, 9]


def test_resume_check_spots_an_engine_restart_that_already_passed_our_seq():
    """Bridge down; the engine restarted and its new run reached beyond our last seq 5:
    the replayed seq 5 is not the batch we produced -> reset, then the new run from 0."""
    s = seq_of(replay=True, epoch=42, last_seq=5, is_last=lambda item: item == "old5")
    assert s.start().replay_from == 5
    assert s.on_replayed(5, "new5").out == []
    assert s.on_replayed(6, "new6").out == []
    s.on_live(8, "new8")
    end = s.on_replay_end()
    assert [type(o) for o in end.out] == [ResetMarker] and end.out[0].reason == REASON_ENGINE_RESTART
    assert end.replay_from == 0
    outs = list(end.out)
    for i in range(8):
        outs += s.on_replayed(i, f"new{i}").out
    outs += s.on_replay_end().out
    rows = emitted(outs)
    new = rows[0][0]
    assert new > 42
    assert rows[1:] == [(new, i, f"new{i}") for i in range(9)]


def test_resume_check_passes_when_the_engine_kept_running():
    s = seq_of(replay=True, epoch=42, last_seq=5, is_last=lambda item: item == "b5")
    assert s.start().replay_from == 5
    outs = s.on_replayed(5, "b5").out + s.on_replayed(6, "b6").out + s.on_replay_end().out
    assert emitted(outs) == [(42, 6, "b6")]


def test_live_copy_arriving_after_the_replay_ended_is_a_duplicate_not_a_restart():
    """Replay and live are two sockets: the replay can overtake live messages."""
    s = seq_of(replay=True)
    assert s.start().replay_from == 0
    outs = []
    for i in range(3):
        outs += s.on_replayed(i, f"b{i}").out
    outs += s.on_replay_end().out
    for i in range(4):  # the live copies of 0..2 arrive late, then 3
        outs += s.on_live(i, f"b{i}").out
    assert outputs_seqs(outs) == [0, 1, 2, 3]
    assert s.stats.restarts == 0 and s.stats.duplicates == 3


def test_restart_right_after_a_replay_is_still_detected_by_content():
    s = seq_of(replay=False, epoch=5, last_seq=-1)
    s.replay = True
    assert s.on_live(3, "b3").replay_from == 0
    for i in range(4):
        s.on_replayed(i, f"b{i}")
    s.on_replay_end()
    outs = s.on_live(0, "new-run-0").out  # same seq as a replayed batch, other content
    assert isinstance(outs[0], ResetMarker) and outs[0].reason == REASON_ENGINE_RESTART


def _streaming(last: int) -> Sequencer:
    """A replaying sequencer that produced batches 0..last in order."""
    s = seq_of(replay=True)
    assert s.start().replay_from == 0
    s.on_replayed(0, "b0")
    s.on_replay_end()
    for i in range(1, last + 1):
        s.on_live(i, f"b{i}")
    assert s.last == last
    return s


def test_catch_up_after_shedding_recovers_a_tail_no_later_batch_reveals():
    s = _streaming(4)
    a = s.catch_up()  # batches 5..7 were shed and the engine went quiet
    assert a.replay_from == 5
    outs = []
    for i in (5, 6, 7):
        outs += s.on_replayed(i, f"b{i}").out
    outs += s.on_replay_end().out
    assert outputs_seqs(outs) == [5, 6, 7]
    assert s.stats.resets == 0
    assert s.on_live(7, "b7").out == []  # the live copy arriving late is a duplicate
    assert outputs_seqs(s.on_live(8, "b8").out) == [8]


def test_catch_up_with_nothing_missing_changes_nothing():
    s = _streaming(2)
    assert s.catch_up().replay_from == 3
    assert s.on_replay_end().out == []
    assert s.stats.resets == 0 and s.last == 2
    assert outputs_seqs(s.on_live(3, "b3").out) == [3]


def test_catch_up_does_nothing_while_a_replay_runs_or_without_replay():
    s = _streaming(2)
    s.on_live(5, "b5")  # gap: a replay from 3 is in flight
    assert s.replay_pending and s.catch_up().replay_from is None
    assert seq_of(replay=False).catch_up().replay_from is None
