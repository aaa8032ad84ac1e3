"""Rebuilding a lost view, and telling routers while it happens.

A view is identified by its id (``P meta vid``). A view without one was never created or is lost
(Redis restarted without persistence, ``FLUSHALL``, a new or failed-over server that never had it),
or a sink dropped its id (Redis evicted some of its keys; a block topic's log ends before the
offset the view stores: sinks/consumer.py):
the first sink to see that takes the rebuild lock (``P lock``) and

1. writes ``P status`` state ``rebuilding`` (routers read it: ``ResidencyStore.status``);
2. deletes what is left under the prefix (a partial view);
3. restores every holder of the latest complete snapshot (sinks/snapshot.py) and stores the
   snapshot's offsets in ``P off`` (but none past its partition's end: a recreated or truncated
   topic is replayed from its start, :func:`replay_from`); with no snapshot the view starts empty
   and the offsets at the start of the block topics;
4. gives the view a new id.

The sinks then replay the block topics from ``P off`` (sinks/consumer.py); the stored positions
skip what the snapshot already contains.

A view whose shards lost it while the others kept it (a Redis Cluster view, one master lost with
its replica) is rebuilt in those shards only (``ResidencyStore.lost_shards``): only they are
wiped, get the snapshot's holders of theirs and its offsets, and take the id the others kept; the
sinks' replay from the minimum offsets over shards is skipped by positions in the shards that kept
their data. The view is ``ready`` again once ``P off`` has reached the
end offsets the block topics had when the rebuild began (``target`` in ``P status``): any sink that
sees this marks it (:func:`mark_ready_if_caught_up`). Other sinks wait for the new id.
"""
from __future__ import annotations

import json
import logging
import time
import uuid
from typing import TYPE_CHECKING, Any, Callable

from kvbus.schemas import view_keys
from kvbus.schemas.lookup import READY, REBUILDING  # noqa: F401  (the states routers read)
from kvbus.sinks.view.store import ResidencyStore

if TYPE_CHECKING:  # the snapshot reader needs confluent-kafka: its type only, imported where it runs
    from kvbus.sinks.snapshot import SnapshotReader

log = logging.getLogger("kvbus.sinks")

LOCK = view_keys.LOCK.name
"""The rebuild lock's name (``P lock``)."""
LOCK_TTL_MS = 600_000
"""How long the rebuild lock is held at most (a sink killed while rebuilding frees it then)."""


def ensure_view(store: ResidencyStore, reader: SnapshotReader, end_offsets: Callable[[], dict[tuple[str, int], int]],
                metrics=None, poll: float = 0.2) -> str:
    """The id of the view under ``store``'s prefix, rebuilding the view first if it has none.

    ``end_offsets``: the block topics' end offsets now, (topic, partition) -> offset (the target of
    the replay that follows a rebuild)."""
    token = uuid.uuid4().hex
    while True:
        vid = store.view_id()
        if vid is not None:
            return vid
        if store.try_lock(LOCK, token, LOCK_TTL_MS):
            try:
                return rebuild(store, reader, end_offsets, metrics)
            finally:
                store.unlock(LOCK, token)
        time.sleep(poll)  # another sink is rebuilding


