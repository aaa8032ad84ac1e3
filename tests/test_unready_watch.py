"""The worker's unready watch: a spell of unreadiness is timed from its first look, ends when the
worker is ready again, and is too long only past the limit (never with the limit 0); a step that
fails exits at once, naming the error; and a worker held unready exits with the error, on the real
stack."""
from __future__ import annotations

import asyncio
import threading
from typing import Callable

import pytest

from kvbus.streams.unready_watch import UnreadyWatch, exit_on_failure


def test_a_spell_is_too_long_only_past_the_limit():
    w = UnreadyWatch(60)
    assert w.check("recovering", 1000.0) is None
    assert w.check("recovering", 1060.0) is None
    verdict = w.check("recovering", 1061.0)
    assert verdict is not None and "not ready for 61.0 s (recovering)" in verdict
    assert "KVBUS_STREAMS_RECOVERY_TIMEOUT=60" in verdict


def test_being_ready_ends_the_spell():
    w = UnreadyWatch(60)
    w.check("rebalancing", 0.0)
    assert w.check(None, 50.0) is None and w.since is None
    assert w.check("rebalancing", 100.0) is None  # a new spell, timed from here
    assert w.check("rebalancing", 159.0) is None
    assert w.check("rebalancing", 161.0) is not None


@pytest.mark.parametrize("limit", [0, 0.0])
def test_limit_zero_waits_for_ever(limit):
    w = UnreadyWatch(limit)
    w.check("recovering", 0.0)
    assert w.check("recovering", 10**9) is None


def exit_recorder() -> tuple[list[str], threading.Event, Callable[[str], None]]:
    """An ``exit_with`` that records its verdict (and the thread it ran on) instead of exiting."""
    verdicts: list[str] = []
    called = threading.Event()

    def exit_with(verdict: str) -> None:
        verdicts.append(f"{threading.current_thread().name}: {verdict}")
        called.set()
    return verdicts, called, exit_with


def test_a_failed_step_exits_at_once_naming_the_error():
    verdicts, called, exit_with = exit_recorder()

    async def rebuild() -> None:
        raise RuntimeError("NOT_COORDINATOR")
    asyncio.run(exit_on_failure("rebuilding the state", rebuild, exit_with)())
    assert called.wait(10), "exit_with was not called within 10 s of the failed step"
    assert verdicts == ["exit-on-failure: rebuilding the state failed (RuntimeError: NOT_COORDINATOR): "
                        "exiting so that the worker is started again"]


def test_a_step_that_succeeds_does_not_exit():
    verdicts, called, exit_with = exit_recorder()
    done = []

    async def rebuild() -> None:
        done.append(True)
    asyncio.run(exit_on_failure("rebuilding the state", rebuild, exit_with)())
    assert done == [True] and not called.wait(0.2), verdicts


@pytest.mark.integration
def test_a_worker_that_cannot_join_its_group_exits_naming_the_timeout(test_settings, tmp_path):
    """The worker's group held by a plain consumer with another assignor, so the worker never gets
    an assignment (as a stalled recovery never ends). With ``KVBUS_STREAMS_RECOVERY_TIMEOUT=5`` the
    worker exits with 1 and says why."""
    import threading
    import uuid

    from confluent_kafka import Consumer

    from tests.pipeline import Pipeline

    app_id = f"t{uuid.uuid4().hex[:8]}.streams"
    holder = Consumer({"bootstrap.servers": test_settings.bootstrap, "group.id": app_id,
                       "partition.assignment.strategy": "range", "session.timeout.ms": 60000})
    assigned, stop = threading.Event(), threading.Event()
    holder.subscribe([test_settings.topics.raw], on_assign=lambda c, parts: assigned.set())

    def hold() -> None:
        while not stop.is_set():
            holder.poll(0.2)
    poller = threading.Thread(target=hold, daemon=True)
    poller.start()
    pipeline = Pipeline(test_settings, tmp_path)
    try:
        assert assigned.wait(60), f"the plain consumer got no assignment in group {app_id} within 60 s"
        child = pipeline.children.start("worker", "worker", "--app-id", app_id, "--workdir", str(tmp_path),
                                        env={"KVBUS_STREAMS_RECOVERY_TIMEOUT": "5"})
        try:
            child.proc.wait(180)
        except Exception:  # noqa: BLE001 - still running: say what it logged
            raise AssertionError(f"the worker still runs 180 s after its start; its log ends: "
                                 f"{child.log_path.read_text(errors='replace')[-3000:]}") from None
        out = child.log_path.read_text(errors="replace")
        assert child.proc.returncode == 1, out[-3000:]
        assert "longer than KVBUS_STREAMS_RECOVERY_TIMEOUT=5: exiting" in out, out[-3000:]
    finally:
        pipeline.stop()
        stop.set()
        poller.join(5)
        holder.close()
