"""``kvbus fleet``: synthetic engine replicas that publish KV events exactly like vLLM/SGLang.

Each publisher stream behaves like vLLM's ``ZmqEventPublisher`` (protocol doc §1):
a PUB socket bound on ``tcp://<host>:<port>`` sending ``[topic, seq 8-byte BE, payload]``
with ``seq`` from 0 (+1 per batch), and a replay ROUTER bound on ``port + 1`` that
answers ``[identity, b"", start_seq8]`` with every buffered batch ``seq >= start_seq``
(a ``deque(maxlen=buffer_steps)``) and the end marker, in the reply layout of the
chosen wire format (topic frame from vLLM 0.26 / SGLang 0.5.23). Payloads are
encoded by :mod:`kvbus.simulator.engine_wire` in any supported engine format.

**Ports.** One stream per (replica i, dp rank d, worker w); its index is
``k = (i * dp_ranks + d) * workers + w``; PUB on ``base_port + 2k``, replay ROUTER on
``base_port + 2k + 1``. With the defaults (1 dp rank, 1 worker) replica i uses
``base+2i`` / ``base+2i+1``. :meth:`Fleet.streams` lists every endpoint.

**Content.** A few system prompts x many user suffixes (and conversation turns that
extend earlier prompts) are served by a per-(replica, dp) prefix-cache model: the
cached prefix is reused, new full blocks are announced as one ``BlockStored`` chain
(parent hash = the last cached block, hashes from :mod:`kvbus.schemas.hashing`, so
``kvbus lookup --tokens`` finds them), LRU evictions are one ``BlockRemoved`` per hash
(like vLLM), some chains are offloaded to CPU (``medium="CPU"``) and some to the
secondary tier ``ownership="kvcr"``, and rarely the framework's cache is reset
(``AllBlocksCleared``: GPU and CPU emptied, the kvcr tier kept). Each model keeps the ground truth (:class:`Residency`).

**Tensor-parallel workers.** ``workers > 1``: every worker has its own stream reporting the
same events; ``drop_rate`` / ``dup_rate`` omit or duplicate single event reports of one
worker, for the streams stage's aggregation tests.

**Python API.** :class:`EnginePublisher` (one stream), :class:`CacheModel` (content +
ground truth), :class:`Fleet` (``start``/``publish_step``/``play``/``stop``); script mode
(:meth:`Fleet.play`) publishes an explicit list of :class:`ScriptBatch` for exact
end-to-end expectations; outside-request mode (:meth:`Fleet.serve`) has a chosen replica serve a
request from a router and publish what its cache did (``benchmarks/routing.py``).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import random
import signal
import struct
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import msgspec
import zmq

from kvbus.schemas.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    Reset,
    canonical_hash,
    normalize_medium,
)
from kvbus.schemas.hashing import block_digests
from kvbus.simulator.engine_wire import (
    FORMATS,
    encode_batch,
    encode_frames,
    encode_replay_reply,
    project,
    replay_end,
    wire_format,
)

log = logging.getLogger("kvbus.simulator.fleet")

DEFAULT_BASE_PORT = 5557
DEFAULT_FORMAT = "vllm-0.33"


# -- one publisher stream ---------------------------------------------------------

def _bind(sock: zmq.Socket, endpoint: str, retry_for: float = 0.0) -> str:
    """Bind ``endpoint`` (port 0 = any free port); returns the endpoint actually bound.
    ``retry_for``: seconds to retry while the port is still held by a just-closed socket."""
    if endpoint.startswith("tcp://") and endpoint.endswith(":0"):
        endpoint = endpoint[:-2] + ":*"
    deadline = time.monotonic() + retry_for
    while True:
        try:
            sock.bind(endpoint)
            return sock.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


class EnginePublisher:
    """One engine publisher stream: PUB + replay ROUTER, sequence numbers, replay buffer.

    ``publish*`` must be called from one thread; :meth:`serve_replay` from one (possibly
    other) thread. ``bind=False`` skips binding (for :meth:`encode` only use).
    """

    def __init__(
        self,
        ctx: zmq.Context,
        pub_endpoint: str,
        replay_endpoint: str | None,
        fmt: str = DEFAULT_FORMAT,
        *,
        topic: str = "",
        dp_rank: int = 0,
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        raw_hashes: bool = False,
    ) -> None:
        wire_format(fmt)  # validate
        self.ctx = ctx
        self.pub_endpoint = pub_endpoint
        self.replay_endpoint = replay_endpoint
        self.fmt = fmt
        self.topic = topic
        self.dp_rank = dp_rank
        self.buffer_steps = buffer_steps
        self.hwm = hwm
        self.raw_hashes = raw_hashes
        self.next_seq = 0
        """Sequence number of the next batch."""
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        """Replay buffer: (seq, payload) of the last ``buffer_steps`` batches."""
        self._lock = threading.Lock()
        self.pub: zmq.Socket | None = None
        self.router: zmq.Socket | None = None
        self.sent = 0
        """Batches sent live."""
        self.dropped_live = 0
        """Batches kept for replay but not sent live (simulated network loss)."""
        self.replays_served = 0
        self.last_events = 0
        """Events of the last batch :meth:`publish` sent."""

    def bind(self) -> None:
        """Bind the PUB and replay ROUTER sockets."""
        pub = self.ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.SNDHWM, self.hwm)
        pub.setsockopt(zmq.LINGER, 0)
        self.pub_endpoint = _bind(pub, self.pub_endpoint)
        self.pub = pub
        if self.replay_endpoint:
            router = self.ctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.SNDHWM, 2 * (self.buffer_steps + 1))
            router.setsockopt(zmq.LINGER, 0)
            self.replay_endpoint = _bind(router, self.replay_endpoint)
            self.router = router

    def close(self) -> None:
        """Close both sockets."""
        for s in (self.pub, self.router):
            if s is not None:
                s.close(linger=0)
        self.pub = self.router = None

    def restart(self, rebind: bool = True) -> None:
        """Simulate an engine restart: seq back to 0, replay buffer emptied, and (``rebind``)
        the PUB socket closed and bound again so subscribers reconnect. The replay ROUTER
        is kept: it belongs to the thread serving replays."""
        with self._lock:
            self.next_seq = 0
            self.buffer.clear()
        if rebind and self.pub is not None:
            self.pub.close(linger=0)
            pub = self.ctx.socket(zmq.PUB)
            pub.setsockopt(zmq.SNDHWM, self.hwm)
            pub.setsockopt(zmq.LINGER, 0)
            self.pub_endpoint = _bind(pub, self.pub_endpoint, retry_for=5.0)
            self.pub = pub

    def encode(self, events: list[Event], ts: float | None = None) -> bytes:
        """The payload this stream's engine format would send for ``events``."""
        return encode_batch(self.fmt, time.time() if ts is None else ts, events, self.dp_rank,
                            raw_hashes=self.raw_hashes)

    def publish(self, events: list[Event], ts: float | None = None, *, send_live: bool = True) -> int:
        """Encode and publish one batch; returns its seq. ``send_live=False`` keeps it in the
        replay buffer only (a message lost on the way)."""
        seq = self.publish_payload(self.encode(events, ts), send_live=send_live)
        self.last_events = len(events)
        return seq

    def published(self) -> dict[str, int]:
        """``batches`` published, the ``last_seq`` and its ``last_events`` (-1 / 0 before the first):
        a consumer that applied everything holds position (epoch, last_seq, last_events - 1)."""
        return {"batches": self.next_seq, "last_seq": self.next_seq - 1, "last_events": self.last_events}

    def publish_payload(self, payload: bytes, *, send_live: bool = True) -> int:
        """Publish an already encoded (or deliberately malformed) payload; returns its seq."""
        with self._lock:
            seq = self.next_seq
            self.next_seq += 1
            self.buffer.append((seq, payload))
        if send_live:
            assert self.pub is not None, "bind() first"
            self.pub.send_multipart(encode_frames(self.topic, seq, payload), copy=False)
            self.sent += 1
        else:
            self.dropped_live += 1
        return seq

    def send_raw(self, frames: Sequence[bytes]) -> None:
        """Send arbitrary frames on the PUB socket (bad-input tests); no seq consumed."""
        assert self.pub is not None, "bind() first"
        self.pub.send_multipart(list(frames))

    def serve_replay(self) -> int:
        """Answer pending replay requests (non-blocking); returns requests served."""
        router = self.router
        if router is None:
            return 0
        served = 0
        while True:
            try:
                frames = router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return served
            if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                log.warning("replay %s: ignoring malformed request of %d frames", self.replay_endpoint, len(frames))
                continue
            identity, start = frames[0], int.from_bytes(frames[2], "big")
            with self._lock:
                items = [(s, p) for s, p in self.buffer if s >= start]
            for s, p in items:
                router.send_multipart([identity, *encode_replay_reply(self.fmt, self.topic, s, p)])
            router.send_multipart([identity, *replay_end(self.fmt)])
            served += 1
            self.replays_served += 1


