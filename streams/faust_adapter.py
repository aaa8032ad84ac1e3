"""The one module of kvbus that touches Faust's (faust-streaming's) private internals.

The rest of the streams stage uses Faust's public API, and calls this module for what the
public API does not offer:

* :class:`Transport` (broker scheme :data:`SCHEME`, ``kvbus://host:port;host2:port2``): Faust's
  aiokafka transport whose :class:`Consumer` hands the records of one fetch to the conductor in one
  task instead of one ``wait_first`` per record (below);
* its :class:`Producer`, whose flush before an offset commit waits for the changelog records
  buffered when it began, not for a buffer that steady table writes never empty (below);
* :class:`ChangelogPartition`: table writes made inside ``with ChangelogPartition(topic, partition):``
  go to that changelog partition, outside of an agent's iteration;
* :func:`take_batches`: ``Stream.take_events`` with a wait that follows the load (no timer while
  idle, no wait when few records are expected, up to ``within`` when many are);
* :func:`hold` / :func:`release`: keep a raw record uncommittable after the ack at the end of each
  batch, until kvbus has delivered its outputs and written its state;
* :func:`rewind`: seek partitions on the consumer's own thread; :func:`forget_gaps`: forget the gaps
  Faust noted in a partition's offsets;
* :class:`TableManager`: Faust's table manager without the second it sleeps at start before it
  registers the tables (below);
* :class:`App`: Faust's app whose flow control empties the stream queues only when flow resumes
  after a suspension, not when it is resumed again while running (below);
* :func:`look_up_offsets_with`: the offsets table recovery asks for (changelog high watermarks and
  earliest offsets), looked up through a client of the runtime's own instead of the fetching one;
  and fetches that wait at most :data:`FETCH_MAX_WAIT_MS` for records (below).

:data:`INTERNALS` lists every private name (and every behaviour of a public one) this relies on, with
its kind, its parameters and a fingerprint of the source reviewed. :func:`broken_internals` and
:func:`revised_internals` compare them with the installed faust-streaming and mode-streaming: the
worker refuses to start when a name is missing or has another kind or signature, and logs a warning
when a reviewed source changed (``tests/test_faust_adapter.py`` fails on both). aiokafka is reached
through Faust's driver (its ``seek_wait`` is reviewed here), except for one attribute of the consumer
the driver builds, the fetch wait, set before the consumer starts (declared in :data:`INTERNALS` too).

The fast hand-over. Faust's ``Consumer._drain_messages`` hands every fetched record to the conductor
through ``Service.wait_first(callback(message), suspend_flow.wait())``: four tasks and an
``asyncio.wait`` per record, so that a callback blocked on a full stream buffer is cancelled when a
rebalance suspends the flow. Profiled (py-spy, a Faust agent that only acks), that is ~40% of the
event loop's time per raw record. :class:`Consumer` keeps the same loop and the same semantics but
waits that way once per *fetch*: the records of one ``getmany`` are delivered by one coroutine, which
``wait_first`` cancels wherever it is blocked when the flow is suspended, the worker stops or crashes
(the records not yet delivered are dropped, as Faust drops them per record; after the rebalance the
consumer seeks back to committed offsets: :meth:`kvbus.streams.runtime.Runtime.rebuild`). The fetch
itself (the first record of ``getmany``) is awaited outside that wait, as in Faust: it runs on the
consumer's thread, which a cancel does not reach, so a fetch cancelled on the event loop still takes
its records out of aiokafka and nobody receives them. Such a fetch reads the *current* active
partitions, and a rebalance changes them while it waits (aiokafka holds it until the new assignment
is in place): it then took the records of the changelog partitions that recovery had just sought to,
or of raw partitions just rewound, and recovery waited for ever for a record already consumed, or a
survivor skipped part of the partitions it took over. Faust offers no hook for this, hence the
subclass of a private method. Everything else (fetching thread, rebalancing, commits, producer,
tables) is Faust's ``faust.transport.drivers.aiokafka``.

The start without a pause. Faust's ``TableManager.on_start`` sleeps one second before it registers
the tables (so that tables declared while the app starts are registered too), and the consumer joins
its group only once they are. kvbus declares its one table before the app starts, so the pause only
delayed every worker's join: a restarted worker's partitions waited a second longer (part of the
freshness of one of two workers killed and restarted, docs/benchmarks.md). :class:`TableManager`
registers them at once.

The queues kept at the end of recovery. At a rebalance Faust suspends the flow into the agents'
queues and empties them; table recovery resumes the flow while it reads the changelogs, and once
it is done it resumes the raw partitions, seeks them to their committed offsets and resumes the flow
*again* (``Recovery.on_recovery_completed``). mode's ``FlowControlEvent.resume`` empties every queue
each time it is called. Records fetched between the seek of a partition and that second resume were
in the queue and were thrown away: never processed nor acknowledged, while the consumer's position
had moved past them. A partition whose input went on was read again from the gap (the runtime's
offset guard sees the next record jump ahead and rewinds); one whose input had ended, as in a test
that killed one of two workers after the last record, stayed stalled, its records lost for as long as
none came. :class:`FlowControl` empties the queues only when it resumes a suspended flow; records of
an earlier generation are still emptied, by the revocation that suspends the flow and by that first
resume.

The offsets beside the fetch. At each rebalance Faust's table recovery asks the consumer for the
changelog partitions' high watermarks, then for their earliest offsets (``Consumer.highwaters``,
``Consumer.earliest_offsets``). Faust's driver sends both through aiokafka on the connection its
fetches use, and a broker answers one connection's requests in order: each lookup waited behind a
fetch that waits up to 1.5 s for records (the driver's ``fetch_max_wait_ms``), 0.9 s and 1.5 s of
a surviving worker's takeover (docs/benchmarks.md, "One of two workers, where the time goes").
:class:`Consumer` answers both with the lookup :func:`look_up_offsets_with` gave it (the runtime's
confluent-kafka consumer, connections of its own), on an executor thread; without one, or when it
fails, Faust's own lookup answers. Two more waits held the raw partitions' records back after each
recovery, each begun while recovery had the raw partitions paused and each asking only for the
changelog partitions: the take of fetched records (1 s in Faust's loop; :data:`GETMANY_TIMEOUT`; and
with no partition active at all, Faust's ``Consumer._wait_next_records`` sleeps 1 s: overridden by a
copy that sleeps :data:`GETMANY_TIMEOUT`), and
aiokafka's fetch, one in flight per broker, waiting at the broker up to the driver's 1.5 s for
changelog records that do not come (1.5 s before a restarted worker's first record in its logs).
The worker's fetches wait at most :data:`FETCH_MAX_WAIT_MS` (:class:`ConsumerThread`); a fetch
still returns as soon as one record is there, so under load nothing changes.

The bounded flush. Faust flushes its producer before every offset commit (``Consumer._commit_offsets``)
and before a recovery (``Recovery._restart_recovery``), and ``ProducerBuffer.flush`` returns only
once the buffer is empty (or nothing was sent for 0.1 s). Table writes are put in that buffer: the
runtime writes each batch's state when its outputs are delivered, so under steady load the buffer
is refilled faster than one flush empties it, and a commit waited as long as the load lasted. Seen:
a commit timer running 40 s, and a worker SIGKILLed after 40 s of work that had never committed,
so the survivor replayed its partitions from offset 0 and the partial aggregates it restored
outlived their window before the replay reached their other halves. :class:`ProducerBuffer` waits
for the messages buffered when the flush began (what the offsets being committed depend on: their
records were acked after their table writes were buffered), then Faust's driver flushes aiokafka's
own batches as before.
"""
from __future__ import annotations

