"""Faust behind one door: kvbus.streams.faust_adapter is the only module touching Faust's private names.

* The installed faust-streaming (and mode-streaming) has every internal the adapter declares, with
  its kind and signature, and the sources the adapter was reviewed against: an upgrade whose
  internals changed fails here, each message naming what changed.
* The checks do catch a change (an internal removed, re-signed, retyped or rewritten).
* No product module other than the adapter imports or touches a private name of faust, mode or
  aiokafka (an AST scan, below), and the adapter declares every private name it touches.

The scan, per product module: ``from faust... import _x`` or a private module path; ``x._y`` where ``x``
is an imported faust/mode/aiokafka module or object; ``self._y`` and ``def _y`` inside a class deriving
from a Faust class, where a class of that Faust MRO defines ``_y``; ``obj._y`` and
``getattr(obj, "_y")`` on any other object, where ``_y`` is defined somewhere in faust, mode or
aiokafka and nowhere in kvbus's product code. kvbus's own privates are therefore not flagged; the one
blind spot is a Faust private reached through a non-Faust-typed name whose name kvbus also defines
for itself (``_producer``, ``_lock``, ...).
"""
from __future__ import annotations

import ast
import asyncio
import functools
import importlib
import inspect
import textwrap
import tomllib
from pathlib import Path
from typing import Any, Optional

import faust
import faust.streams
import faust.transport.consumer
import faust.transport.producer
import pytest
from faust.transport.drivers import aiokafka as faust_aiokafka
from mode.utils.queues import FlowControlQueue

from kvbus.streams import faust_adapter
from kvbus.streams.faust_adapter import INTERNALS, FaustInternalsChanged, broken_internals, revised_internals

ROOT = Path(__file__).resolve().parents[1]
ADAPTER = ROOT / "streams" / "faust_adapter.py"
THIRD_PARTY = ("faust", "mode", "aiokafka")
"""Top-level packages whose private names only the adapter may touch."""


def product_files() -> list[Path]:
    """Every Python file of the wheel (pyproject.toml's package-dir folders)."""
    package_dir = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    return sorted(p for folder in set(package_dir.values()) for p in (ROOT / folder).rglob("*.py")
                  if "__pycache__" not in p.parts)


def is_private(name: str) -> bool:
    """``_x`` but not ``__x__``."""
    return name.startswith("_") and not name.endswith("__")


def is_third_party(dotted: str) -> bool:
    return dotted.split(".")[0] in THIRD_PARTY


def defined_privates(tree: ast.AST) -> set[str]:
    """Private names a module defines: functions, classes, assigned names and attributes stored."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return {n for n in names if is_private(n)}


@functools.cache
def third_party_privates() -> frozenset[str]:
    """Every private name defined anywhere in the installed faust, mode and aiokafka."""
    names: set[str] = set()
    for package in THIRD_PARTY:
        for path in Path(importlib.import_module(package).__file__).parent.rglob("*.py"):
            names |= defined_privates(ast.parse(path.read_text(encoding="utf-8")))
    return frozenset(names)


@functools.cache
def kvbus_privates() -> frozenset[str]:
    """Every private name kvbus's product code outside the adapter defines for itself."""
    names: set[str] = set()
    for path in product_files():
        if path != ADAPTER:
            names |= defined_privates(ast.parse(path.read_text(encoding="utf-8")))
    return frozenset(names)


@functools.cache
def mro_privates(cls: type) -> frozenset[str]:
    """Private names the faust/mode/aiokafka classes of ``cls``'s MRO define (members and ``self._x`` stores)."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if not is_third_party(klass.__module__):
            continue
        names |= {n for n in vars(klass) if is_private(n)}
        try:
            names |= defined_privates(ast.parse(textwrap.dedent(inspect.getsource(klass))))
        except (OSError, TypeError, SyntaxError):
            pass
    return frozenset(names)


def resolve(dotted: str) -> Any:
    """The object ``a.b.C`` names: the longest importable module prefix, then attributes."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for part in parts[i:]:
            obj = getattr(obj, part)
        return obj
    raise ImportError(dotted)