# -- ground truth --------------------------------------------------------------------

Tier = tuple[str | None, str | None]
"""(medium, ownership) as kvbus normalizes them."""


def drop_framework_tiers(tiers: dict[Tier, Any]) -> None:
    """Remove from ``tiers`` those of the framework (ownership null), as an AllBlocksCleared does;
    a secondary tier (an ``ownership``'s) is its connector's and stays."""
    for tier in [t for t in tiers if t[1] is None]:
        del tiers[tier]


class Residency:
    """Ground truth of one (replica, dp_rank): the block hashes each tier holds."""

    def __init__(self) -> None:
        self.tiers: dict[Tier, "OrderedDict[bytes, None]"] = {}

    def apply(self, event: Event) -> None:
        """Update from one (normalized) event."""
        if isinstance(event, BlockStored):
            tier = self.tiers.setdefault((normalize_medium(event.medium), event.ownership), OrderedDict())
            for h in event.block_hashes:
                tier[h] = None
                tier.move_to_end(h)
        elif isinstance(event, BlockRemoved):
            tier = self.tiers.get((normalize_medium(event.medium), event.ownership))
            if tier is not None:
                for h in event.block_hashes:
                    tier.pop(h, None)
        elif isinstance(event, AllBlocksCleared):  # the framework's cache: secondary tiers keep theirs
            drop_framework_tiers(self.tiers)
        elif isinstance(event, Reset):  # the engine restarted: every tier is gone
            self.tiers.clear()

    def apply_all(self, events: Iterable[Event]) -> "Residency":
        """Apply events in order; returns self."""
        for e in events:
            self.apply(e)
        return self

    def holds(self, h: bytes, medium: str | None = "GPU", ownership: str | None = None) -> bool:
        """Whether tier (medium, ownership) holds block ``h``."""
        return h in self.tiers.get((medium, ownership), ())

    def snapshot(self) -> dict[Tier, set[bytes]]:
        """Non-empty tiers as sets."""
        return {t: set(hs) for t, hs in self.tiers.items() if hs}


# -- content model ------------------------------------------------------------------

@dataclass
class ModelConfig:
    """Knobs of the synthetic workload of one (replica, dp_rank)."""

    block_size: int = 16
    gpu_blocks: int = 2048
    """GPU prefix-cache capacity in blocks (LRU beyond)."""
    cpu_blocks: int = 4096
    """CPU offload tier capacity."""
    kvcr_blocks: int = 4096
    """Secondary (kvcr) tier capacity."""
    system_prompts: int = 4
    requests_per_step: tuple[int, int] = (1, 4)
    continue_rate: float = 0.3
    """Share of requests that extend an earlier prompt (next conversation turn)."""
    cpu_rate: float = 0.2
    """Share of served prompts also offloaded to CPU."""
    kvcr_rate: float = 0.05
    """Share of served prompts also stored in the kvcr tier."""
    clear_rate: float = 0.0005
    """Chance per step of an AllBlocksCleared (prefix cache reset)."""
    vocab: int = 32_000
    hash_algo: str = "sha256"
    history: int = 256
    """Prompts remembered for the manifest and for conversation turns."""


def system_prompts(rng: random.Random, cfg: ModelConfig) -> list[list[int]]:
    """``cfg.system_prompts`` prompts of 3-12 full blocks of random tokens."""
    return [[rng.randrange(1, cfg.vocab) for _ in range(rng.randint(3, 12) * cfg.block_size)]
            for _ in range(cfg.system_prompts)]