import asyncio
import hashlib
import importlib
import importlib.metadata
import inspect
import logging
import math
import weakref
from contextvars import ContextVar, Token
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable, Iterable, Literal, Mapping, Optional, Sequence

import faust
from aiokafka.errors import IllegalStateError
from faust.streams import _current_event
from faust.tables import TableManager as FaustTableManager
from faust.transport import drivers
from faust.transport.consumer import CONSUMER_FETCHING
from faust.transport.drivers import aiokafka as faust_aiokafka
from faust.transport.producer import ProducerBuffer as FaustProducerBuffer
from faust.types import TP, EventT, Message
from mode.services import ServiceTask
from mode.utils.locks import Event
from mode.utils.objects import cached_property
from mode.utils.queues import FlowControlEvent

from kvbus.runtime.load_rate import BusyRate

log = logging.getLogger("kvbus.streams")

SCHEME = "kvbus"
"""Broker URL scheme of :class:`Transport` (``kvbus://host:port;host2:port2``)."""

GETMANY_TIMEOUT = 0.1
"""Seconds one take of fetched records waits for records before it returns empty (Faust's loop: 1 s).
A take asks for the partitions active when it starts: one begun during table recovery asks only for
changelog partitions (the raw ones paused), and the raw partitions resumed after recovery waited for
it to run out, 1.0 s of every rebalance in a worker's logs. Idle, the shorter wait costs ten round
trips to the consumer thread a second; under load a take returns with the first records anyway."""

YIELD_EVERY = 100
"""Records delivered between two ``sleep(0)`` (as Faust does), so other tasks keep running."""

Kind = Literal["context variable", "function", "coroutine function", "async generator function", "service task",
               "instance attribute"]
"""What an internal is: a ``ContextVar``; a plain function or method; an ``async def``; an ``async def``
that yields; a mode ``Service.task`` (a ``ServiceTask`` wrapping an ``async def``); an attribute every
instance of the owner class has after ``__init__``."""


@dataclass(frozen=True)
class Internal:
    """One name of faust-streaming (or mode-streaming) kvbus relies on beyond Faust's documented API."""

    where: str
    """``module:qualified.name``, e.g. ``faust.transport.consumer:Consumer._add_gap``."""
    kind: Kind
    params: Optional[tuple[str, ...]] = None
    """Parameter names of a callable in order (``self`` included); None: not checked."""
    types: tuple[type, ...] = ()
    """Instance attributes: the types the value may have."""
    reviewed: Optional[str] = None
    """First 16 hex digits of the SHA-256 of the source kvbus was written against (``inspect.getsource``);
    None for names whose use depends only on their kind and signature."""
    why: str = ""
    """What kvbus does with it."""

    @property
    def private(self) -> bool:
        """Whether a component of the name starts with an underscore (not Faust's public API)."""
        return any(part.startswith("_") for part in self.where.replace(":", ".").split("."))