class Scan(ast.NodeVisitor):
    """Private faust/mode/aiokafka names one module touches, as ``line: what``."""

    def __init__(self, tree: ast.Module):
        self.imports: dict[str, str] = {}
        """Local name -> dotted path it was imported as."""
        self.classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
        self.found: list[tuple[int, str, str]] = []
        """(line, private name, what)."""
        self.faust_bases: list[Optional[type]] = []
        """Per enclosing class: the Faust-derived base it extends, or None."""
        self.selves: list[str] = []
        self.visit(tree)

    def hit(self, node: ast.AST, name: str, what: str) -> None:
        self.found.append((node.lineno, name, what))

    def dotted(self, node: ast.AST) -> Optional[str]:
        """``a.b.c`` as the dotted path of what ``a`` was imported as; None when ``a`` is not an import."""
        if isinstance(node, ast.Name):
            return self.imports.get(node.id)
        if isinstance(node, ast.Attribute):
            head = self.dotted(node.value)
            return None if head is None else f"{head}.{node.attr}"
        return None

    def faust_base(self, cls: ast.ClassDef) -> Optional[type]:
        """The first base class of ``cls`` whose MRO has a faust/mode/aiokafka class, or None."""
        for base in cls.bases:
            if isinstance(base, ast.Name) and base.id in self.classes and base.id not in self.imports:
                found = self.faust_base(self.classes[base.id])
                if found is not None:
                    return found
                continue
            path = self.dotted(base)
            if path is None or not is_third_party(path):  # only Faust's, mode's and aiokafka's classes matter
                continue
            obj = resolve(path)
            if isinstance(obj, type) and any(is_third_party(k.__module__) for k in obj.__mro__):
                return obj
        return None

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if is_third_party(alias.name) and any(is_private(p) for p in alias.name.split(".")):
                self.hit(node, alias.name, f"imports the private module {alias.name}")
            if alias.asname:
                self.imports[alias.asname] = alias.name
            else:
                top = alias.name.split(".")[0]
                self.imports[top] = top

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        module = node.module or ""
        for alias in node.names:
            if node.level == 0:
                self.imports[alias.asname or alias.name] = f"{module}.{alias.name}"
            if node.level == 0 and is_third_party(module):
                private = [p for p in [*module.split("."), alias.name] if is_private(p)]
                if private:
                    self.hit(node, private[-1], f"imports {module}.{alias.name}")

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.faust_bases.append(self.faust_base(node))
        for child in node.body:
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self.method(child)
            else:
                self.visit(child)
        self.faust_bases.pop()

    def method(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        base = self.faust_bases[-1]
        if base is not None and is_private(node.name) and node.name in mro_privates(base):
            self.hit(node, node.name, f"overrides {base.__module__}.{base.__qualname__}.{node.name}")
        args = node.args.posonlyargs + node.args.args
        self.selves.append(args[0].arg if args else "")
        self.generic_visit(node)
        self.selves.pop()

    def visit_Attribute(self, node: ast.Attribute) -> None:
        name = node.attr
        if is_private(name):
            receiver = node.value
            path = self.dotted(receiver)
            own = (isinstance(receiver, ast.Name) and self.selves and receiver.id == self.selves[-1]) or (
                isinstance(receiver, ast.Call) and isinstance(receiver.func, ast.Name) and receiver.func.id == "super")
            base = self.faust_bases[-1] if self.faust_bases else None
            if path is not None and is_third_party(path):
                self.hit(node, name, f"{path}.{name}")
            elif own:
                if base is not None and name in mro_privates(base):
                    self.hit(node, name, f"self.{name} of {base.__module__}.{base.__qualname__}")
            elif name in third_party_privates() and name not in kvbus_privates():
                self.hit(node, name, f"{ast.unparse(node)} (a faust/mode/aiokafka private)")
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        if (isinstance(node.func, ast.Name) and node.func.id in ("getattr", "setattr", "hasattr", "delattr")
                and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)):
            name = node.args[1].value
            if isinstance(name, str) and is_private(name) and name in third_party_privates() \
                    and name not in kvbus_privates():
                self.hit(node, name, f"{node.func.id}(..., {name!r}) (a faust/mode/aiokafka private)")
        self.generic_visit(node)


