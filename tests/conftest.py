"""Shared fixtures.

``stack``: the real services (Kafka, Apicurio Registry, Redis), started once per
test session through ``kvbus.infra.stack`` (the same code as ``infra/stack up``) and
stopped at the end if this session started them. A stack that does not come up
is an error, never a skip: integration tests must run in CI.
``secure_stack``: a secured stack (``infra/stack up --secure``'s code) of the session's own, on free
ports, for the ``secure`` tests; its :class:`kvbus.infra.secure.SecureLayout`.
``unique_topics``: topic names of one test (uuid suffix), created with explicit
partition counts; ``sink_topics``: the same for a sink test (blocks, a tier topic, dlq).
"""
from __future__ import annotations

import os
import uuid
from dataclasses import replace
from typing import TYPE_CHECKING, Iterator

import pytest

from kvbus.schemas.settings import Settings
from kvbus.schemas.topics import Topics

if TYPE_CHECKING:
    from kvbus.infra.secure import SecureLayout


def _stack_ready() -> bool:
    from kvbus.infra import stack

    try:
        return bool(stack.status().get("ready"))
    except Exception:
        return False


@pytest.fixture(scope="session")
def stack() -> Iterator[Settings]:
    """Settings of a running real stack; brought up (and later down) if it was not running."""
    from kvbus.infra import stack as infra_stack

    started_here = not _stack_ready()
    if started_here:
        infra_stack.up()
    yield Settings.from_env()
    if started_here and os.environ.get("KVBUS_KEEP_STACK") != "1":
        infra_stack.down()


@pytest.fixture(scope="session")
def secure_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator["SecureLayout"]:
    """A secured stack of this session's own (``kvbus.infra.secure``, the code of ``infra/stack up
    --secure``; own state directory and free ports, so it runs next to the open dev stack),
    stopped at the end."""
    from tests.secure_stack import secured

    with secured(tmp_path_factory.mktemp("secure")) as layout:
        yield layout


@pytest.fixture
def unique_topics(stack: Settings) -> Iterator[Topics]:
    """Fresh topic names for one test, created with the stack's partition count, deleted
    afterwards (with any tier topic the test made) so a developer's stack does not grow."""
    from kvbus.infra.dev_topics import ensure_topics

    suffix = uuid.uuid4().hex[:8]
    t = Topics(
        raw=f"t{suffix}.raw",
        blocks=f"t{suffix}.blocks",
        incomplete=f"t{suffix}.incomplete",
        dlq=f"t{suffix}.dlq",
        snapshots=f"t{suffix}.snapshots",
    )
    ensure_topics(stack.bootstrap, [t.raw, t.blocks, t.incomplete, t.dlq], stack.partitions, 1)
    yield t
    _delete_topics(stack, f"t{suffix}.")


@pytest.fixture
def sink_topics(stack: Settings) -> Iterator[Topics]:
    """Fresh topics for a sink test: the block topic and its ``kvcr`` tier topic (2 partitions
    each, so records of several holders interleave), a dead-letter topic, and a snapshot topic
    name (the sink creates it); all deleted afterwards."""
    from kvbus.infra.dev_topics import ensure_topics

    suffix = uuid.uuid4().hex[:8]
    t = Topics(blocks=f"s{suffix}.blocks", dlq=f"s{suffix}.dlq", snapshots=f"s{suffix}.snapshots")
    ensure_topics(stack.bootstrap, [t.blocks, t.for_ownership("kvcr"), t.dlq], 2, 1)
    yield t
    _delete_topics(stack, f"s{suffix}.")


def _delete_topics(stack: Settings, prefix: str) -> None:
    """Delete every topic whose name starts with ``prefix`` (a test's, with any tier topic it made)
    so a developer's stack does not grow."""
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": stack.bootstrap})
    ours = [name for name in admin.list_topics(timeout=10).topics if name.startswith(prefix)]
    if not ours:
        return
    for future in admin.delete_topics(ours, operation_timeout=10).values():
        try:
            future.result(15)
        except Exception:  # noqa: BLE001 - cleanup only; a leftover topic is harmless
            pass


@pytest.fixture
def test_settings(stack: Settings, unique_topics: Topics) -> Settings:
    """The stack's settings with this test's own topics."""
    return replace(stack, topics=unique_topics)