INTERNALS: tuple[Internal, ...] = (
    Internal("faust.streams:_current_event", "context variable",
             why="ChangelogPartition sets it to a stand-in event naming the changelog partition"),
    Internal("faust.streams:current_event", "function", (), reviewed="3b821f1a78d86a58",
             why="reads _current_event as a weak reference to the event"),
    Internal("faust.tables.base:Collection.partition_for_key", "function", ("self", "key"),
             reviewed="3b2291811b8dd791",
             why="a table write's changelog partition is current_event().message.partition; only "
                 ".message.topic and .message.partition of the stand-in are read"),
    Internal("faust.transport.consumer:Consumer._drain_messages", "coroutine function", ("self", "fetcher"),
             reviewed="44a2500309e83c63",
             why="overridden by Consumer._drain_messages, a copy of its loop with one wait_first per fetch"),
    Internal("faust.transport.consumer:Fetcher._fetcher", "service task", ("self",), reviewed="68f894f0b577d810",
             why="the caller of consumer._drain_messages(fetcher): the override is only used if it calls it"),
    Internal("faust.transport.consumer:Consumer._add_gap", "coroutine function", ("self", "tp", "offset_from",
                                                                                  "offset_to"),
             why="the copied loop records gaps in offsets of acking topics"),
    Internal("faust.transport.consumer:Consumer._read_offset", "instance attribute", types=(Mapping,),
             why="the copied loop skips records already read and notes the offset read, per TP"),
    Internal("faust.transport.consumer:Consumer._n_acked", "instance attribute", types=(int,),
             why="the copied loop commits every broker_commit_every acks"),
    Internal("faust.transport.consumer:Consumer._commit_every", "instance attribute", types=(int, type(None)),
             why="the copied loop's broker_commit_every"),
    Internal("mode.services:Service._stopped", "instance attribute", types=(Event,),
             why="the copied loop stops when the consumer's or the fetcher's stopped event is set (is_set)"),
    Internal("faust.types.tuples:Message.incref", "function", ("self", "n"),
             why="hold: one more reference, so the ack at the end of take_batches is not the final one"),
    Internal("faust.types.tuples:Message.ack", "function", ("self", "consumer", "n"), reviewed="4751b72c4ed84153",
             why="the final ack (reference count 0) is the one that makes the offset committable"),
    Internal("faust.streams:Stream._enable_passive", "function", ("self", "channel", "declare"),
             reviewed="64da8ce9f729e30e",
             why="take_batches: drains the stream in the background, so its processor fills the batch buffer "
                 "(what Stream.take_events does)"),
    Internal("faust.transport.consumer:Consumer._commit_offsets", "coroutine function",
             ("self", "offsets", "start_new_transaction"), reviewed="1a69799041188441",
             why="flushes the producer (app.producer.flush) before committing offsets: the flush Producer bounds"),
    Internal("faust.transport.drivers.aiokafka:Producer.flush", "coroutine function", ("self",),
             reviewed="36d0cb3615f65b01",
             why="flushes self.buffer (ProducerBuffer.flush, overridden) and then aiokafka's producer"),
    Internal("faust.transport.producer:Producer.__init__", "function", ("self", "transport", "loop", "kwargs"),
             reviewed="5c53a4b47aa1372b",
             why="builds self.buffer (a ProducerBuffer, app set) after Service.__init__: Producer replaces it; "
                 "on_start makes the buffer a runtime dependency"),
    Internal("faust.transport.producer:ProducerBuffer.flush", "coroutine function", ("self",),
             reviewed="26fbebb124ad9c98", why="overridden: flush_atmost(None) waits until the buffer is empty"),
    Internal("faust.transport.producer:ProducerBuffer.flush_atmost", "coroutine function", ("self", "max_messages"),
             reviewed="4966e8c5f9b42eb9",
             why="waits for up to max_messages sends (one per message_sent event), returns when the buffer is "
                 "empty or nothing was sent for 0.1 s"),
    Internal("faust.transport.producer:ProducerBuffer.on_stop", "coroutine function", ("self",),
             reviewed="caffce6cde883392",
             why="calls self.flush() (the bounded one): at stop nothing is buffered any more"),
    Internal("faust.transport.drivers.aiokafka:AIOKafkaConsumerThread.seek_wait", "coroutine function",
             ("self", "partitions"), reviewed="12e8d34e554e9024",
             why="rewind: seeks run on the consumer thread (calling aiokafka's seek from the event loop's "
                 "thread races the fetcher and kills the consumer thread)"),
    Internal("faust.transport.consumer:Consumer._gap", "instance attribute", types=(Mapping,),
             why="forget_gaps: pops a partition's gaps (offsets taken for absent, so that commits pass them)"),
    Internal("faust.tables.recovery:Recovery._build_highwaters", "coroutine function",
             ("self", "consumer", "tps", "destination", "title"), reviewed="91b4cc0d3724ae7b",
             why="recovery's high watermarks come from consumer.highwaters(*tps): Consumer.highwaters answers"),
    Internal("faust.tables.recovery:Recovery._build_offsets", "coroutine function",
             ("self", "consumer", "tps", "destination", "title"), reviewed="27eec86be06cb51f",
             why="recovery's earliest offsets come from consumer.earliest_offsets(*tps): "
                 "Consumer.earliest_offsets answers"),
    Internal("faust.transport.consumer:Consumer._wait_next_records", "coroutine function", ("self", "timeout"),
             reviewed="6218e1969a636b3f",
             why="overridden by Consumer._wait_next_records, a copy that sleeps GETMANY_TIMEOUT instead of 1 s "
                 "when no partition is active"),
    Internal("faust.transport.consumer:Consumer._getmany", "coroutine function",
             ("self", "active_partitions", "timeout"),
             why="the copied _wait_next_records fetches the active partitions' records with it"),
    Internal("faust.transport.consumer:Consumer._get_active_partitions", "function", ("self",),
             why="the copied _wait_next_records: the partitions neither paused nor being recovered"),
    Internal("faust.transport.consumer:Consumer.can_resume_flow", "instance attribute", types=(asyncio.Event,),
             why="the copied _wait_next_records waits for it while the flow is suspended"),
    Internal("faust.transport.consumer:Consumer.not_waiting_next_records", "instance attribute",
             types=(asyncio.Event,), why="the copied _wait_next_records sets it, as Faust's does"),
    Internal("faust.transport.drivers.aiokafka:Consumer._new_consumer_thread", "function", ("self",),
             reviewed="0870ec53dea75083",
             why="overridden by Consumer._new_consumer_thread: builds a ConsumerThread (the driver's, with "
                 "its fetch wait)"),
    Internal("faust.transport.drivers.aiokafka:AIOKafkaConsumerThread._create_worker_consumer", "function",
             ("self", "transport"), reviewed="c2701bfc3e6f6cad",
             why="builds the worker's aiokafka consumer with fetch_max_wait_ms=1500; ConsumerThread sets "
                 "the consumer's wait after it"),
    Internal("aiokafka.consumer.consumer:AIOKafkaConsumer._fetch_max_wait_ms", "instance attribute", types=(int,),
             why="ConsumerThread sets it before the consumer starts: start() builds the fetcher with it"),
    Internal("aiokafka.consumer.consumer:AIOKafkaConsumer._fetcher", "instance attribute",
             why="FetchPacing sets the running fetcher's fetch_min_bytes and fetch_max_wait_ms (None before start)"),
    Internal("aiokafka.consumer.consumer:AIOKafkaConsumer._fetch_min_bytes", "instance attribute", types=(int,),
             why="what start() hands the fetcher as its fetch_min_bytes; FetchPacing sets the fetcher's own"),
    Internal("aiokafka.consumer.fetcher:Fetcher.__init__", "function", reviewed="bf21ecb7e0f210b7",
             why="keeps fetch_min_bytes and fetch_max_wait_ms as self._fetch_min_bytes, self._fetch_max_wait_ms, "
                 "which FetchPacing sets on the running fetcher"),
    Internal("aiokafka.consumer.fetcher:Fetcher._get_actions_per_node", "function", ("self", "assignment"),
             reviewed="1dab2cf937d165d0",
             why="builds every fetch request from self._fetch_max_wait_ms and self._fetch_min_bytes as they are then"),
    Internal("aiokafka.consumer.consumer:AIOKafkaConsumer.start", "coroutine function", ("self",),
             reviewed="2f1ba70443327538",
             why="builds the Fetcher with fetch_max_wait_ms=self._fetch_max_wait_ms"),
    Internal("mode.utils.queues:FlowControlEvent.resume", "function", ("self",), reviewed="4dcdc1253fd0dcb4",
             why="empties every managed queue on each call: FlowControl.resume calls it only on a suspended flow"),
    Internal("faust.tables.recovery:Recovery.on_recovery_completed", "coroutine function",
             ("self", "generation_id"), reviewed="6ef567acf072e46d",
             why="resumes the raw partitions, seeks them, then resumes the already running flow (FlowControl)"),
    Internal("faust.tables.manager:TableManager.on_start", "coroutine function", ("self",),
             reviewed="365dd25fbc0e0684",
             why="overridden by TableManager.on_start: the same steps without the one-second sleep first"),
    Internal("faust.tables.manager:TableManager._update_channels", "coroutine function", ("self",),
             why="registers the tables' changelog channels (then Faust sets _tables_registered)"),
)
"""Every Faust internal this module relies on (tests/test_faust_adapter.py checks the list is complete)."""


