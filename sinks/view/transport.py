"""How one shard of a view sends its function calls: the one seam between a store
(sinks/view/redis_store.py) and the server its shard lives on.

* :class:`NodeTransport`: a single Redis (or Valkey) server;
* :class:`ShardTransport`: shard ``s`` of a view on a Redis Cluster, through the sharded store's
  :class:`kvbus.sinks.view.cluster.ShardCalls` (routing, retries during slot migrations and
  failovers), which the sharded store also uses directly to send every shard's calls of a batch in
  one round trip.

Both load this release's function library when a call finds it missing (or refusing its arguments:
another release's library) and send the call again once.
"""
from __future__ import annotations

import abc
from typing import Any, Iterator, Sequence

import redis

from kvbus.sinks.view import functions
from kvbus.sinks.view.cluster import ShardCalls


class Transport(abc.ABC):
    """Sends one shard's function calls."""

    @abc.abstractmethod
    def call(self, name: str, *args: Any, readonly: bool = False) -> Any:
        """FCALL (``readonly``: FCALL_RO) ``name`` with ``args`` (after the keys); an error reply raises."""

    @abc.abstractmethod
    def run(self, name: str, calls: Iterator[list], sent: list[list]) -> list:
        """FCALL ``name`` once per argument list of ``calls``, in order, in one round trip; each
        argument list is appended to ``sent`` before it is sent. The replies, an error reply as its
        exception."""

    @abc.abstractmethod
    def server(self) -> redis.Redis:
        """A client of the server the shard is on now (its memory figures, its ``INFO``)."""


class NodeTransport(Transport):
    """Calls on one server through ``r`` (a ``redis.Redis``, bytes replies), declaring no keys."""

    def __init__(self, r: redis.Redis):
        self.r = r

    def call(self, name: str, *args: Any, readonly: bool = False) -> Any:
        return functions.call(self.r, name, *args, readonly=readonly)

    def server(self) -> redis.Redis:
        return self.r

    def run(self, name: str, calls: Iterator[list], sent: list[list]) -> list:
        """Each call is written to the socket as soon as ``calls`` yields it, so packing the next one
        overlaps Redis running this one (packing is ~10% of an apply), and the replies are read at the
        end. A connection error falls back to a redis-py pipeline of all of them (its retries; the
        stored positions make a call that ran twice harmless). A reply saying the library is missing
        or refusing the arguments loads it and sends the batch again (nothing of it was written: the
        first call refused, and the chain stopped the others)."""
        replies = self._stream(name, calls, sent)
        if any(functions.needs_library(x) for x in replies if isinstance(x, Exception)):
            functions.ensure_library(self.r)  # missing, or another version that refuses these calls
            replies = self._pipeline(name, sent)
        return replies

    def _pipeline(self, name: str, calls: Sequence[list]) -> list:
        pipe = self.r.pipeline(transaction=False)
        for args in calls:
            pipe.fcall(name, 0, *args)
        return pipe.execute(raise_on_error=False)

    def _stream(self, name: str, calls: Iterator[list], sent: list[list]) -> list:
        pool = self.r.connection_pool
        conn = None
        try:
            for args in calls:
                first = conn is None
                if first:
                    conn = pool.get_connection()
                sent.append(args)  # before sending: a call lost with the connection is sent again
                conn.send_packed_command(conn.pack_command("FCALL", name, 0, *args), check_health=first)
            replies: list = []
            for _ in sent:
                try:
                    replies.append(self.r.parse_response(conn, "FCALL"))
                except redis.ResponseError as e:
                    replies.append(e)
            return replies
        except (redis.ConnectionError, redis.TimeoutError):
            if conn is not None:
                conn.disconnect()
            sent.extend(calls)  # the calls not packed yet
            return self._pipeline(name, sent)
        except BaseException:
            if conn is not None:
                conn.disconnect()  # replies of the calls sent so far are unread: the connection is out of step
            raise
        finally:
            if conn is not None:
                pool.release(conn)


class ShardTransport(Transport):
    """Calls of shard ``s`` of a sharded view, through ``calls`` (which declares the shard's keys,
    routes to its master, retries and reloads the library)."""

    def __init__(self, calls: ShardCalls, s: int):
        self.calls, self.s = calls, s

    def call(self, name: str, *args: Any, readonly: bool = False) -> Any:
        reply = self.calls.execute([(self.s, name, list(args))])[0]
        if isinstance(reply, Exception):
            raise reply
        return reply

    def run(self, name: str, calls: Iterator[list], sent: list[list]) -> list:
        sent.extend(calls)
        return self.calls.execute([(self.s, name, args) for args in sent]) if sent else []

    def server(self) -> redis.Redis:
        return self.calls.node(self.s).redis_connection