def message(rng: random.Random, cfg: ModelConfig) -> list[int]:
    """One conversation message (a user turn or a reply): 1-12 full blocks plus a partial block of random tokens."""
    bs = cfg.block_size
    return [rng.randrange(1, cfg.vocab) for _ in range(rng.randint(1, 12) * bs + rng.randrange(bs))]


class CacheModel:
    """A prefix cache serving synthetic prompts; emits vLLM-like events and keeps ground truth.

    ``fmt`` limits the event fields to what that engine release can send (no CPU without
    ``medium``, no kvcr without ``ownership``); ground truth is kept on the events as a
    decoder will see them (:func:`kvbus.simulator.engine_wire.project`).
    """

    def __init__(self, rng: random.Random, cfg: ModelConfig, fmt: str = DEFAULT_FORMAT, raw_hashes: bool = False,
                 system: list[list[int]] | None = None) -> None:
        self.rng = rng
        self.cfg = cfg
        self.fmt = fmt
        spec = wire_format(fmt)
        self._has_medium = "medium" in spec.stored
        self._has_ownership = "ownership" in spec.stored
        self._has_group = "group_idx" in spec.stored
        self._raw = raw_hashes
        self.system = system if system is not None else system_prompts(rng, cfg)
        """The system prompts this cache's requests start with (a fleet's are shared by every replica)."""
        self._truth = Residency()
        self._unapplied: list[Event] = []
        """Events published but not yet applied to the ground truth (:meth:`later`), in order."""
        self._lru: dict[Tier, OrderedDict[bytes, None]] = {}
        self.prompts: deque[list[int]] = deque(maxlen=cfg.history)
        self._digests: dict[bytes, bytes] = {}
        """Full digest of each cached hash (raw_hashes mode: BlockRemoved carries it)."""
        self.steps = 0
        self.clears = 0

    # tiers
    def _tier(self, medium: str | None, ownership: str | None) -> OrderedDict:
        return self._lru.setdefault((medium, ownership), OrderedDict())

    def _capacity(self, tier: Tier) -> int:
        medium, ownership = tier
        if ownership == "kvcr":
            return self.cfg.kvcr_blocks
        return self.cfg.cpu_blocks if medium == "CPU" else self.cfg.gpu_blocks

    def new_prompt(self) -> list[int]:
        """A prompt: an earlier one plus a new turn, or a system prompt plus a user suffix."""
        rng = self.rng
        if self.prompts and rng.random() < self.cfg.continue_rate:
            base = rng.choice(self.prompts)
        else:
            base = rng.choice(self.system)
        return base + message(rng, self.cfg)

    def hashes(self, tokens: Sequence[int]) -> tuple[list[bytes], list[bytes]]:
        """(canonical 8-byte hashes, full digests) of the full blocks of ``tokens``."""
        digests = block_digests(tokens, self.cfg.block_size, self.cfg.hash_algo)
        return [canonical_hash(d) for d in digests], digests

    @property
    def truth(self) -> Residency:
        """Ground truth: every event published so far applied (those kept by :meth:`later` first)."""
        if self._unapplied:
            self._truth.apply_all(self._unapplied)
            self._unapplied.clear()
        return self._truth

    def later(self, events: Sequence[Event]) -> None:
        """Events (as a decoder yields them, :func:`~kvbus.simulator.engine_wire.project`) just
        published, applied to the ground truth when it is next read: publishing stays a list append."""
        self._unapplied.extend(events)

    def truth_view(self, event: Event) -> Event:
        """``event`` as the ground truth needs it: projected as a decoder yields it, without the
        token ids (which residency does not depend on), so that pregenerated steps stay small."""
        p = project(self.fmt, event, raw_hashes=self._raw)
        return msgspec.structs.replace(p, token_ids=[]) if isinstance(p, BlockStored) else p

    def step(self, apply_truth: bool = True) -> list[Event]:
        """One engine step: a few requests served (stores, evictions, offloads), maybe a reset.
        ``apply_truth=False``: the ground truth is left alone (a pregenerated step applies its
        events when it is published, :meth:`later`)."""
        self.steps += 1
        events: list[Event] = []
        if self.rng.random() < self.cfg.clear_rate:
            events.append(self._clear())
        lo, hi = self.cfg.requests_per_step
        for _ in range(self.rng.randint(lo, hi)):
            events += self.serve(self.new_prompt())
        if apply_truth:
            truth = self.truth
            for e in events:
                truth.apply(project(self.fmt, e, raw_hashes=self._raw))
        return events

    def _clear(self) -> AllBlocksCleared:
        """Empty the framework's tiers (ownership null); a secondary tier (kvcr) is its connector's,
        which the engine's prefix-cache reset leaves alone (as the view does)."""
        drop_framework_tiers(self._lru)
        self.clears += 1
        return AllBlocksCleared()

    def clear(self) -> AllBlocksCleared:
        """Reset the prefix cache (vLLM's ``reset_prefix_cache``): the framework's tiers emptied,
        ground truth included; returns the event that announces it."""
        event = self._clear()
        self.truth.apply(event)
        return event

    def admit(self, tokens: list[int]) -> tuple[int, list[Event]]:
        """Serve one request sent from outside (a router's choice): returns (leading full blocks of
        ``tokens`` that were already resident on GPU, i.e. the prefix the engine reused; the events of
        serving it), the ground truth updated."""
        hashes, digests = self.hashes(tokens)
        return self.admit_hashed(tokens, hashes, digests)

    def admit_hashed(self, tokens: list[int], hashes: list[bytes], digests: list[bytes]) -> tuple[int, list[Event]]:
        """:meth:`admit` of a prompt whose block ``hashes`` and ``digests`` (:meth:`hashes`) the caller
        computed once for several engines (a benchmark replaying one request on several fleets)."""
        reused = self.resident_prefix(hashes)
        events = self._serve_hashed(tokens, hashes, digests)
        for e in events:
            self.truth.apply(project(self.fmt, e, raw_hashes=self._raw))
        return reused, events

    def resident_prefix(self, hashes: Sequence[bytes]) -> int:
        """Leading blocks of the chain ``hashes`` resident on GPU (ground truth)."""
        gpu = self.truth.tiers.get(("GPU" if self._has_medium else None, None), {})
        n = 0
        while n < len(hashes) and hashes[n] in gpu:
            n += 1
        return n

    def serve(self, tokens: list[int]) -> list[Event]:
        """Events of serving one prompt (its full blocks cached on GPU, maybe offloaded)."""
        hashes, digests = self.hashes(tokens)
        return self._serve_hashed(tokens, hashes, digests)

    def _serve_hashed(self, tokens: list[int], hashes: list[bytes], digests: list[bytes]) -> list[Event]:
        self.prompts.append(tokens)
        if not hashes:
            return []
        gpu_medium = "GPU" if self._has_medium else None
        events = self._store(tokens, hashes, digests, (gpu_medium, None))
        if self._has_medium and self.rng.random() < self.cfg.cpu_rate:
            events += self._store(tokens, hashes, digests, ("CPU", None))
        if self._has_ownership and self.rng.random() < self.cfg.kvcr_rate:
            events += self._store(tokens, hashes, digests, ("CPU", "kvcr"))
        return events

    def _store(self, tokens: list[int], hashes: list[bytes], digests: list[bytes], tier: Tier) -> list[Event]:
        lru = self._tier(*tier)
        bs = self.cfg.block_size
        cached = 0
        while cached < len(hashes) and hashes[cached] in lru:
            cached += 1
        for h in reversed(hashes[:cached]):  # touch, parents most recent
            lru.move_to_end(h)
        medium, ownership = tier
        end = len(hashes)
        if medium not in ("GPU", None) or ownership is not None:
            # an offloading tier counts references (a store of a block it holds is a second
            # reference, kept until a second remove), and its connector announces a block once: the
            # chain stops before the first block the tier already holds, so the truth stays a set
            end = next((i for i in range(cached, len(hashes)) if hashes[i] in lru), end)
        new = hashes[cached:end]
        events: list[Event] = []
        if not new:
            return events
        extra: dict[str, Any] = {}
        if self._has_group and medium == "GPU":
            extra = {"group_idx": 0}
            if "kv_cache_spec_kind" in wire_format(self.fmt).stored:
                extra["kv_cache_spec_kind"] = "full_attention"
        cap = self._capacity(tier)
        while len(lru) + len(new) > cap and lru:
            victim, _ = lru.popitem(last=False)
            events.append(BlockRemoved(
                block_hashes=[victim], medium=medium, ownership=ownership,
                block_digests=[self._digest_of(victim)] if self._raw else None,
                **({"group_idx": 0} if "group_idx" in extra else {}),
            ))
        parent = hashes[cached - 1] if cached else None
        events.append(BlockStored(
            block_hashes=list(new), parent_block_hash=parent,
            token_ids=list(tokens[cached * bs:end * bs]), block_size=bs,
            medium=medium, ownership=ownership,
            block_digests=list(digests[cached:end]) if self._raw else None,
            parent_block_digest=(digests[cached - 1] if cached else None) if self._raw else None,
            **extra,
        ))
        for h, d in zip(reversed(new), reversed(digests[cached:end])):
            lru[h] = None
            if self._raw:
                self._digests[h] = d
        return events

    def _digest_of(self, h: bytes) -> bytes:
        return self._digests.pop(h, h.rjust(32, b"\0"))

    def manifest(self) -> dict[str, Any]:
        """Prompts served (most recent last) with how many leading blocks are resident on GPU."""
        prompts = []
        for toks in self.prompts:
            hs, _ = self.hashes(toks)
            resident = self.resident_prefix(hs)
            prompts.append({"tokens": toks, "blocks": len(hs), "resident_blocks": resident,
                            "resident": resident == len(hs) and bool(hs)})
        return {
            "prompts": prompts,
            "tiers": {f"{m}/{o}": len(hs) for (m, o), hs in self.truth.tiers.items()},
            "steps": self.steps,
            "clears": self.clears,
        }