# -- the fast hand-over ----------------------------------------------------------------------------


class Consumer(faust_aiokafka.Consumer):
    """Faust's aiokafka consumer; records of one fetch go to the conductor in one task.

    Built by Faust at worker start; it refuses to be built when :func:`broken_internals` finds a
    change (raises :class:`FaustInternalsChanged`) and logs :func:`revised_internals`.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        broken = broken_internals(self)
        if broken:
            raise FaustInternalsChanged(broken)
        for change in revised_internals():
            log.warning("Faust internal changed since kvbus reviewed it: %s", change)

    async def _drain_messages(self, fetcher: Any) -> None:  # pragma: no cover - runs in the worker
        consumer_should_stop = self._stopped.is_set
        fetcher_should_stop = fetcher._stopped.is_set
        try:
            while not (consumer_should_stop() or fetcher_should_stop()):
                self.diag.set_flag(CONSUMER_FETCHING)
                records = self.getmany(timeout=GETMANY_TIMEOUT)
                await self.sleep(0)  # getmany may return at once again and again (as Faust does)
                if not self.should_stop:
                    # the fetch: never cancelled by a suspended flow (module doc, "The fast hand-over")
                    first = await anext(records, None)
                    if first is not None:
                        await self.wait_first(self._deliver(first, records), self.suspend_flow.wait())
                self.diag.unset_flag(CONSUMER_FETCHING)
        except self.consumer_stopped_errors:
            if self.transport.app.should_stop:
                self.log.info("Broker stopped consumer, shutting down...")
                return
            raise
        except asyncio.CancelledError:
            if self.transport.app.should_stop:
                self.log.info("Consumer shutting down for user cancel.")
                return
            raise
        except Exception as exc:
            self.log.exception("Drain messages raised: %r", exc)
            raise
        finally:
            self.diag.unset_flag(CONSUMER_FETCHING)

    async def _wait_next_records(self, timeout: float) -> tuple[Optional[Mapping[TP, Any]], Optional[set[TP]]]:
        """Faust's ``Consumer._wait_next_records`` with :data:`GETMANY_TIMEOUT` as the sleep while no
        partition is active, instead of 1 s (module doc, "The offsets beside the fetch"): a worker whose
        partitions were all paused for recovery slept on for up to a second after they resumed."""
        if not self.flow_active:
            await self.wait(self.can_resume_flow)
        try:
            self.not_waiting_next_records.set()
            active_partitions: Optional[set[TP]] = None if self.app.client_only else self._get_active_partitions()
            records: Mapping[TP, Any] = {}
            if active_partitions is None or active_partitions:
                records = await self._getmany(active_partitions=active_partitions, timeout=timeout)
            else:
                await self.sleep(GETMANY_TIMEOUT)  # Faust: 1 s
            return records, active_partitions
        finally:
            self.not_waiting_next_records.set()

    def _new_consumer_thread(self) -> "ConsumerThread":
        self.fetching_thread = ConsumerThread(self, loop=self.loop, beacon=self.beacon)
        return self.fetching_thread

    fetching_thread: Optional["ConsumerThread"] = None
    """The thread whose aiokafka consumer fetches the records (:meth:`_new_consumer_thread`)."""

    def pace_fetches(self, records: int) -> None:
        """Note ``records`` raw records taken (0: none since the last call), for fetches that follow the
        load (:class:`FetchPacing`)."""
        if self.fetching_thread is not None:
            self.fetching_thread.pace_fetches(records)

    offset_lookup: Optional["OffsetLookup"] = None
    """Where :meth:`highwaters` and :meth:`earliest_offsets` look offsets up (:func:`look_up_offsets_with`);
    None: through Faust's fetching consumer."""

    async def highwaters(self, *partitions: TP) -> Mapping[TP, int]:
        """Each partition's high watermark (module doc, "The offsets beside the fetch")."""
        marks = await self._offsets(partitions)
        if marks is None:
            return await super().highwaters(*partitions)
        return {tp: high for tp, (_low, high) in marks.items()}

    async def earliest_offsets(self, *partitions: TP) -> Mapping[TP, int]:
        """Each partition's earliest offset (module doc, "The offsets beside the fetch")."""
        marks = await self._offsets(partitions)
        if marks is None:
            return await super().earliest_offsets(*partitions)
        return {tp: low for tp, (low, _high) in marks.items()}

    async def _offsets(self, partitions: Sequence[TP]) -> Optional[Mapping[TP, tuple[int, int]]]:
        """(earliest offset, high watermark) of each partition from :attr:`offset_lookup`; None
        without a lookup or when it failed (logged: Faust's own lookup answers instead)."""
        lookup = self.offset_lookup
        if lookup is None or not partitions:
            return None
        try:
            return await asyncio.get_running_loop().run_in_executor(None, lookup, list(partitions))
        except Exception as exc:  # noqa: BLE001 - Faust's lookup is the fallback
            log.warning("looking up offsets of %s beside the fetch failed, asking Faust's consumer: %s",
                        sorted(partitions), exc)
            return None

    async def _deliver(self, first: tuple[TP, Message], rest: AsyncIterator[tuple[TP, Message]]) -> None:
        """Hand one fetch's records (``first``, then the ``rest`` of ``getmany``) to the conductor in
        order; per record exactly what Faust's loop does (skip offsets already read, note gaps of
        acking topics, commit every N acks)."""
        callback: Callable[[Message], Awaitable[Any]] = self.callback
        get_read_offset = self._read_offset.__getitem__
        set_read_offset = self._read_offset.__setitem__
        acks_enabled_for = self.app.topics.acks_enabled_for
        commit_every: Optional[int] = self._commit_every
        since_yield = 0
        item: Optional[tuple[TP, Message]] = first
        while item is not None:
            tp, message = item
            since_yield += 1
            if since_yield > YIELD_EVERY:
                await asyncio.sleep(0)
                since_yield = 0
            offset = message.offset
            r_offset = get_read_offset(tp)
            if r_offset is None or offset >= r_offset:  # else already read (Faust: "DROPPED MESSAGE ROFF")
                if r_offset and offset - r_offset > 1 and acks_enabled_for(message.topic):
                    await self._add_gap(tp, r_offset + 1, offset)
                if commit_every is not None and self._n_acked >= commit_every:
                    self._n_acked = 0
                    await self.commit()
                await callback(message)
                set_read_offset(tp, offset)
            item = await anext(rest, None)