def rebuild(store: ResidencyStore, reader: SnapshotReader, end_offsets: Callable[[], dict[tuple[str, int], int]],
            metrics=None) -> str:
    """Rebuild the view from the latest snapshot (see the module docstring); returns its new id."""
    from kvbus.sinks.snapshot import holder_dump  # confluent-kafka: imported by the sink only

    t0, began = time.monotonic(), time.time()
    store.set_status(state=REBUILDING, since=began, phase="restoring")
    if metrics is not None:
        metrics.rebuilding.set(1)
    ends = end_offsets()
    target = {f"{t}:{p}": o for (t, p), o in ends.items() if o > 0}
    lost = store.lost_shards()  # a view that lost some shards only: rebuild just those
    keep_vid, only = (lost.view_id, lost.shards) if lost else (None, None)
    if lost:
        log.warning("shards %s of the view lost it (the others keep view %s): rebuilding those shards only",
                    only, keep_vid)
    t1 = time.monotonic()
    wiped = store.wipe(shards=only)
    t2 = time.monotonic()
    manifest, holders = reader.read()
    read_in = time.monotonic() - t2
    log.info("rebuild: end offsets in %.3f s, wipe in %.3f s, snapshot read in %.3f s", t1 - t0, t2 - t1, read_in)
    restored = entries = 0
    if manifest is not None:
        missing = [n for n in manifest.holders if n not in holders or holders[n].snapshot < manifest.snapshot]
        if missing:  # a holder state older than the manifest's offsets: replaying from them would miss events
            log.error("snapshot %d is incomplete (%d holders without a record of it, e.g. %s): rebuilding by "
                      "replaying the block topics from their start instead", manifest.snapshot, len(missing),
                      missing[0])
            manifest = None
    if manifest is not None:
        for name in manifest.holders:
            rec = holders[name]
            if only is not None and store.shard(rec.replica, rec.dp_rank) not in only:
                continue  # its shard kept its data
            entries += store.restore_holder(rec.replica, rec.dp_rank, holder_dump(rec))
            restored += 1
        store.set_offsets(replay_from(manifest, ends), shards=only)
    vid = keep_vid or uuid.uuid4().hex
    store.set_view_id(vid, shards=only)
    took = time.monotonic() - t0
    store.set_status(state=REBUILDING, since=began, phase="replaying", snapshot=manifest.snapshot if manifest else "",
                     holders=restored, entries=entries, restored_in=f"{took:.3f}", read_in=f"{read_in:.3f}",
                     target=json.dumps(target))
    if manifest is not None:
        log.warning("view %s rebuilt from snapshot %d: %d holders, %d entries restored in %.1f s (snapshot read "
                    "in %.1f s; %d keys of a partial view deleted); replaying the block topics from the "
                    "snapshot's offsets", vid, manifest.snapshot, restored, entries, took, read_in, wiped)
    else:
        log.warning("view %s created (no snapshot: the block topics are read from their start; %d keys of a "
                    "partial view deleted)", vid, wiped)
    if metrics is not None:
        metrics.rebuilds.inc()
    return vid


def replay_from(manifest: Any, ends: dict[tuple[str, int], int]) -> dict[tuple[str, int], int]:
    """Where the replay after restoring ``manifest`` starts: the snapshot's offsets, except those
    past their partition's end now (``ends``): that log is not the one the snapshot was taken of
    (the topic was deleted and recreated, or truncated), so the partition is replayed from its start
    (no offset stored); the positions the holders carry skip what the snapshot already has."""
    out, past = {}, []
    for o in manifest.offsets:
        tp = (o.topic, o.partition)
        if tp in ends and o.offset > ends[tp]:
            past.append(f"{o.topic}[{o.partition}] at {o.offset} > {ends[tp]}")
        else:
            out[tp] = o.offset
    if past:
        log.warning("snapshot %d: offsets past the end of their partition (%s): those are replayed from their start",
                    manifest.snapshot, ", ".join(past))
    return out


def mark_ready_if_caught_up(store: ResidencyStore, metrics=None) -> bool:
    """If the view is rebuilding and its offsets reached the target, mark it ready; returns whether
    the view is ready."""
    st = store.status()
    if st.get("state", READY) != REBUILDING:
        return True
    if st.get("phase") != "replaying":
        return False
    target = json.loads(st.get("target") or "{}")
    off = {f"{t}:{p}": o for (t, p), o in store.offsets().items()}
    if any(off.get(k, 0) < o for k, o in target.items()):
        return False
    took = time.time() - float(st.get("since", time.time()))
    store.set_status(state=READY, since=time.time(), rebuilt_in=f"{took:.3f}", snapshot=st.get("snapshot", ""))
    log.warning("view ready again: rebuilt and replayed in %.1f s", took)
    if metrics is not None:
        metrics.rebuilding.set(0)
        metrics.rebuild_seconds.set(took)
    return True