# -- the fleet -----------------------------------------------------------------------

@dataclass
class FleetConfig:
    """Options of a fleet (mirrors the CLI flags)."""

    replicas: int = 3
    base_port: int = DEFAULT_BASE_PORT
    """First port (see module doc); 0 = OS-assigned ports (tests), read them from :meth:`Fleet.streams`."""
    dp_ranks: int = 1
    workers: int = 1
    drop_rate: float = 0.0
    """Chance that one worker omits one event report (workers > 1 aggregation tests)."""
    dup_rate: float = 0.0
    """Chance that one worker reports one event twice."""
    live_drop_rate: float = 0.0
    """Chance a batch is not sent live but only kept for replay (bridge gap tests)."""
    format: str = DEFAULT_FORMAT
    seed: int = 0
    rate: float = 10.0
    """Batches per second per replica (each dp rank steps at this rate)."""
    duration: float = 0.0
    """Seconds to run; 0 = until stopped."""
    block_size: int = 16
    replica_prefix: str = "replica-"
    manifest: str | None = None
    host: str = "127.0.0.1"
    topic: str = ""
    buffer_steps: int = 10_000
    raw_hashes: bool = False
    model: ModelConfig = field(default_factory=ModelConfig)
    schedule: tuple[tuple[float, float], ...] = ()
    """Load ladder: (engine events/s of the whole fleet, seconds) rungs played in order; when set it
    replaces ``rate`` and ``duration``. Steps are paced by the events they publish (a replica's
    step publishes few events while its cache fills and more once evictions start). A rung of
    rate 0 publishes nothing (probes still go out)."""
    probe_every: float = 0.0
    """Seconds between freshness probes (0 = none): a one-block BlockStored of a fresh random hash,
    published to the next (replica, dp rank) in turn, on every worker stream, like any batch."""
    pregenerate: bool = False
    """Generate and encode every step of the schedule before playing it, and play the encoded frames
    (each batch's ``ts`` restamped when sent), so that the generator costs about one ZMQ send per
    batch while it plays; the ground truth is applied as batches are published. Only with a
    ``schedule``. The manifest's prompts are then those generated, its tiers those published."""
    probe_keep: int = 0
    """Probes left in the caches (0 = every one, for good): once more are out, the oldest is removed
    again (a one-block BlockRemoved to its holder, applied to the ground truth too), so that a long
    run's view and truth do not grow by one block per probe."""
    probe_log: str | None = None
    """Where probes and rung starts are written, one JSON object per line: ``{"probe": "<hash hex>",
    "holder": "<replica>#<dp>", "t": <time.monotonic() after sending>, "wall": <time.time()>}``,
    ``{"cleared": "<replica>#<dp>", "t": ...}`` after a step that cleared that holder's cache,
    ``{"rung": i, "rate": r, "seconds": s, "t": ...}``, and ``{"end": true, "t": ...}`` at the end."""


