"""DEALER client of an engine's replay ROUTER (``shared/docs/kv-events-protocol.md`` §1).

Request ``[b"", start_seq 8-byte BE]``; the engine answers every buffered batch with
``seq >= start_seq`` (``[b"", topic, seq8, payload]`` from vLLM 0.26 / SGLang 0.5.23,
``[b"", seq8, payload]`` before) and then an end marker. A REQ socket would only see
the first reply, hence DEALER.

The client is non-blocking so the bridge can keep draining the live stream while a
replay runs: register :attr:`ReplayClient.socket` in a ``zmq.Poller``, call
:meth:`ReplayClient.read` when it is readable and :meth:`ReplayClient.expired` every
pass. A timed-out request is abandoned by closing the socket, so late replies of
that request can never be mistaken for the next one.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Iterator, Union

import zmq

from kvbus.producers.decode import DecodeError, parse_replay_reply

log = logging.getLogger("kvbus.producers.replay")

DEFAULT_TIMEOUT = 2.0
"""Seconds without any reply after which a replay request is abandoned."""


@dataclass(frozen=True)
class Replayed:
    """One replayed batch."""

    topic: str
    seq: int
    payload: bytes
    frames: list[bytes]


@dataclass(frozen=True)
class ReplayEnd:
    """The engine's end marker: everything it still buffered was sent."""


@dataclass(frozen=True)
class ReplayBad:
    """A reply that could not be parsed (goes to the DLQ)."""

    frames: list[bytes]
    error: DecodeError


Reply = Union[Replayed, ReplayEnd, ReplayBad]


class ReplayClient:
    """One outstanding replay request at a time against ``endpoint``.

    ``timeout``: idle seconds (no reply at all) before a request is given up.
    """

    def __init__(self, ctx: zmq.Context, endpoint: str, timeout: float = DEFAULT_TIMEOUT) -> None:
        self.ctx = ctx
        self.endpoint = endpoint
        self.timeout = timeout
        self.socket: zmq.Socket | None = None
        """The DEALER socket of the request in flight (None when idle after a cancel)."""
        self.start_seq: int | None = None
        """Start of the request in flight; None when idle."""
        self._deadline = 0.0

    @property
    def active(self) -> bool:
        """A request is in flight."""
        return self.start_seq is not None

    def _ensure_socket(self) -> zmq.Socket:
        if self.socket is None:
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, 0)  # a full replay buffer must fit
            sock.connect(self.endpoint)
            self.socket = sock
        return self.socket

    def request(self, start_seq: int) -> None:
        """Ask for every buffered batch with ``seq >= start_seq``."""
        if self.active:
            self.cancel()
        sock = self._ensure_socket()
        sock.send_multipart([b"", int(start_seq).to_bytes(8, "big")])
        self.start_seq = start_seq
        self._deadline = time.monotonic() + self.timeout
        log.info("replay requested from %s seq>=%d", self.endpoint, start_seq)

    def read(self, max_messages: int = 100_000) -> Iterator[Reply]:
        """Replies available now (non-blocking). After a :class:`ReplayEnd` the client is idle."""
        sock = self.socket
        if sock is None or not self.active:
            return
        for _ in range(max_messages):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._deadline = time.monotonic() + self.timeout
            try:
                parsed = parse_replay_reply(frames)
            except DecodeError as exc:
                yield ReplayBad(frames, exc)
                continue
            if parsed is None:
                self.start_seq = None
                yield ReplayEnd()
                return
            topic, seq, payload = parsed
            yield Replayed(topic, seq, payload, frames)

    def expired(self, now: float | None = None) -> bool:
        """The request in flight got no reply for ``timeout`` seconds."""
        return self.active and (time.monotonic() if now is None else now) > self._deadline

    def cancel(self) -> None:
        """Abandon the request in flight; its late replies are discarded with the socket."""
        if self.socket is not None:
            self.socket.close(linger=0)
            self.socket = None
        self.start_seq = None

    def close(self) -> None:
        """Release the socket."""
        self.cancel()

    def fetch(self, start_seq: int, timeout: float | None = None) -> tuple[list[Replayed], bool]:
        """Blocking convenience: all replies from ``start_seq`` and whether the end marker came."""
        if timeout is not None:
            self.timeout = timeout
        self.request(start_seq)
        got: list[Replayed] = []
        assert self.socket is not None
        while self.active:
            if self.expired():
                self.cancel()
                return got, False
            if not self.socket.poll(50):
                continue
            for reply in self.read():
                if isinstance(reply, Replayed):
                    got.append(reply)
                elif isinstance(reply, ReplayEnd):
                    return got, True
        return got, False
