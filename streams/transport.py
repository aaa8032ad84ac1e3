"""Faust's aiokafka transport with a cheaper hand-over of fetched records (broker scheme ``kvbus://``).

Faust's ``Consumer._drain_messages`` hands every fetched record to the conductor through
``Service.wait_first(callback(message), suspend_flow.wait())``: four tasks and an
``asyncio.wait`` per record, so that a callback blocked on a full stream buffer is cancelled when a
rebalance suspends the flow. Profiled here (py-spy, a Faust agent that only acks), that is ~40%
of the event loop's time per raw record. :class:`Consumer` keeps the same loop and the same
semantics but waits that way once per *fetch*: the records of one ``getmany`` are delivered by one
coroutine, which ``wait_first`` cancels wherever it is blocked when the flow is suspended, the
worker stops or crashes (the records not yet delivered are dropped, as Faust drops them per record;
after the rebalance the consumer seeks back to committed offsets: :meth:`kvbus.streams.runtime.Runtime._rewind`).

Everything else (fetching thread, rebalancing, commits, producer, tables) is Faust's
``faust.transport.drivers.aiokafka``.
"""
from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Awaitable, Callable, Optional

from faust.transport import drivers
from faust.transport.consumer import CONSUMER_FETCHING
from faust.transport.drivers import aiokafka as faust_aiokafka
from faust.types import TP, Message

SCHEME = "kvbus"
"""Broker URL scheme of :class:`Transport` (``kvbus://host:port;host2:port2``)."""

YIELD_EVERY = 100
"""Records delivered between two ``sleep(0)`` (as Faust does), so other tasks keep running."""


class Consumer(faust_aiokafka.Consumer):
    """Faust's aiokafka consumer; records of one fetch go to the conductor in one task."""

    async def _drain_messages(self, fetcher: Any) -> None:  # pragma: no cover - runs in the worker
        consumer_should_stop = self._stopped.is_set
        fetcher_should_stop = fetcher._stopped.is_set
        try:
            while not (consumer_should_stop() or fetcher_should_stop()):
                self.diag.set_flag(CONSUMER_FETCHING)
                records = self.getmany(timeout=1.0)
                await self.sleep(0)  # getmany may return at once again and again (as Faust does)
                if not self.should_stop:
                    await self.wait_first(self._deliver(records), self.suspend_flow.wait())
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

    async def _deliver(self, records: AsyncIterator[tuple[TP, Message]]) -> None:
        """Hand one fetch's records to the conductor in order; per record exactly what Faust's
        loop does (skip offsets already read, note gaps of acking topics, commit every N acks)."""
        callback: Callable[[Message], Awaitable[Any]] = self.callback
        get_read_offset = self._read_offset.__getitem__
        set_read_offset = self._read_offset.__setitem__
        acks_enabled_for = self.app.topics.acks_enabled_for
        commit_every: Optional[int] = self._commit_every
        since_yield = 0
        async for tp, message in records:
            since_yield += 1
            if since_yield > YIELD_EVERY:
                await asyncio.sleep(0)
                since_yield = 0
            offset = message.offset
            r_offset = get_read_offset(tp)
            if r_offset is not None and offset < r_offset:
                continue  # already read (Faust logs "DROPPED MESSAGE ROFF" at dev level)
            if r_offset and offset - r_offset > 1 and acks_enabled_for(message.topic):
                await self._add_gap(tp, r_offset + 1, offset)
            if commit_every is not None and self._n_acked >= commit_every:
                self._n_acked = 0
                await self.commit()
            await callback(message)
            set_read_offset(tp, offset)


class Transport(faust_aiokafka.Transport):
    """Faust's aiokafka transport with :class:`Consumer`."""

    Consumer = Consumer


drivers.TRANSPORTS.aliases.setdefault(SCHEME, f"{__name__}:Transport")