@dataclass(frozen=True)
class StreamInfo:
    """One publisher stream of the fleet."""

    replica: str
    dp_rank: int
    worker_rank: int
    workers: int
    endpoint: str
    replay_endpoint: str


@dataclass
class ScriptBatch:
    """One explicit batch for :meth:`Fleet.play` (script mode)."""

    replica: str
    events: list[Event]
    dp_rank: int = 0
    ts: float | None = None
    send_live: bool = True
    """False: keep it for replay only (a lost live message)."""


@dataclass
class PregeneratedBatch:
    """One (replica, dp rank)'s batch of a pregenerated step (:meth:`Fleet.pregenerate`)."""

    key: tuple[str, int]
    """(replica, dp rank)."""
    payloads: list[tuple[bytes, int]]
    """Per worker stream: (the encoded payload, events in it)."""
    truth: list[Event]
    """The batch's events as the ground truth applies them (:meth:`CacheModel.truth_view`)."""


_TS_FLOAT64 = 0xCB
"""msgpack's float 64 marker: the engine envelope ``[ts, events, ...]`` starts with it after its array header."""


def restamp_prefix(ts: float) -> bytes:
    """What :func:`restamp` writes for ``ts``: a msgpack float 64."""
    return struct.pack(">Bd", _TS_FLOAT64, ts)


def restamp(payload: bytes, ts_prefix: bytes) -> bytes:
    """``payload`` (an engine envelope as :func:`~kvbus.simulator.engine_wire.encode_batch` writes it:
    a fixarray whose first element is the float 64 ``ts``) with ``ts`` replaced by ``ts_prefix``
    (:func:`restamp_prefix`); any other layout is returned unchanged."""
    if len(payload) > 10 and 0x90 <= payload[0] <= 0x9F and payload[1] == _TS_FLOAT64:
        return payload[:1] + ts_prefix + payload[10:]
    return payload


def stream_index(cfg: FleetConfig, replica: int, dp_rank: int, worker: int) -> int:
    """Index k of a stream; its ports are ``base_port + 2k`` (PUB) and ``+ 1`` (replay)."""
    return (replica * cfg.dp_ranks + dp_rank) * cfg.workers + worker


