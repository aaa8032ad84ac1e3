"""Test and benchmark helpers of the sinks stage: a private redis-server, and random event streams.

Not used by the running sink.
"""
from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import redis

from schemas.events import AllBlocksCleared, BlockEvent, BlockRemoved, BlockStored, Reset, canonical_hash
from schemas.topics import Topics

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"


def free_port() -> int:
    """A free loopback TCP port (bind to port 0)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A throw-away ``redis-server`` on a free loopback port, no persistence, in a temp dir.

    Use as a context manager; ``url`` is its URL. ``args`` are extra server arguments
    (e.g. ``["--maxmemory", "4gb"]``, ``["--replicaof", "127.0.0.1", "6379"]``).
    """

    def __init__(self, args: Sequence[str] = ()):
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="kvbus-redis-")
        self.args = list(args)
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self, **kw) -> redis.Redis:
        """A client of this server."""
        return redis.Redis(host="127.0.0.1", port=self.port, **kw)

    def start(self) -> "RedisServer":
        cmd = [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
               "--dir", self.dir, "--logfile", os.path.join(self.dir, "redis.log"), *self.args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 10
        while True:
            try:
                if self.client().ping():
                    return self
            except redis.ConnectionError:
                if self.proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError(f"redis-server did not start: {cmd}")
                time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL the server, keeping its directory (``start`` again restarts it on the same port,
        loading whatever it persisted there: an RDB saved with SAVE, an AOF)."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "RedisServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# ---------------------------------------------------------------------- random streams


@dataclass
class _Publisher:
    replica: str
    dp_rank: int
    epoch: int
    seq: int = 0
    held: dict[str, set[bytes]] = field(default_factory=dict)


def random_streams(
    seed: int,
    topics: Topics,
    *,
    holders: int = 4,
    batches: int = 120,
    pool: int = 40,
    ownerships: Sequence[str] = ("kvcr",),
    max_chain: int = 6,
    restart: float = 0.05,
) -> list[tuple[str, BlockEvent]]:
    """A plausible multi-holder event history in canonical order, as ``(topic, event)``.

    Stores and removes on GPU (set tier), CPU (ref-counted, hashes repeated as OffloadingConnector
    does), a KV group 1 tier and ownership tiers (on their own topic); full-mode re-stores;
    AllBlocksCleared; engine restarts (Reset markers on every topic, then a new epoch). Hashes come
    from a small pool so holders share blocks. Positions grow per (holder, topic).
    """
    rng = random.Random(seed)
    hashes = [canonical_hash(rng.getrandbits(64)) for _ in range(pool)]
    pubs = [_Publisher(f"r{i // 2}", i % 2, epoch=1_000 + i) for i in range(holders)]
    out: list[tuple[str, BlockEvent]] = []
    for _ in range(batches):
        p = rng.choice(pubs)
        ts = 1_700_000_000.0 + len(out)
        if rng.random() < restart:  # engine restart: reset markers first, then a new epoch from seq 0
            p.epoch += rng.randint(1, 1000)
            p.seq = 0
            for topic in [topics.blocks] + [topics.for_ownership(o) for o in ownerships]:
                out.append((topic, BlockEvent(replica=p.replica, dp_rank=p.dp_rank, epoch=p.epoch, seq=-1, index=0,
                                              ts=ts, event=Reset(reason="engine-restart"))))
            p.held.clear()
            continue
        events: list[tuple[str, object]] = []
        for _ in range(rng.randint(1, 4)):
            x = rng.random()
            medium, ownership, group = rng.choice(
                [("GPU", None, 0), ("GPU", None, 0), ("CPU", None, 0), ("GPU", None, 1), ("CPU", "kvcr", 0)]
            )
            if ownership and ownership not in ownerships:
                ownership = None
            key = f"{medium}|{ownership}|{group}"
            topic = topics.for_ownership(ownership)
            if x < 0.5:
                start = rng.randrange(pool)
                chain = hashes[start:start + rng.randint(1, max_chain)]
                if medium == "CPU" and rng.random() < 0.5:
                    chain = chain + chain[:1]  # once per chunk: a repeated hash
                events.append((topic, BlockStored(block_hashes=chain, medium=medium, ownership=ownership,
                                                  group_idx=group, block_size=16)))
                p.held.setdefault(key, set()).update(chain)
            elif x < 0.85:
                held = sorted(p.held.get(key, ()))
                victims = rng.sample(held, min(len(held), rng.randint(1, max(2, max_chain // 3)))) if held and rng.random() < 0.9 else \
                    [rng.choice(hashes)]
                events.append((topic, BlockRemoved(block_hashes=victims, medium=medium, ownership=ownership,
                                                   group_idx=group)))
            elif x < 0.95:  # full-mode re-announcement of a held prefix
                held = sorted(p.held.get("GPU|None|0", ()))
                if held:
                    events.append((topics.blocks, BlockStored(block_hashes=held[:4], medium="GPU", group_idx=0)))
            else:
                events.append((topics.blocks, AllBlocksCleared()))
                for k in [k for k in p.held if "|None|" in k]:
                    del p.held[k]
        for index, (topic, ev) in enumerate(events):
            out.append((topic, BlockEvent(replica=p.replica, dp_rank=p.dp_rank, epoch=p.epoch, seq=p.seq,
                                          index=index, ts=ts, event=ev)))
        p.seq += 1
    return out


def redeliver(
    records: list[tuple[str, BlockEvent]], seed: int, *, dup: float = 0.2, max_batch: int = 12
) -> Iterator[list[tuple[str, BlockEvent]]]:
    """Deliver ``records`` at least once, as Kafka could: a random interleaving of the per-(holder,
    topic) streams (each in order), cut into batches, with random rewinds that deliver an already
    delivered suffix of a stream again."""
    rng = random.Random(seed)
    streams: dict[tuple[str, str, int], list[tuple[str, BlockEvent]]] = {}
    for topic, ev in records:
        streams.setdefault((topic, ev.replica, ev.dp_rank), []).append((topic, ev))
    cursor = {k: 0 for k in streams}
    batch: list[tuple[str, BlockEvent]] = []
    while any(cursor[k] < len(v) for k, v in streams.items()):
        k = rng.choice([k for k, v in streams.items() if cursor[k] < len(v)])
        if cursor[k] > 0 and rng.random() < dup:
            cursor[k] = max(0, cursor[k] - rng.randint(1, 5))
        n = rng.randint(1, 4)
        batch.extend(streams[k][cursor[k]:cursor[k] + n])
        cursor[k] += n
        if len(batch) >= rng.randint(1, max_batch):
            yield batch
            batch = []
    if batch:
        yield batch


# ---------------------------------------------------------------------- fleet workload (benchmarks)


@dataclass
class FleetStore:
    """One BlockStored of the fleet workload: ``replica`` stored ``hashes`` on ``medium``."""

    replica: int
    medium: str
    hashes: list[bytes]


def fleet_workload(
    entries: int,
    *,
    replicas: int = 256,
    copies: int = 1,
    cpu_frac: float = 0.5,
    prompts: int = 64,
    seed: int = 0,
    sample_chains: int = 4000,
    min_chain: int = 128,
) -> tuple[Iterator[FleetStore], list[list[bytes]], list[list[bytes]]]:
    """A fleet's residency built from conversations, until about ``entries`` (replica, block, tier) entries.

    Each conversation is one of ``prompts`` shared system prompts (8-32 blocks) followed by its own
    8-224 blocks, cached on ``copies`` random replicas: on GPU, and with probability ``cpu_frac`` also
    on CPU (offloaded). A replica stores a system prompt once per tier (later conversations hit it),
    so prompt blocks end up shared by most replicas and conversation blocks by ``copies`` of them.

    Returns (the stores, lazily generated and deterministic for a seed; up to ``sample_chains``
    conversation chains of at least ``min_chain`` blocks starting with their system prompt, and as
    many conversation bodies of at least ``min_chain`` blocks (no shared prefix); both filled while
    the stores are consumed).
    """
    rng = random.Random(seed)
    chains: list[list[bytes]] = []
    bodies: list[list[bytes]] = []

    def h() -> bytes:
        return rng.getrandbits(64).to_bytes(8, "big")

    prompt_chains = [[h() for _ in range(rng.randint(8, 32))] for _ in range(prompts)]

    def gen() -> Iterator[FleetStore]:
        have: set[tuple[int, int, str]] = set()
        total = 0
        seen_long = 0
        while total < entries:
            p = rng.randrange(prompts)
            body = [h() for _ in range(rng.randint(8, 224))]
            chain = prompt_chains[p] + body
            if len(chain) >= min_chain:
                seen_long += 1
                if len(chains) < sample_chains:
                    chains.append(chain)
                elif rng.random() < sample_chains / seen_long:
                    chains[rng.randrange(sample_chains)] = chain
            if len(body) >= min_chain and len(bodies) < sample_chains:
                bodies.append(body)
            for r in rng.sample(range(replicas), copies):
                for medium in ("GPU", "CPU") if rng.random() < cpu_frac else ("GPU",):
                    hashes = body if (r, p, medium) in have else chain
                    have.add((r, p, medium))
                    total += len(hashes)
                    yield FleetStore(r, medium, hashes)

    return gen(), chains, bodies
