"""Random event histories for the sink's tests: plausible multi-holder streams, and Kafka-like
redelivery of them."""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Iterator, Sequence

from kvbus.schemas.events import AllBlocksCleared, BlockEvent, BlockRemoved, BlockStored, Reset, canonical_hash
from kvbus.schemas.topics import Topics


@dataclass
class _Publisher:
    replica: str
    dp_rank: int
    epoch: int
    seq: int = 0
    held: dict[str, set[bytes]] = field(default_factory=dict)
    model: str | None = None


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
    models: Sequence[str | None] = (),
) -> list[tuple[str, BlockEvent]]:
    """A plausible multi-holder event history in canonical order, as ``(topic, event)``.

    Stores and removes on GPU (set tier), CPU (ref-counted, hashes repeated as OffloadingConnector
    does), a KV group 1 tier and ownership tiers (on their own topic); full-mode re-stores;
    AllBlocksCleared; engine restarts (Reset markers on every topic, then a new epoch). Hashes come
    from a small pool so holders share blocks. Positions grow per (holder, topic). ``models``: the
    events name one of them, drawn per holder at its start and again at each engine restart (none:
    no model).
    """
    rng = random.Random(seed)
    hashes = [canonical_hash(rng.getrandbits(64)) for _ in range(pool)]
    pubs = [_Publisher(f"r{i // 2}", i % 2, epoch=1_000 + i) for i in range(holders)]
    for p in pubs:
        p.model = rng.choice(models) if models else None
    out: list[tuple[str, BlockEvent]] = []
    for _ in range(batches):
        p = rng.choice(pubs)
        ts = 1_700_000_000.0 + len(out)
        if rng.random() < restart:  # engine restart: reset markers first, then a new epoch from seq 0
            p.epoch += rng.randint(1, 1000)
            p.seq = 0
            p.model = rng.choice(models) if models else None
            for topic in [topics.blocks] + [topics.for_ownership(o) for o in ownerships]:
                out.append((topic, BlockEvent(replica=p.replica, dp_rank=p.dp_rank, epoch=p.epoch, seq=-1, index=0,
                                              ts=ts, event=Reset(reason="engine-restart"), model=p.model)))
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
                if held and rng.random() < 0.9:
                    victims = rng.sample(held, min(len(held), rng.randint(1, max(2, max_chain // 3))))
                else:
                    victims = [rng.choice(hashes)]
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
                                          index=index, ts=ts, event=ev, model=p.model)))
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


def growing_streams(topics: Topics, *, holders: int = 8, events: int = 400, per: int = 8,
                    remove_every: int = 5) -> list[tuple[str, BlockEvent]]:
    """A history whose view keeps growing (what fills a Redis up): holder ``r<h>`` stores ``per`` new
    blocks on GPU per event and, every ``remove_every``-th event, removes the first block of the event
    before; holders interleaved, each in position order."""
    out: list[tuple[str, BlockEvent]] = []
    for s in range(events):
        for h in range(holders):
            base = (h * events + s) * per
            hashes = [canonical_hash(base + j) for j in range(per)]
            out.append((topics.blocks, BlockEvent(replica=f"r{h}", epoch=1, seq=2 * s, index=0, ts=1.0 + s,
                                                  event=BlockStored(block_hashes=hashes, medium="GPU"))))
            if s and s % remove_every == 0:
                gone = [canonical_hash(base - per)]
                out.append((topics.blocks, BlockEvent(replica=f"r{h}", epoch=1, seq=2 * s + 1, index=0, ts=1.0 + s,
                                                      event=BlockRemoved(block_hashes=gone, medium="GPU"))))
    return out