# -- the bounded flush ------------------------------------------------------------------------------


class ProducerBuffer(FaustProducerBuffer):
    """Faust's producer buffer whose :meth:`flush` waits for the messages buffered when it was called
    (module doc, "The bounded flush"), however many are buffered meanwhile."""

    async def flush(self) -> None:
        """Wait until the messages buffered now are sent: Faust's ``flush_atmost`` waits for one send
        per message counted (it misses sends made while it is not waiting, so it waits for a few more,
        a bounded number), counting one more for the message the sending task may have taken from the
        buffer and not sent yet; it also returns once the buffer is empty or nothing was sent for 0.1 s."""
        await self.flush_atmost(self.size + 1)


class Producer(faust_aiokafka.Producer):
    """Faust's aiokafka producer (the changelog's) with :class:`ProducerBuffer` as its buffer."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        stock = self.buffer  # built by Faust's __init__ and not started yet (on_start starts self.buffer)
        buffer = ProducerBuffer(loop=self.loop, beacon=self.beacon)
        buffer.app = stock.app
        if hasattr(stock, "threaded_producer"):  # producer_threaded: the driver's thread producer
            buffer.threaded_producer = stock.threaded_producer
        self.buffer = buffer


FETCH_MAX_WAIT_MS = 200
"""Milliseconds a worker's fetch may wait at a broker for records before it returns empty (module
doc, "The offsets beside the fetch"; Faust's driver sets 1,500, Kafka's consumers 500). Idle, a
worker then sends about five fetches a second to each broker."""


BUSY_RECORDS_PER_S = 500.0
"""Raw records a second (over the last :data:`PACING_EVERY` s) from which a worker counts as busy
(:class:`FetchPacing`); it counts as idle again below half of it. The pipeline benchmark's 8 replicas
send ~260 raw records/s at 2,000 events/s (a wait there cost 2-3 ms of freshness) and ~700 at 15,000."""
BUSY_FETCH_WAIT_MS = 20
"""Milliseconds a busy worker's fetch waits at the broker for :data:`BUSY_FETCH_MIN_BYTES`. Measured
side by side with 5 (docs/performance.md, "Tuning values"): 0.8-0.85x the CPU of all kvbus processes per
event at 15,000-20,000 events/s, ~15 ms more freshness p50 and p99 still under 100 ms at 20,000. The
worker's own batch wait (``KVBUS_STREAMS_BATCH_WITHIN``) stays: without it a batch is the few records
the stream handed over before the agent ran, and TP=2 at 25,000 events/s was not sustained."""
BUSY_FETCH_MIN_BYTES = 1 << 20
"""Bytes a busy worker's fetch waits for (:data:`BUSY_FETCH_WAIT_MS` ends the wait first at the rates
measured: the fetch then carries what arrived in that time)."""
PACING_EVERY = 0.5
"""Seconds over which :class:`FetchPacing` measures the rate of raw records."""


class FetchPacing:
    """Fetch sizes and waits that follow the load. Idle or light, a worker's fetch returns as soon as one
    record is there (``fetch_min_bytes`` 1, waiting up to :data:`FETCH_MAX_WAIT_MS` for it): no added
    wait. Busy (:data:`BUSY_RECORDS_PER_S`), a fetch waits at the broker up to :data:`BUSY_FETCH_WAIT_MS`
    for more: fewer, larger fetches carry the load, which cuts the worker's fetch requests, their
    responses and the hand-overs between its fetching thread and its event loop (docs/performance.md,
    "Cost per event"). Set on the running aiokafka fetcher, read by the next fetch request it builds."""

    def __init__(self) -> None:
        self.load = BusyRate(BUSY_RECORDS_PER_S, PACING_EVERY)
        """The rate of raw records over the last :data:`PACING_EVERY` s, and whether fetches wait for more now."""

    @property
    def busy(self) -> bool:
        """Whether fetches wait for more now."""
        return self.load.is_busy

    def count(self, records: int, consumer: Any) -> None:
        """Note ``records`` raw records taken (0 from a timer, so that an idle worker is seen idle) and pace
        the fetches of ``consumer`` (the worker's aiokafka consumer; its fetcher exists once it started)."""
        span = self.load.count(records)
        fetcher = getattr(consumer, "_fetcher", None)
        if span is None or span[1] == self.load.is_busy or fetcher is None:
            return
        rate, busy = span
        broken = broken_internals(fetcher)
        if broken:
            raise FaustInternalsChanged(broken)
        fetcher._fetch_min_bytes = BUSY_FETCH_MIN_BYTES if busy else 1
        fetcher._fetch_max_wait_ms = BUSY_FETCH_WAIT_MS if busy else FETCH_MAX_WAIT_MS
        self.load.is_busy = busy
        log.info("%.0f raw records/s: fetches %s", rate, f"wait up to {BUSY_FETCH_WAIT_MS} ms for more" if busy
                 else "return with the first record")


class ConsumerThread(faust_aiokafka.AIOKafkaConsumerThread):
    """Faust's aiokafka consumer thread whose worker consumer's fetches wait at most :data:`FETCH_MAX_WAIT_MS`,
    and as :class:`FetchPacing` says."""

    worker_consumer: Any = None
    """The aiokafka consumer this thread built last (rebuilt by Faust after some errors)."""
    pacing: Optional[FetchPacing] = None

    def _create_worker_consumer(self, transport: Any) -> Any:
        consumer = super()._create_worker_consumer(transport)
        broken = broken_internals(consumer)
        if broken:
            raise FaustInternalsChanged(broken)
        consumer._fetch_max_wait_ms = FETCH_MAX_WAIT_MS
        self.worker_consumer = consumer
        self.pacing = FetchPacing()  # a new consumer's fetcher starts with the idle settings
        return consumer

    def pace_fetches(self, records: int) -> None:
        """:meth:`FetchPacing.count` for the worker's consumer."""
        if self.pacing is not None and self.worker_consumer is not None:
            self.pacing.count(records, self.worker_consumer)


OffsetLookup = Callable[[list[TP]], Mapping[TP, tuple[int, int]]]
"""Blocking: each partition's (earliest offset, high watermark), asked of Kafka now; raises on failure."""


def look_up_offsets_with(app: Any, lookup: OffsetLookup) -> None:
    """Make ``app``'s consumer (a :class:`Consumer`) answer recovery's offset questions with ``lookup``
    (module doc, "The offsets beside the fetch"); nothing for another transport's consumer."""
    consumer = app.consumer
    if isinstance(consumer, Consumer):
        consumer.offset_lookup = lookup


class Transport(faust_aiokafka.Transport):
    """Faust's aiokafka transport with :class:`Consumer` and :class:`Producer` (broker scheme :data:`SCHEME`)."""

    Consumer = Consumer
    Producer = Producer


drivers.TRANSPORTS.aliases.setdefault(SCHEME, f"{__name__}:Transport")


# -- the start without a pause ----------------------------------------------------------------------


class TableManager(FaustTableManager):
    """Faust's table manager (the app's ``TableManager`` setting) that registers the tables as soon as
    it starts (module doc, "The start without a pause")."""

    async def on_start(self) -> None:
        """Register the tables' changelogs and start recovery, as Faust does after its one-second sleep."""
        if not self.should_stop:
            await self._update_channels()
            await self.recovery.start()


# -- the queues kept at the end of recovery -----------------------------------------------------------


class FlowControl(FlowControlEvent):
    """The flow into the agents' queues (module doc, "The queues kept at the end of recovery"):
    resuming a suspended flow empties the queues, as in mode; resuming a running one does nothing."""

    def resume(self) -> None:
        """Resume a suspended flow and empty the queues; nothing while the flow runs."""
        if not self.is_active():
            super().resume()


class App(faust.App):
    """Faust's app with :class:`FlowControl` as its flow control."""

    @cached_property
    def flow_control(self) -> FlowControlEvent:
        """Flow control of the streams' queues."""
        return FlowControl(loop=self.loop)


# -- table writes under a chosen changelog partition -----------------------------------------------


class _Source:
    """The two fields of a Kafka message a table write reads: where it came from."""

    __slots__ = ("topic", "partition")

    def __init__(self, topic: str, partition: int):
        self.topic = topic
        self.partition = partition


class ChangelogPartition:
    """``with ChangelogPartition(topic, partition): table[key] = value`` writes to changelog partition
    ``partition``, as if a record of ``topic`` on that partition were being processed.

    Faust tables send each write to the partition of the event being processed (the "current
    event", a context variable set while an agent iterates). kvbus writes state after delivery,
    outside that iteration, per holder: each write goes under a stand-in event naming the holder's
    raw topic and partition (the same partition number, so co-partitioning holds). ``topic`` is the
    topic the table is co-partitioned with (Faust checks the partition counts agree once per topic).
    Reusable, not re-entrant; keep one per partition.
    """

    __slots__ = ("message", "_token", "__weakref__")

    def __init__(self, topic: str, partition: int):
        self.message = _Source(topic, partition)
        self._token: Optional[Token] = None

    def __enter__(self) -> "ChangelogPartition":
        self._token = _current_event.set(weakref.ref(self))
        return self

    def __exit__(self, *exc: Any) -> None:
        token, self._token = self._token, None
        if token is not None:
            _current_event.reset(token)


# -- batches whose wait follows the load -----------------------------------------------------------


class ArrivalRate:
    """Records per second arriving at a stream, as an exponentially decayed count: each batch adds
    its records, and the count decays by ``e`` every ``tau`` seconds (so ``count / tau`` is the rate
    over roughly the last ``tau`` seconds). Pure bookkeeping, no clock of its own."""

    __slots__ = ("tau", "count", "at")

    def __init__(self, tau: float = 0.2):
        self.tau = tau
        self.count = 0.0
        self.at: Optional[float] = None
        """Monotonic time of the last :meth:`add` (None before the first)."""

    def add(self, records: int, now: float) -> None:
        """``records`` arrived by ``now`` (monotonic seconds)."""
        if self.at is not None:
            self.count *= math.exp(-max(0.0, now - self.at) / self.tau)
        self.count += records
        self.at = now

    def per_second(self, now: float) -> float:
        """The rate at ``now``: what was counted, decayed to ``now``, over ``tau``."""
        if self.at is None:
            return 0.0
        return self.count * math.exp(-max(0.0, now - self.at) / self.tau) / self.tau


async def take_batches(stream: Any, max_: int, within: float, wait_from: int,
                       rate: Optional[ArrivalRate] = None) -> AsyncIterator[list[EventT]]:
    """Batches of at most ``max_`` events of ``stream``, each event acked once after the agent's body
    returns, as Faust's ``Stream.take_events`` yields them, with a wait that follows the load.

    ``take_events`` wakes every ``within`` seconds whether or not anything arrived, and always waits
    up to ``within`` after a record for more. Here an idle stream waits for its first record without
    a timer; then, when the records expected in ``within`` seconds (:class:`ArrivalRate` over the last
    fraction of a second) reach ``wait_from``, it waits up to ``within`` for the batch to fill, and
    otherwise it takes what has arrived with that record (the consumer hands over a fetch's records
    together). So a busy worker processes fewer, larger batches and a quiet one answers at once.

    Otherwise Faust's own code: records reach the buffer through a stream processor while the stream
    is drained in the background (``Stream._enable_passive``), a full buffer holds the processor back
    until the batch is consumed. When the generator ends its processor passes records through
    untouched (Faust removes its own from a private list; the stream ends with the agent anyway).
    """
    rate = rate if rate is not None else ArrivalRate()
    events: list[EventT] = []
    buffer_full = asyncio.Event()
    buffer_started = asyncio.Event()
    buffer_consumed = asyncio.Event()
    consuming: Optional[asyncio.Future] = None
    done = False
    clock = asyncio.get_running_loop().time

    async def add_to_buffer(value: Any) -> Any:
        nonlocal consuming
        if done:
            return value
        try:
            if consuming is not None:
                try:
                    await consuming
                finally:
                    consuming = None
            event = stream.current_event
            if event is None:
                raise RuntimeError("Take buffer found current_event is None")
            events.append(event)
            if len(events) == 1:
                buffer_started.set()
            if len(events) >= max_:
                buffer_full.set()
                buffer_consumed.clear()
                await stream.wait(buffer_consumed)
        except asyncio.CancelledError:  # pragma: no cover
            raise
        except Exception as exc:
            stream.log.exception("Error adding to take buffer: %r", exc)
            await stream.crash(exc)
        return value

    enable_acks = stream.enable_acks
    stream.enable_acks = False  # acked here, once the agent's body returned
    stream.add_processor(add_to_buffer)
    stream._enable_passive(stream.channel)
    try:
        while not stream.should_stop:
            if not events and await stream.wait_for_stopped(buffer_started):
                break
            if len(events) < max_ and rate.per_second(clock()) * within >= wait_from:
                await stream.wait_for_stopped(buffer_full, timeout=within)
            if not events:
                buffer_started.clear()
                continue
            rate.add(len(events), clock())
            consuming = asyncio.get_running_loop().create_future()
            try:
                yield list(events)
            finally:
                taken = list(events)
                events.clear()
                buffer_started.clear()
                for event in taken:
                    await stream.ack(event)
                if not consuming.done():
                    consuming.set_result(None)
                buffer_full.clear()
                buffer_consumed.set()
    finally:
        done = True
        stream.enable_acks = enable_acks


# -- acking after delivery --------------------------------------------------------------------------


def hold(events: Iterable[EventT]) -> None:
    """Take one reference on each event's message, so that the ack :func:`take_batches` makes when
    the agent's body returns is not the final one: the offset stays uncommittable until :func:`release`."""
    for event in events:
        event.message.incref()


def release(events: Iterable[EventT]) -> None:
    """Drop the reference :func:`hold` took; once Faust's own ack was made too, the offset may be committed."""
    for event in events:
        event.ack()


# -- seeking ----------------------------------------------------------------------------------------


class AssignmentChanged(RuntimeError):
    """A partition to seek was revoked before the seek: a newer rebalance is under way, and the
    recovery that follows it rebuilds the state for the new assignment."""


async def rewind(consumer: Any, offsets: Mapping[TP, int]) -> None:
    """Seek ``consumer`` (the app's) to ``offsets`` on its own thread and wait until done;
    :class:`AssignmentChanged` when one of the partitions is no longer assigned.

    Faust runs aiokafka in a thread of its own; ``consumer.seek()`` would call aiokafka's ``seek``
    from the event loop's thread while the consumer thread may be in ``Fetcher.fetched_records``:
    both delete from the fetcher's records and the consumer thread dies with
    ``KeyError(TopicPartition(...))``. ``seek_wait`` runs the seeks on the consumer thread (as
    Faust's own recovery does). aiokafka refuses to seek a partition that a rebalance took away
    meanwhile (``IllegalStateError``: "No current assignment for partition").
    """
    try:
        await consumer.seek_wait(dict(offsets))
    except IllegalStateError as exc:
        raise AssignmentChanged(str(exc)) from exc


def forget_gaps(consumer: Any, tp: TP) -> None:
    """Forget the gaps Faust noted in ``tp``'s offsets. Faust takes a jump in the offsets it delivers
    for records absent from the log (transaction markers, compaction) and lets its commits pass over
    them; a partition read again from before a jump (:mod:`kvbus.streams.offset_guard`) is not
    missing those records, and a commit over them would cover records not processed yet."""
    consumer._gap.pop(tp, None)


# -- checking the installed Faust -------------------------------------------------------------------


class FaustInternalsChanged(RuntimeError):
    """The installed faust-streaming lacks, or changed the kind or signature of, a name kvbus relies on."""

    def __init__(self, problems: Sequence[str]):
        self.problems = list(problems)
        super().__init__(f"{installed_versions()}: kvbus.streams.faust_adapter cannot run on it: "
                         + "; ".join(self.problems))


def installed_versions() -> str:
    """The installed faust-streaming, mode-streaming and aiokafka, and the release kvbus requires."""
    def version(dist: str) -> str:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    try:
        required = [r for r in importlib.metadata.requires("kvbus") or () if r.startswith("faust-streaming")]
    except importlib.metadata.PackageNotFoundError:
        required = []
    wanted = f" (kvbus requires {required[0].split(';')[0]})" if required else ""
    return (f"faust-streaming {version('faust-streaming')}{wanted}, mode-streaming {version('mode-streaming')}, "
            f"aiokafka {version('aiokafka')}")


def resolve(where: str) -> Any:
    """The object ``module:qualified.name`` names; AttributeError or ImportError naming what is missing."""
    module_name, _, qualname = where.partition(":")
    obj: Any = importlib.import_module(module_name)
    path = module_name
    for part in qualname.split("."):
        if not hasattr(obj, part):
            raise AttributeError(f"{path} has no attribute {part!r}")
        obj = getattr(obj, part)
        path = f"{path}.{part}"
    return obj


def _function(obj: Any) -> Any:
    """The function behind a mode ServiceTask or a decorator (``__wrapped__``); ``obj`` itself otherwise."""
    return inspect.unwrap(obj.fun if isinstance(obj, ServiceTask) else obj)


def _kind_of(obj: Any) -> str:
    if isinstance(obj, ContextVar):
        return "context variable"
    if isinstance(obj, ServiceTask):
        return "service task" if inspect.iscoroutinefunction(obj.fun) else f"service task over {obj.fun!r}"
    obj = _function(obj)
    if inspect.iscoroutinefunction(obj):
        return "coroutine function"
    if inspect.isasyncgenfunction(obj):
        return "async generator function"
    if inspect.isfunction(obj):
        return "function"
    return type(obj).__name__


def _check(internal: Internal, instances: Sequence[object]) -> Optional[str]:
    name = internal.where.replace(":", ".")
    if internal.kind == "instance attribute":
        owner_path, _, attr = internal.where.rpartition(".")
        try:
            owner = resolve(owner_path)
        except (ImportError, AttributeError) as exc:
            return f"{name}: missing ({exc})"
        for instance in instances:
            if isinstance(instance, owner):
                if not hasattr(instance, attr):
                    return f"{name}: a {type(instance).__name__} has no attribute {attr!r} after __init__"
                value = getattr(instance, attr)
                if internal.types and not isinstance(value, internal.types):
                    expected = " or ".join(t.__name__ for t in internal.types)
                    return f"{name}: is a {type(value).__name__}, expected {expected}"
        return None
    try:
        obj = resolve(internal.where)
    except (ImportError, AttributeError) as exc:
        return f"{name}: missing ({exc})"
    kind = _kind_of(obj)
    if kind != internal.kind:
        return f"{name}: is of kind {kind!r}, expected {internal.kind!r}"
    if internal.params is not None:
        params = tuple(inspect.signature(_function(obj)).parameters)
        if params != internal.params:
            return f"{name}: parameters ({', '.join(params)}), expected ({', '.join(internal.params)})"
    return None


def broken_internals(*instances: object) -> list[str]:
    """What the installed Faust lacks or changed among :data:`INTERNALS`, one message per name
    (empty: nothing). Instance attributes are checked on those of ``instances`` that are instances of
    their owner class (the consumer itself when it is built), and skipped without one."""
    return [p for p in (_check(i, instances) for i in INTERNALS) if p is not None]


def source_fingerprint(obj: Any) -> str:
    """First 16 hex digits of the SHA-256 of ``obj``'s source (what :attr:`Internal.reviewed` holds)."""
    return hashlib.sha256(inspect.getsource(_function(obj)).encode()).hexdigest()[:16]


def revised_internals() -> list[str]:
    """Which reviewed internals have another source than the one kvbus was written against, one
    message per name (empty: none). Names :func:`broken_internals` reports missing are skipped."""
    changes = []
    for internal in INTERNALS:
        if internal.reviewed is None:
            continue
        try:
            fingerprint = source_fingerprint(resolve(internal.where))
        except (ImportError, AttributeError, TypeError, OSError):
            continue
        if fingerprint != internal.reviewed:
            changes.append(f"{internal.where.replace(':', '.')}: source {fingerprint}, reviewed {internal.reviewed} "
                           f"({internal.why}): compare the new source with its use in kvbus.streams.faust_adapter, "
                           f"then update Internal.reviewed")
    return changes