def scan(source: str) -> list[tuple[int, str, str]]:
    return Scan(ast.parse(source)).found


def stock_consumer() -> faust_aiokafka.Consumer:
    """A consumer of Faust's own aiokafka transport, built but not started (no broker is contacted)."""
    app = faust.App("kvbus-faust-internals", broker="aiokafka://127.0.0.1:9", autodiscover=False)
    consumer = app.consumer
    assert type(consumer) is faust_aiokafka.Consumer
    return consumer


# -- the installed Faust ------------------------------------------------------------------------


async def test_installed_faust_has_every_internal_the_adapter_relies_on():
    consumer = stock_consumer()
    fetching = consumer._thread._create_worker_consumer(consumer.transport)  # aiokafka's, not started
    instances = (consumer, fetching)
    owners = [i for i in INTERNALS if i.kind == "instance attribute"]
    for internal in owners:  # every instance attribute is checked on an instance, not skipped
        owner = faust_adapter.resolve(internal.where.rpartition(".")[0])
        assert any(isinstance(i, owner) for i in instances), internal.where
    broken = broken_internals(*instances)
    assert not broken, f"{faust_adapter.installed_versions()}:\n" + "\n".join(broken)


async def test_the_worker_consumers_fetches_wait_at_most_the_adapters_wait():
    """Faust's driver builds its aiokafka consumer with a 1.5 s fetch wait; the adapter's thread sets
    FETCH_MAX_WAIT_MS before the consumer starts (start() hands it to aiokafka's fetcher)."""
    app = faust.App("kvbus-fetch-wait", broker=f"{faust_adapter.SCHEME}://127.0.0.1:9", autodiscover=False)
    thread = app.consumer._thread
    assert type(thread) is faust_adapter.ConsumerThread
    assert stock_consumer()._thread._create_worker_consumer(app.transport)._fetch_max_wait_ms == 1500
    assert thread._create_worker_consumer(app.transport)._fetch_max_wait_ms == faust_adapter.FETCH_MAX_WAIT_MS < 1500


def test_installed_faust_has_the_sources_the_adapter_was_reviewed_against():
    revised = revised_internals()
    assert not revised, f"{faust_adapter.installed_versions()}:\n" + "\n".join(revised)


def test_the_worker_consumer_is_the_adapters_and_passes_its_own_check():
    app = faust.App("kvbus-faust-internals", broker=f"{faust_adapter.SCHEME}://127.0.0.1:9", autodiscover=False)
    assert type(app.consumer) is faust_adapter.Consumer
    assert type(app.producer) is faust_adapter.Producer
    assert type(app.producer.buffer) is faust_adapter.ProducerBuffer and app.producer.buffer.app is app


# -- the fast hand-over ----------------------------------------------------------------------------