class Fleet:
    """Synthetic engine replicas. ``start()`` binds every stream and serves replays in a
    background thread; ``publish_step()`` publishes one generated step of every replica;
    ``play(script)`` publishes explicit batches; ``run()`` paces steps at ``rate``."""

    def __init__(self, cfg: FleetConfig, ctx: zmq.Context | None = None) -> None:
        wire_format(cfg.format)
        self.cfg = cfg
        self.ctx = ctx or zmq.Context.instance()
        self.rng = random.Random(f"fleet:{cfg.seed}")
        self.names = [f"{cfg.replica_prefix}{i}" for i in range(cfg.replicas)]
        self.models: dict[tuple[str, int], CacheModel] = {}
        self.publishers: dict[tuple[str, int, int], EnginePublisher] = {}
        mcfg = cfg.model
        mcfg.block_size = cfg.block_size
        system = system_prompts(random.Random(f"system:{cfg.seed}"), mcfg)  # fleet-wide, as in a deployment
        for i, name in enumerate(self.names):
            for d in range(cfg.dp_ranks):
                self.models[(name, d)] = CacheModel(random.Random(f"{cfg.seed}:{i}:{d}"), mcfg, cfg.format,
                                                    cfg.raw_hashes, system)
                for w in range(cfg.workers):
                    k = stream_index(cfg, i, d, w)
                    port = cfg.base_port + 2 * k
                    pub_port, replay_port = (port, port + 1) if cfg.base_port else (0, 0)
                    self.publishers[(name, d, w)] = EnginePublisher(
                        self.ctx, f"tcp://{cfg.host}:{pub_port}", f"tcp://{cfg.host}:{replay_port}", cfg.format,
                        topic=cfg.topic, dp_rank=d, buffer_steps=cfg.buffer_steps, raw_hashes=cfg.raw_hashes,
                    )
        self.worker_drops = 0
        self.worker_dups = 0
        self.steps = 0
        """Steps published (:meth:`publish_step`)."""
        self.events = 0
        """Events those steps published (per replica, not per worker stream)."""
        self._stop = threading.Event()
        self._server: threading.Thread | None = None
        self._probe_rng = random.Random(f"probe:{cfg.seed}:{time.time_ns()}")  # fresh hashes every run
        self._probe_turn = 0
        self._probes_out: deque[tuple[bytes, str, int]] = deque()
        """Probes still cached (hash, replica, dp rank), oldest first (kept only with ``probe_keep``)."""
        self._probe_out: Any = None
        self._pregenerated: deque[list[PregeneratedBatch]] = deque()
        """Steps generated and encoded ahead (:meth:`pregenerate`), played by :meth:`publish_step` first."""

    # lifecycle
    def streams(self) -> list[StreamInfo]:
        """Every stream's replica, dp rank, worker and endpoints (what bridges connect to)."""
        return [StreamInfo(n, d, w, self.cfg.workers, p.pub_endpoint, p.replay_endpoint or "")
                for (n, d, w), p in self.publishers.items()]

    def start(self) -> "Fleet":
        """Bind all sockets and start serving replay requests."""
        for p in self.publishers.values():
            p.bind()
        self._stop.clear()
        self._server = threading.Thread(target=self._serve_replays, name="fleet-replay", daemon=True)
        self._server.start()
        log.info("fleet: %d replicas x %d dp x %d workers, format %s, ports %d..%d", self.cfg.replicas,
                 self.cfg.dp_ranks, self.cfg.workers, self.cfg.format, self.cfg.base_port,
                 self.cfg.base_port + 2 * len(self.publishers) - 1)
        return self

    def stop(self) -> None:
        """Stop serving replays and close sockets."""
        self._stop.set()
        if self._server is not None:
            self._server.join(timeout=5)
            self._server = None
        for p in self.publishers.values():
            p.close()

    def __enter__(self) -> "Fleet":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def _serve_replays(self) -> None:
        poller = zmq.Poller()
        routers = {p.router: p for p in self.publishers.values() if p.router is not None}
        for r in routers:
            poller.register(r, zmq.POLLIN)
        while not self._stop.is_set():
            for sock, _ in poller.poll(20):
                routers[sock].serve_replay()

    # publishing
    def publisher(self, replica: str, dp_rank: int = 0, worker: int = 0) -> EnginePublisher:
        """The stream of (replica, dp_rank, worker)."""
        return self.publishers[(replica, dp_rank, worker)]

    def publish_events(self, replica: str, events: list[Event], dp_rank: int = 0, ts: float | None = None,
                       send_live: bool = True) -> list[int]:
        """Publish one batch to every worker stream of (replica, dp_rank) (worker drop/dup applied);
        returns the seq of each worker's batch."""
        ts = time.time() if ts is None else ts
        seqs = []
        for w in range(self.cfg.workers):
            evs = self._worker_view(events) if self.cfg.workers > 1 else events
            live = send_live and not (self.cfg.live_drop_rate and self.rng.random() < self.cfg.live_drop_rate)
            seqs.append(self.publishers[(replica, dp_rank, w)].publish(evs, ts, send_live=live))
        return seqs

    def _worker_view(self, events: list[Event]) -> list[Event]:
        if not (self.cfg.drop_rate or self.cfg.dup_rate):
            return events
        out: list[Event] = []
        for e in events:
            r = self.rng.random()
            if r < self.cfg.drop_rate:
                self.worker_drops += 1
                continue
            out.append(e)
            if r < self.cfg.drop_rate + self.cfg.dup_rate:
                out.append(e)
                self.worker_dups += 1
        return out

    def pregenerate(self, events: int) -> int:
        """Generate and encode steps of every (replica, dp rank) until they hold ``events`` engine
        events; :meth:`publish_step` then plays them, in order, before generating new ones.
        Returns the steps generated."""
        ts, total, steps = time.time(), 0, 0
        while total < events:
            step: list[PregeneratedBatch] = []
            for key, model in self.models.items():
                evs = model.step(apply_truth=False)
                if not evs:
                    continue
                payloads = []
                for w in range(self.cfg.workers):
                    wevs = self._worker_view(evs) if self.cfg.workers > 1 else evs
                    payloads.append((self.publishers[(*key, w)].encode(wevs, ts), len(wevs)))
                step.append(PregeneratedBatch(key, payloads, [model.truth_view(e) for e in evs]))
                total += len(evs)
            self._pregenerated.append(step)
            steps += 1
        return steps

    def _publish_pregenerated(self, step: list["PregeneratedBatch"]) -> int:
        ts = restamp_prefix(time.time())
        n = 0
        for b in step:
            name, d = b.key
            for w, (payload, count) in enumerate(b.payloads):
                live = not (self.cfg.live_drop_rate and self.rng.random() < self.cfg.live_drop_rate)
                pub = self.publishers[(name, d, w)]
                pub.publish_payload(restamp(payload, ts), send_live=live)
                pub.last_events = count
            self.models[b.key].later(b.truth)
            n += len(b.truth)
            self._note_clear(name, d, b.truth)
        return n

    def publish_step(self) -> int:
        """One engine step for every (replica, dp rank): the next pregenerated one (:meth:`pregenerate`),
        else one generated now; returns events published."""
        if self._pregenerated:
            n = self._publish_pregenerated(self._pregenerated.popleft())
            self.steps += 1
            self.events += n
            return n
        n = 0
        ts = time.time()
        for (name, d), model in self.models.items():
            events = model.step()
            if events:  # vLLM publishes only non-empty batches
                self.publish_events(name, events, d, ts)
                n += len(events)
                self._note_clear(name, d, events)
        self.steps += 1
        self.events += n
        return n

    def serve(self, replica: str, tokens: list[int], dp_rank: int = 0) -> tuple[int, int]:
        """Outside-request mode: (replica, dp_rank) serves one request a router sent it
        (:meth:`CacheModel.admit`) and publishes the events as one batch; returns (leading blocks of
        ``tokens`` it reused from its GPU cache, events published)."""
        reused, events = self.models[(replica, dp_rank)].admit(tokens)
        if events:  # vLLM publishes only non-empty batches
            self.publish_events(replica, events, dp_rank)
            self.events += len(events)
        return reused, len(events)

    def clear_caches(self) -> None:
        """Reset every (replica, dp rank)'s prefix cache and publish its ``AllBlocksCleared``."""
        for (name, d), model in self.models.items():
            event = model.clear()
            self.publish_events(name, [event], d)
            self._note_clear(name, d, [event])

    def play(self, script: Iterable[ScriptBatch]) -> list[list[int]]:
        """Script mode: publish explicit batches in order (ground truth updated too)."""
        out = []
        for b in script:
            out.append(self.publish_events(b.replica, b.events, b.dp_rank, b.ts, b.send_live))
            model = self.models[(b.replica, b.dp_rank)]
            for e in b.events:
                model.truth.apply(project(self.cfg.format, e, raw_hashes=self.cfg.raw_hashes))
        return out

    def truth(self, replica: str, dp_rank: int = 0) -> Residency:
        """Ground truth of (replica, dp_rank)."""
        return self.models[(replica, dp_rank)].truth

    def manifest(self) -> dict[str, Any]:
        """JSON-able description: streams, and per replica/dp the prompts served and what is resident."""
        return {
            "format": self.cfg.format,
            "block_size": self.cfg.block_size,
            "hash_algo": self.cfg.model.hash_algo,
            "streams": [s.__dict__ for s in self.streams()],
            "replicas": {
                f"{name}#{d}": {"replica": name, "dp_rank": d, **m.manifest(),
                                "published": self.publishers[(name, d, 0)].published()}
                for (name, d), m in self.models.items()
            },
        }

    def write_manifest(self, path: str | os.PathLike) -> None:
        """Write :meth:`manifest` atomically."""
        p = Path(path)
        tmp = p.with_name(p.name + ".tmp")
        tmp.write_text(json.dumps(self.manifest()))
        tmp.replace(p)

    def publish_probe(self) -> tuple[bytes, str]:
        """Publish one freshness probe (:attr:`FleetConfig.probe_every`); returns (hash, holder).

        The probe is a BlockStored of one block with a fresh random hash on GPU, sent to the next
        (replica, dp rank) in turn like any engine batch (every worker stream, no drop/dup), and
        applied to the ground truth, so the view still equals the truth afterwards."""
        keys = list(self.models)
        name, d = keys[self._probe_turn % len(keys)]
        self._probe_turn += 1
        h = self._probe_rng.getrandbits(64).to_bytes(8, "big")
        bs = self.cfg.block_size
        event = BlockStored(block_hashes=[h], parent_block_hash=None, token_ids=[1] * bs, block_size=bs,
                            medium="GPU" if "medium" in wire_format(self.cfg.format).stored else None)
        for w in range(self.cfg.workers):
            self.publishers[(name, d, w)].publish([event])
        self.models[(name, d)].later([project(self.cfg.format, event, raw_hashes=self.cfg.raw_hashes)])
        if self.cfg.probe_keep:
            self._probes_out.append((h, name, d))
            if len(self._probes_out) > self.cfg.probe_keep:
                self._unprobe(*self._probes_out.popleft())
        holder = f"{name}#{d}"
        self._note({"probe": h.hex(), "holder": holder})
        return h, holder

    def _unprobe(self, h: bytes, name: str, d: int) -> None:
        """Remove probe block ``h`` from holder (``name``, ``d``) again, on every worker stream."""
        medium = "GPU" if "medium" in wire_format(self.cfg.format).removed else None
        event = BlockRemoved(block_hashes=[h], medium=medium)
        for w in range(self.cfg.workers):
            self.publishers[(name, d, w)].publish([event])
        self.models[(name, d)].later([project(self.cfg.format, event, raw_hashes=self.cfg.raw_hashes)])

    def _note_clear(self, name: str, d: int, events: Sequence[Event]) -> None:
        """Log that holder (``name``, ``d``) cleared its cache, if ``events`` (just published) hold an
        AllBlocksCleared: the probes it held are gone (a prober forgets those it has not seen)."""
        if any(isinstance(e, AllBlocksCleared) for e in events):
            self._note({"cleared": f"{name}#{d}"})

    def _note(self, record: dict[str, Any]) -> None:
        """Append one line to the probe log (if any), stamped with ``time.monotonic()``."""
        if self._probe_out is None:
            return
        record["t"] = time.monotonic()
        record["wall"] = time.time()
        record["events"] = self.events  # engine events published so far (probes not counted)
        self._probe_out.write(json.dumps(record) + "\n")
        self._probe_out.flush()

    def rungs(self) -> list[tuple[float, float, bool]]:
        """(rate, seconds, per_event) of every rung to play: the schedule (events/s of the fleet),
        or ``(rate, duration)`` (steps/s)."""
        if self.cfg.schedule:
            return [(rate, seconds, True) for rate, seconds in self.cfg.schedule]
        return [(self.cfg.rate, self.cfg.duration, False)]

    def run(self, stop: threading.Event | None = None) -> None:
        """Publish steps at each rung's rate (and probes every ``probe_every`` seconds) until the
        rungs are played or ``stop`` is set; a rung of 0 seconds lasts until ``stop``."""
        stop = stop or self._stop
        if self.cfg.probe_log:
            self._probe_out = open(self.cfg.probe_log, "a", encoding="utf-8")
        if self.cfg.pregenerate and self.cfg.schedule:
            t0 = time.monotonic()
            want = sum(rate * seconds for rate, seconds in self.cfg.schedule)
            steps = self.pregenerate(int(want))
            log.info("pregenerated %d steps (%d events) in %.1f s", steps, want, time.monotonic() - t0)
        last_manifest = time.monotonic()
        next_probe = time.monotonic()
        try:
            for i, (rate, seconds, per_event) in enumerate(self.rungs()):
                self._note({"rung": i, "rate": rate, "seconds": seconds})
                next_probe, last_manifest = self._run_rung(stop, rate, seconds, per_event, next_probe, last_manifest)
                if stop.is_set():
                    break
            self._note({"end": True})
        finally:
            if self._probe_out is not None:
                self._probe_out.close()
                self._probe_out = None
        if self.cfg.manifest:
            self.write_manifest(self.cfg.manifest)

    def _run_rung(self, stop: threading.Event, rate: float, seconds: float, per_event: bool,
                  next_probe: float, last_manifest: float) -> tuple[float, float]:
        """One rung: ``rate`` steps/s (``per_event``: events/s) for ``seconds`` (0: until ``stop``);
        returns (next probe time, last manifest time)."""
        period = 1.0 / rate if rate > 0 else 0.0
        probe_every = self.cfg.probe_every
        start = time.monotonic()
        next_step = start if rate > 0 else float("inf")
        while not stop.is_set():
            now = time.monotonic()
            if seconds and now - start >= seconds:
                break
            if probe_every and now >= next_probe:
                self.publish_probe()
                next_probe = max(next_probe + probe_every, now - 1.0)
            if now >= next_step:
                n = self.publish_step()
                next_step = max(next_step + period * (max(n, 1) if per_event else 1), now - 1.0)  # catch up <= 1 s
            if self.cfg.manifest and not self.cfg.pregenerate and now - last_manifest > 5.0:
                self.write_manifest(self.cfg.manifest)
                last_manifest = now
            wake = min(next_step, next_probe if probe_every else float("inf"))
            now = time.monotonic()
            if wake > now:
                stop.wait(min(wake - now, 0.05))
        return next_probe, last_manifest


