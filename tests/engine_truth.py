"""What a real engine holds, from its own KV events socket, independent of kvbus: a ZMQ subscriber that
decodes vLLM's frames with plain msgpack (not kvbus's decoder) and reference-counts each block hash as
vLLM's block pool does (a BlockStored per copy, a BlockRemoved per evicted copy, AllBlocksCleared drops
everything)."""
from __future__ import annotations

import threading
from collections import Counter

import msgspec
import zmq


class EngineTruth:
    """Subscribes to ``endpoint`` (a vLLM engine's PUB socket) on a thread of its own until :meth:`close`."""

    def __init__(self, endpoint: str) -> None:
        self.copies: Counter[int] = Counter()
        """Block hash -> copies the engine holds (stores minus removes)."""
        self.stored_twice = 0
        """Stores of a hash the engine already held (a second copy)."""
        self.removes = self.stores = self.clears = 0
        self._outlived: set[int] = set()
        """Hashes still held in a copy after another copy of them was removed."""
        self.seen: set[int] = set()
        """Every hash the engine ever stored."""
        self.seqs: list[int] = []
        """Sequence numbers of the batches received, in order."""
        self._lock = threading.Lock()
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.setsockopt(zmq.RCVTIMEO, 100)
        self._sock.connect(endpoint)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-truth", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                _topic, seq, payload = self._sock.recv_multipart()
            except zmq.Again:
                continue
            _ts, events, *_ = msgspec.msgpack.decode(payload)
            with self._lock:
                self.seqs.append(int.from_bytes(seq, "big"))
                for e in events:
                    self._apply(e)

    def _apply(self, e: dict) -> None:
        kind = e["type"]
        if kind == "BlockStored":
            for h in e["block_hashes"]:
                self.stores += 1
                self.stored_twice += self.copies[h] > 0
                self.seen.add(h)
                self.copies[h] += 1
        elif kind == "BlockRemoved":
            for h in e["block_hashes"]:
                self.removes += 1
                self.copies[h] -= 1
                if self.copies[h] <= 0:
                    del self.copies[h]
                    self._outlived.discard(h)
                else:
                    self._outlived.add(h)
        elif kind == "AllBlocksCleared":
            self.clears += 1
            self.copies.clear()
            self._outlived.clear()

    def held(self) -> set[int]:
        """The hashes the engine holds now (at least one copy), as far as its events said."""
        with self._lock:
            return set(self.copies)

    def outlived(self) -> set[int]:
        """The hashes of which the engine removed a copy while another copy stays held: the view, whose GPU
        tier is a set (docs/sinks-layout.md, "Stores and removes"), has dropped them."""
        with self._lock:
            return set(self._outlived)

    def ever_stored(self) -> set[int]:
        """Every hash the engine stored since the subscriber started."""
        with self._lock:
            return set(self.seen)

    def stats(self) -> dict[str, int]:
        """Counts of what the subscriber saw."""
        with self._lock:
            return {"batches": len(self.seqs), "stores": self.stores, "removes": self.removes,
                    "clears": self.clears, "stored_twice": self.stored_twice, "held": len(self.copies),
                    "held_after_a_copy_was_removed": len(self._outlived)}

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close(0)
        self._ctx.term()