async def test_a_fetch_under_way_when_a_rebalance_suspends_the_flow_still_delivers_its_records():
    """The consumer thread's fetch completes whether or not the event loop still waits for it (mode's
    ``call_thread``: a cancelled caller only loses the result), and it takes its records out of
    aiokafka. So a suspended flow must not cancel the wait for a fetch: its records would be read and
    never delivered (what stalled recovery for good, or made a survivor skip records)."""
    from types import SimpleNamespace

    from faust.types import TP

    app = faust.App("kvbus-fast-handover", broker=f"{faust_adapter.SCHEME}://127.0.0.1:9", autodiscover=False)
    consumer = app.consumer
    records = [(TP("kvbus-fast-handover-changelog", 2), SimpleNamespace(topic="kvbus-fast-handover-changelog",
                                                                       offset=offset)) for offset in range(3)]
    fetching, release = asyncio.Event(), asyncio.Event()
    taken: list[int] = []
    delivered: list[int] = []
    fetches: list[asyncio.Future] = []

    async def thread_fetch() -> list[Any]:  # stands for aiokafka's fetched_records on the consumer thread
        await release.wait()
        taken.extend(message.offset for _tp, message in records)
        return records

    async def getmany(timeout: float) -> Any:  # Faust's getmany: one fetch, then its records
        if fetches:
            await asyncio.sleep(0.01)
            return
        fetches.append(asyncio.ensure_future(thread_fetch()))
        fetching.set()
        for item in await asyncio.shield(fetches[0]):
            yield item

    async def callback(message: Any) -> None:
        delivered.append(message.offset)

    consumer.getmany = getmany
    consumer.callback = callback
    fetcher = SimpleNamespace(_stopped=asyncio.Event())
    drain = asyncio.ensure_future(consumer._drain_messages(fetcher))
    try:
        await asyncio.wait_for(fetching.wait(), 5)
        consumer.stop_flow()  # a rebalance starts while the fetch waits on the consumer thread
        await asyncio.sleep(0.05)
        consumer.resume_flow()  # ... and ends
        release.set()  # the fetch returns the records it took out of aiokafka
        for _ in range(500):
            if delivered == taken == [0, 1, 2]:
                break
            await asyncio.sleep(0.01)
        assert delivered == taken == [0, 1, 2], (
            f"waited 5 s for the records the fetch took ({taken}) to be delivered; delivered: {delivered}")
    finally:
        fetcher._stopped.set()
        drain.cancel()
        await asyncio.gather(drain, return_exceptions=True)


# -- the bounded flush ----------------------------------------------------------------------------


async def flush_under_steady_writes(buffer_class: type) -> tuple[list[object], list[object], int]:
    """Buffer 50 messages, then flush while every message sent brings two more (table writes that
    outpace the sends, until 2,000 sends): (the 50, what was sent when the flush returned, how many
    were still buffered then)."""
    from types import SimpleNamespace

    buf = buffer_class()
    buf.app = SimpleNamespace(conf=SimpleNamespace(producer_threaded=False))
    sent: list[object] = []
    writing = True

    async def send(message: object) -> None:  # stands for handing the record to aiokafka
        await asyncio.sleep(0)
        sent.append(message)
        if writing and len(sent) < 2000:
            buf.put(object())
            buf.put(object())

    buf._send_pending = send
    await buf.start()
    first = [object() for _ in range(50)]
    for m in first:
        buf.put(m)
    await buf.flush()
    at_return, left = list(sent), buf.size
    writing = False
    await buf.flush_atmost(None)  # empty, so that it stops
    await buf.stop()
    return first, at_return, left


async def test_the_flush_before_a_commit_waits_for_what_was_buffered_not_for_an_empty_buffer():
    # the premise: Faust's own flush returns only once the buffer is empty, i.e. after the writes stop
    first, at_return, left = await flush_under_steady_writes(faust.transport.producer.ProducerBuffer)
    assert len(at_return) >= 2000 and left == 0
    first, at_return, left = await flush_under_steady_writes(faust_adapter.ProducerBuffer)
    assert set(map(id, first)) <= set(map(id, at_return)), "a message buffered before the flush was not sent"
    assert len(at_return) < 1000 and left > 0, (len(at_return), left)  # long before the writes stopped


# -- the offsets beside the fetch -------------------------------------------------------------------