# -- CLI ----------------------------------------------------------------------------

def add_fleet_args(p: argparse.ArgumentParser) -> None:
    """Options of ``kvbus fleet``."""
    p.add_argument("--replicas", type=int, default=3, help="engine replicas (default 3)")
    p.add_argument("--base-port", type=int, default=DEFAULT_BASE_PORT,
                   help="first port; stream k=(replica*dp_ranks+dp)*workers+worker uses base+2k (PUB) "
                        "and base+2k+1 (replay)")
    p.add_argument("--dp-ranks", type=int, default=1,
                   help="data-parallel ranks per replica, each its own stream (default 1)")
    p.add_argument("--workers", type=int, default=1,
                   help="tensor-parallel workers per (replica, dp), each its own stream reporting the same events")
    p.add_argument("--drop-rate", type=float, default=0.0, help="chance a worker omits one event report (workers > 1)")
    p.add_argument("--dup-rate", type=float, default=0.0, help="chance a worker reports one event twice (workers > 1)")
    p.add_argument("--live-drop-rate", type=float, default=0.0,
                   help="chance a batch is only kept for replay, not sent live")
    p.add_argument("--format", default=DEFAULT_FORMAT, choices=FORMATS,
                   help=f"engine wire format (default {DEFAULT_FORMAT})")
    p.add_argument("--seed", type=int, default=0, help="random seed (deterministic content)")
    p.add_argument("--rate", type=float, default=10.0, help="batches per second per replica (default 10)")
    p.add_argument("--duration", type=float, default=0.0, help="seconds to run; 0 = until SIGTERM/SIGINT")
    p.add_argument("--block-size", type=int, default=16, help="tokens per block (default 16)")
    p.add_argument("--replica-prefix", default="replica-", help="replica ids are <prefix><i> (default replica-)")
    p.add_argument("--manifest", default=None, help="write a JSON manifest (prompts served, residency) to this path")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--topic", default="", help="ZMQ topic frame (default '')")
    p.add_argument("--buffer-steps", type=int, default=10_000, help="replay buffer size in batches (default 10000)")
    p.add_argument("--gpu-blocks", type=int, default=2048, help="GPU prefix-cache blocks per replica (default 2048)")
    p.add_argument("--cpu-rate", type=float, default=0.2, help="share of prompts offloaded to CPU (default 0.2)")
    p.add_argument("--kvcr-rate", type=float, default=0.05,
                   help="share of prompts stored in the kvcr tier (default 0.05)")
    p.add_argument("--clear-rate", type=float, default=0.0005,
                   help="chance per step of AllBlocksCleared (default 0.0005)")
    p.add_argument("--raw-hashes", action="store_true",
                   help="send digests as bytes (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0)")
    p.add_argument("--schedule", type=parse_schedule, default=(),
                   help="load ladder EVENTS_PER_S:SECONDS,... (engine events/s of the whole fleet for so many "
                        "seconds, in order); replaces --rate and --duration")
    p.add_argument("--probe-every", type=float, default=0.0,
                   help="seconds between freshness probes, one fresh block each (0 = none; default 0)")
    p.add_argument("--probe-keep", type=int, default=0,
                   help="probes left cached: the oldest beyond this many is removed again (0 = keep all; default 0)")
    p.add_argument("--probe-log", default=None, help="append probes and rung starts to this file as JSON lines")
    p.add_argument("--pregenerate", action="store_true",
                   help="generate and encode the whole --schedule before playing it, then play the encoded "
                        "frames (a generator that costs little CPU while it plays; the manifest is written at the end)")