async def test_recovery_offsets_come_from_the_lookup_given_else_from_faust():
    """Table recovery's questions (high watermarks, earliest offsets) go to the lookup the runtime
    gave the consumer; without one, or when it fails, to Faust's own consumer thread."""
    from types import SimpleNamespace

    from faust.types import TP

    app = faust.App("kvbus-offsets-beside", broker=f"{faust_adapter.SCHEME}://127.0.0.1:9", autodiscover=False)
    consumer = app.consumer
    tps = [TP("kvbus-offsets-beside-state-changelog", p) for p in (0, 1)]
    faust_asked: list[str] = []

    async def faust_highwaters(*partitions: TP) -> dict[TP, int]:
        faust_asked.append("highwaters")
        return {tp: 100 for tp in partitions}

    async def faust_earliest(*partitions: TP) -> dict[TP, int]:
        faust_asked.append("earliest")
        return {tp: 1 for tp in partitions}

    consumer._thread = SimpleNamespace(highwaters=faust_highwaters, earliest_offsets=faust_earliest)
    assert await consumer.highwaters(*tps) == {tp: 100 for tp in tps} and faust_asked == ["highwaters"]

    asked: list[list[TP]] = []

    def lookup(partitions: list[TP]) -> dict[TP, tuple[int, int]]:
        asked.append(partitions)
        return {tp: (3 + tp.partition, 10 + tp.partition) for tp in partitions}

    faust_adapter.look_up_offsets_with(app, lookup)
    assert await consumer.highwaters(*tps) == {tps[0]: 10, tps[1]: 11}
    assert await consumer.earliest_offsets(*tps) == {tps[0]: 3, tps[1]: 4}
    assert asked == [tps, tps] and faust_asked == ["highwaters"]

    def failing(partitions: list[TP]) -> dict[TP, tuple[int, int]]:
        raise RuntimeError("no leader")

    faust_adapter.look_up_offsets_with(app, failing)
    assert await consumer.earliest_offsets(*tps) == {tp: 1 for tp in tps} and faust_asked[-1] == "earliest"


async def test_with_no_partition_active_the_take_sleeps_briefly_not_a_second():
    """While recovery has every raw partition paused, Faust's take sleeps 1 s and the resumed
    partitions wait for it; the adapter's sleeps GETMANY_TIMEOUT. With active partitions it fetches those."""
    from faust.types import TP

    app = faust.App("kvbus-take-sleep", broker=f"{faust_adapter.SCHEME}://127.0.0.1:9", autodiscover=False)
    consumer = app.consumer
    slept: list[float] = []
    fetched: list[Any] = []
    active: set[TP] = set()

    async def sleep(seconds: float) -> None:
        slept.append(seconds)

    async def getmany(active_partitions: Any, timeout: float) -> dict[TP, list[Any]]:
        fetched.append((active_partitions, timeout))
        return {tp: ["record"] for tp in active_partitions}

    consumer.sleep, consumer._getmany, consumer._get_active_partitions = sleep, getmany, lambda: set(active)
    consumer.resume_flow()
    assert await consumer._wait_next_records(1.0) == ({}, set())
    assert slept == [faust_adapter.GETMANY_TIMEOUT] and faust_adapter.GETMANY_TIMEOUT < 1 and not fetched
    active.add(TP("kvbus-take-sleep-raw", 0))
    assert await consumer._wait_next_records(1.0) == ({TP("kvbus-take-sleep-raw", 0): ["record"]}, active)
    assert fetched == [(active, 1.0)] and len(slept) == 1


# -- the checks catch a change --------------------------------------------------------------------


def test_a_missing_internal_is_named_and_stops_the_worker_consumer(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delattr(faust.transport.consumer.Consumer, "_add_gap")
    assert broken_internals() == ["faust.transport.consumer.Consumer._add_gap: missing "
                                  "(faust.transport.consumer.Consumer has no attribute '_add_gap')"]
    app = faust.App("kvbus-faust-internals", broker=f"{faust_adapter.SCHEME}://127.0.0.1:9", autodiscover=False)
    with pytest.raises(FaustInternalsChanged, match=r"faust-streaming .*Consumer\._add_gap: missing"):
        app.consumer


def test_a_changed_signature_kind_or_type_is_named(monkeypatch: pytest.MonkeyPatch):
    async def add_gap(self: Any, tp: Any, start: int, end: int) -> None:
        """Stands for a release that renamed the parameters."""

    def drain_messages(self: Any, fetcher: Any) -> None:
        """Stands for a release whose loop is no longer a coroutine."""

    monkeypatch.setattr(faust.transport.consumer.Consumer, "_add_gap", add_gap)
    monkeypatch.setattr(faust.transport.consumer.Consumer, "_drain_messages", drain_messages)
    monkeypatch.setattr(faust.streams, "_current_event", {})
    consumer = stock_consumer()
    consumer._n_acked = "0"
    assert broken_internals(consumer) == [
        "faust.streams._current_event: is of kind 'dict', expected 'context variable'",
        "faust.transport.consumer.Consumer._drain_messages: is of kind 'function', expected 'coroutine function'",
        "faust.transport.consumer.Consumer._add_gap: parameters (self, tp, start, end), "
        "expected (self, tp, offset_from, offset_to)",
        "faust.transport.consumer.Consumer._n_acked: is a str, expected int",
    ]


def test_a_rewritten_source_is_named(monkeypatch: pytest.MonkeyPatch):
    def enable_passive(self: Any, channel: Any, *, declare: bool = False) -> None:
        """Stands for a release that drains differently: same signature, another body."""

    monkeypatch.setattr(faust.streams.Stream, "_enable_passive", enable_passive)
    revised = revised_internals()
    assert len(revised) == 1 and revised[0].startswith("faust.streams.Stream._enable_passive: source "), revised
    assert broken_internals() == []  # the signature still fits: only the review is due


# -- one door -----------------------------------------------------------------------------------


def test_no_product_module_outside_the_adapter_touches_a_private_faust_name():
    found = []
    for path in product_files():
        if path != ADAPTER:
            found += [f"{path.relative_to(ROOT)}:{line}: {what}" for line, _, what in
                      scan(path.read_text(encoding="utf-8"))]
    assert not found, "only kvbus/streams/faust_adapter.py may touch Faust's privates:\n" + "\n".join(found)


def test_the_adapter_declares_every_private_faust_name_it_touches():
    touched = {name for _, name, _ in scan(ADAPTER.read_text(encoding="utf-8"))}
    declared = {i.where.rpartition(".")[2].rpartition(":")[2] for i in INTERNALS if i.private}
    assert touched, "the scan found nothing in the adapter: it no longer sees Faust privates"
    assert touched <= declared, f"touched but not in INTERNALS: {sorted(touched - declared)}"


SNIPPET = '''
import faust.streams
from faust.streams import _current_event
from faust.transport.drivers import aiokafka as faust_aiokafka


class Fast(faust_aiokafka.Consumer):
    async def _drain_messages(self, fetcher):
        self._n_acked = 0
        fetcher._stopped.is_set()
        self._mine = 1
        await self._deliver()


class Faster(Fast):
    def _add_gap(self):
        super()._read_offset.clear()


class Plain:
    def __init__(self):
        self._stopped = False

    def f(self, runtime):
        runtime._producer.flush()
        faust.streams._current_event.get()
        return getattr(runtime.app.consumer, "_read_offset"), getattr(runtime, "_producer")
'''


def test_the_scan_flags_faust_privates_and_not_kvbus_own():
    # the premises: Faust and kvbus both define _producer and _stopped is Faust's alone
    assert "_producer" in third_party_privates() and "_producer" in kvbus_privates()
    assert "_stopped" in third_party_privates() and "_stopped" not in kvbus_privates()
    found = [(line, name) for line, name, _ in scan(SNIPPET)]
    assert found == [
        (3, "_current_event"),  # a private imported
        (8, "_drain_messages"),  # a Faust private overridden
        (9, "_n_acked"),  # a Faust private of the base, through self
        (10, "_stopped"),  # a Faust private of another object (no kvbus class defines _stopped)
        (16, "_add_gap"),  # overridden through a kvbus base class
        (17, "_read_offset"),  # through super()
        (26, "_current_event"),  # an attribute of an imported Faust module
        (27, "_read_offset"),  # by name
    ]
    # not flagged: Fast's own self._mine and self._deliver, Plain's self._stopped (a kvbus class),
    # runtime._producer (kvbus.streams.runtime's own, though Faust has a _producer too)


# -- the batch wait's arrival rate --------------------------------------------------------------


def test_arrival_rate_counts_recent_records_and_forgets_old_ones():
    rate = faust_adapter.ArrivalRate(tau=0.2)
    assert rate.per_second(10.0) == 0.0  # nothing counted yet: a new worker does not wait
    for i in range(100):  # 1,000 records/s for 1 s, in batches of 10 every 10 ms
        rate.add(10, 10.0 + i * 0.01)
    assert 900 <= rate.per_second(11.0) <= 1100
    assert rate.per_second(11.0 + 2.0) < 1.0  # two idle seconds later it is all but forgotten
    rate.add(1, 20.0)  # one record after a long pause: a quiet stream
    assert rate.per_second(20.0) == pytest.approx(5.0, rel=0.01)


def test_resuming_a_running_flow_keeps_the_queued_records():
    """The end of a table recovery resumes a flow already running: the records queued since the raw
    partitions were sought stay (mode's resume would empty the queue); resuming a suspended flow
    still empties it, as after a revocation."""
    async def run() -> tuple[list[str], list[str]]:
        flow = faust_adapter.FlowControl(initially_suspended=False)
        queue = FlowControlQueue(maxsize=10, flow_control=flow, clear_on_resume=True)
        queue.put_nowait("fetched after the seek")
        flow.resume()  # running: Recovery.on_recovery_completed's resume
        kept = [queue.get_nowait() for _ in range(queue.qsize())]
        queue.put_nowait("of the old generation")
        flow.suspend()
        flow.resume()
        return kept, [queue.get_nowait() for _ in range(queue.qsize())]
    kept, after_suspension = asyncio.run(run())
    assert kept == ["fetched after the seek"]
    assert after_suspension == []


def test_the_worker_apps_stream_queues_are_kept_when_its_running_flow_resumes():
    """The worker's app (``create_app``) has :class:`FlowControl`: a record queued for an agent stays
    when the running flow is resumed again."""
    from kvbus.runtime.settings import Settings
    from kvbus.streams.app import create_app
    from kvbus.streams.options import StreamsOptions

    async def run() -> list[str]:
        app = create_app(Settings(), StreamsOptions.from_env({}))
        queue = app.topic("kvbus-flow").queue
        app.flow_control.resume()  # the flow starts suspended; the first resume empties the queues
        queue.put_nowait("fetched after the seek")
        app.flow_control.resume()
        return [queue.get_nowait() for _ in range(queue.qsize())]
    assert asyncio.run(run()) == ["fetched after the seek"]


def test_fetches_wait_for_more_only_while_the_worker_is_busy(monkeypatch):
    """FetchPacing: a busy worker's fetches wait a few ms at the broker for more; light or idle, they
    return with the first record; the rate is measured over PACING_EVERY s, with hysteresis."""
    from types import SimpleNamespace

    from kvbus.runtime import load_rate

    clock = [100.0]
    monkeypatch.setattr(load_rate.time, "monotonic", lambda: clock[0])  # FetchPacing's clock (BusyRate's)
    fetcher = SimpleNamespace(_fetch_min_bytes=1, _fetch_max_wait_ms=faust_adapter.FETCH_MAX_WAIT_MS)
    consumer = SimpleNamespace(_fetcher=fetcher)
    pacing = faust_adapter.FetchPacing()
    busy = (faust_adapter.BUSY_FETCH_MIN_BYTES, faust_adapter.BUSY_FETCH_WAIT_MS)
    idle = (1, faust_adapter.FETCH_MAX_WAIT_MS)
    every, rate = faust_adapter.PACING_EVERY, faust_adapter.BUSY_RECORDS_PER_S

    def after(records_per_s: float) -> tuple[int, int]:
        clock[0] += every
        pacing.count(int(records_per_s * every), consumer)
        return fetcher._fetch_min_bytes, fetcher._fetch_max_wait_ms

    assert after(rate * 0.9) == idle
    assert after(rate * 1.1) == busy and pacing.busy
    assert after(rate * 0.6) == busy  # hysteresis: idle again below half the rate
    assert after(rate * 0.4) == idle and not pacing.busy
    assert after(rate * 2) == busy
    assert after(0) == idle  # the sweep's count(0): an idle worker adds no wait
    clock[0] += every / 10
    pacing.count(10_000, consumer)  # within PACING_EVERY: not measured yet
    assert (fetcher._fetch_min_bytes, fetcher._fetch_max_wait_ms) == idle
    assert faust_adapter.FetchPacing().count(10_000, SimpleNamespace(_fetcher=None)) is None  # not started yet