def parse_schedule(text: str) -> tuple[tuple[float, float], ...]:
    """``"2000:10,0:5"`` -> ((2000.0, 10.0), (0.0, 5.0)): (fleet events/s, seconds) rungs."""
    rungs = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        rate, sep, seconds = part.partition(":")
        try:
            rungs.append((float(rate), float(seconds)))
        except ValueError:
            raise argparse.ArgumentTypeError(f"rung {part!r} is not RATE:SECONDS") from None
        if not sep or rungs[-1][0] < 0 or rungs[-1][1] <= 0:
            raise argparse.ArgumentTypeError(f"rung {part!r}: RATE >= 0 and SECONDS > 0 required")
    return tuple(rungs)


def config_from_args(args: argparse.Namespace) -> FleetConfig:
    """FleetConfig from parsed ``kvbus fleet`` options."""
    model = ModelConfig(gpu_blocks=args.gpu_blocks, cpu_rate=args.cpu_rate, kvcr_rate=args.kvcr_rate,
                        clear_rate=args.clear_rate)
    return FleetConfig(
        replicas=args.replicas, base_port=args.base_port, dp_ranks=args.dp_ranks, workers=args.workers,
        drop_rate=args.drop_rate, dup_rate=args.dup_rate, live_drop_rate=args.live_drop_rate, format=args.format,
        seed=args.seed, rate=args.rate, duration=args.duration, block_size=args.block_size,
        replica_prefix=args.replica_prefix, manifest=args.manifest, host=args.host, topic=args.topic,
        buffer_steps=args.buffer_steps, raw_hashes=args.raw_hashes, model=model,
        schedule=args.schedule, probe_every=args.probe_every, probe_keep=args.probe_keep,
        probe_log=args.probe_log, pregenerate=args.pregenerate,
    )


def run_fleet(args: argparse.Namespace, settings: Any = None) -> int:
    """Run ``kvbus fleet`` until ``--duration`` or SIGTERM/SIGINT."""
    cfg = config_from_args(args)
    fleet = Fleet(cfg)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    fleet.start()
    for s in fleet.streams():
        log.info("stream %s#%d worker %d: PUB %s replay %s", s.replica, s.dp_rank, s.worker_rank,
                 s.endpoint, s.replay_endpoint)
    try:
        fleet.run(stop)
    finally:
        fleet.stop()
        published = sum(p.next_seq for p in fleet.publishers.values())
        log.info("fleet stopped after %d steps, %d batches", fleet.steps, published)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kvbus.simulator.fleet ...`` (same options as ``kvbus fleet``)."""
    p = argparse.ArgumentParser(prog="kvbus-fleet", description=__doc__.splitlines()[0])
    add_fleet_args(p)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run_fleet(args)


if __name__ == "__main__":
    raise SystemExit(main())
