"""Snapshots of the residency view to Kafka (topic ``kvbus.snapshots``), and reading them back.

Why: the view must be rebuildable without waiting for engines, and without needing the block
topics' whole history (the blocks a replica holds now may have been stored days ago, beyond
``retention.ms``). A snapshot saves the view in Kafka itself, the way Kafka Streams backs a state
store with a compacted changelog topic:

* it reads the view's stored offsets ``O`` first (``P off``: where the view stands in each block
  topic partition, written atomically with the applies), then each holder's whole state, atomically
  per holder (``kvbus_dump``: positions, reset floor, model, blocks per tier, reference counts);
* it writes one record per holder (key: the view's prefix and block topic, ``<replica>#<dp_rank>``;
  :func:`record_key`), then a manifest (the same key without a holder) with ``O`` and the holders'
  names;
* the topic is compacted: it keeps the latest record per key, so it holds one snapshot, however long
  the service runs.

Every holder state was read after ``O``, so it contains everything up to ``O`` and maybe more; a view
rebuilt from the manifest's holders and replayed from ``O`` is exact: the stored positions skip
what a holder state already contains (sinks/rebuild.py). A snapshot is abandoned (no manifest) if
the view changed identity or Redis restarted while it was read. The block topics then only need
to retain more than one snapshot period.
"""
from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Mapping

import redis
from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import AdminClient

from kvbus.runtime.kafka_clients import DeliveryErrors, client_conf, ensure_topics, producer_conf, reader_conf
from kvbus.runtime.settings import Settings
from kvbus.schemas import view_keys
from kvbus.schemas.events import ViewGroup, ViewOffset, ViewPosition, ViewSnapshot, ViewTier
from kvbus.schemas.serde import RecordSerde, registry_client
from kvbus.schemas.topics import (
    REBUILD_GROUP_PREFIX,
    SNAPSHOT_MAX_MESSAGE_BYTES,
    SNAPSHOT_MAX_RECORD_BYTES,
    snapshot_spec,
)
from kvbus.sinks.view.store import HolderDump, ResidencyStore

log = logging.getLogger("kvbus.sinks")

def record_key(prefix: str, blocks: str, holder: str | None) -> bytes:
    """Key of a snapshot record in ``kvbus.snapshots``: the view's Redis key prefix, NUL, its block
    topic, NUL, then the holder name (``<replica>#<dp_rank>``), or nothing for the manifest. Several
    views (prefixes, deployments with other topic names) can share the topic."""
    return f"{prefix}\0{blocks}\0{holder or ''}".encode()
LOCK = view_keys.SNAPSHOT_LOCK.name
"""The snapshot lock's name (``P snaplock``)."""
LOCK_MS = 3_600_000
"""How long the snapshot lock is held at most while a snapshot is written (a sink killed while
writing one frees it then)."""
MAX_RECORD_BYTES = SNAPSHOT_MAX_RECORD_BYTES
"""Largest snapshot record: one holder's state (8 bytes per block and tier: 8 M blocks)."""


def ensure_snapshot_topic(kafka: str | Mapping[str, Any], topic: str) -> None:
    """Create the snapshot topic if it is missing, as declared (:func:`kvbus.schemas.topics.snapshot_spec`:
    one partition, compacted, records up to :data:`MAX_RECORD_BYTES`), replicated like the cluster
    allows (RF 3, min ISR 2). ``kafka``: a bootstrap string or ``Settings.kafka()``."""
    admin = AdminClient(client_conf(kafka))
    md = admin.list_topics(timeout=10)
    if topic not in md.topics:
        ensure_topics(admin, [snapshot_spec(topic, min(3, len(md.brokers)))])


def holder_record(snapshot: int, name: str, dump: HolderDump) -> ViewSnapshot:
    """The snapshot record of one holder."""
    replica, _, dp = name.rpartition("#")
    return ViewSnapshot(
        snapshot=snapshot, taken=time.time(), holder=name, replica=replica, dp_rank=int(dp), seen=dump.seen,
        floor=dump.floor, model=dump.model,
        positions=[ViewPosition(topic=t, epoch=e, seq=s, index=i) for t, e, s, i in dump.positions],
        tiers=[ViewTier(descriptor=d, refcounted=rc, origin=o, blocks=raws, extra=extra)
               for d, rc, o, raws, extra in dump.tiers],
        groups=[ViewGroup(group=g, spec=spec) for g, spec in dump.groups],
    )


def holder_dump(rec: ViewSnapshot) -> HolderDump:
    """The state a holder record saved, as :meth:`ResidencyStore.restore_holder` takes it."""
    return HolderDump(seen=rec.seen, floor=rec.floor,
                      positions=[(p.topic, p.epoch, p.seq, p.index) for p in rec.positions],
                      tiers=[(t.descriptor, t.refcounted, t.origin, t.blocks, t.extra) for t in rec.tiers],
                      model=rec.model,
                      groups=[(g.group, g.spec) for g in rec.groups])


@dataclass
class SnapshotStats:
    """What one snapshot wrote."""

    snapshot: int
    """Its id (epoch ms when it began)."""
    holders: int
    entries: int
    """(holder, block, tier) entries saved (reference counts not counted)."""
    bytes: int
    """Record bytes written."""
    seconds: float


class SnapshotAbandoned(RuntimeError):
    """The view changed while it was read: no manifest was written; the previous snapshot stands."""


class SnapshotWriter:
    """Writes snapshots of ``store`` to ``settings.topics.snapshots``."""

    def __init__(self, settings: Settings, store: ResidencyStore):
        self.store = store
        self.topic = settings.topics.snapshots
        self.blocks = settings.topics.blocks
        ensure_snapshot_topic(settings.kafka(), self.topic)
        self.serde = RecordSerde(registry_client(settings), "ViewSnapshot")
        kafka = settings.kafka()
        self.errors = DeliveryErrors(kafka, log, "snapshot: ")
        role = {"linger.ms": 20, "message.max.bytes": SNAPSHOT_MAX_MESSAGE_BYTES}
        self.producer = Producer(producer_conf(kafka, role, error_cb=self.errors.error_cb))
        self._previous: set[str] = set()

    def _identity(self) -> tuple[str | None, str]:
        """(view id, the servers' identity): a snapshot read across a change of either is not consistent."""
        return self.store.view_id(), self.store.identity()

    def take(self) -> SnapshotStats:
        """Write one snapshot; :class:`SnapshotAbandoned` if the view changed meanwhile."""
        t0 = time.monotonic()
        sid = int(time.time() * 1000)
        before = self._identity()
        if before[0] is None:
            raise SnapshotAbandoned("no view to snapshot (it is being rebuilt)")
        offsets = self.store.offsets()
        names, entries, size = [], 0, 0
        for hid, name in sorted(self.store.holder_ids().items()):
            rec = holder_record(sid, name, self.store.dump_holder(hid))
            value = self.serde.dumps(rec, self.topic)
            self._produce(record_key(self.store.prefix, self.blocks, name), value)
            names.append(name)
            entries += sum(len(t.blocks) // 8 for t in rec.tiers)
            size += len(value)
        self._flush()
        if self._identity() != before:
            raise SnapshotAbandoned("the view was rebuilt or Redis restarted while the snapshot was read")
        manifest = ViewSnapshot(snapshot=sid, taken=time.time(), holders=names,
                                offsets=[ViewOffset(topic=t, partition=p, offset=o)
                                         for (t, p), o in sorted(offsets.items())])
        self._produce(record_key(self.store.prefix, self.blocks, None), self.serde.dumps(manifest, self.topic))
        for gone in self._previous - set(names):
            # a tombstone: compaction forgets the holder
            self._produce(record_key(self.store.prefix, self.blocks, gone), None)
        self._flush()
        self._previous = set(names)
        return SnapshotStats(sid, len(names), entries, size, time.monotonic() - t0)

    def _produce(self, key: bytes, value: bytes | None) -> None:
        while True:
            try:
                self.producer.produce(self.topic, key=key, value=value, on_delivery=self.errors.on_delivery)
                self.producer.poll(0)
                return
            except BufferError:
                self.producer.poll(0.1)

    def _flush(self) -> None:
        self.errors.raise_if_undelivered("snapshot records", self.producer.flush(60))


class Snapshotter(threading.Thread):
    """Takes a snapshot every ``every`` seconds, in the background of a sink.

    Every sink runs one; a Redis lock (``P snaplock``, held for ``every`` seconds) lets one of them
    take each snapshot. ``metrics``: the sink's (``kvbus_sink_snapshot*``)."""

    def __init__(self, settings: Settings, store: ResidencyStore, every: float, metrics: Any = None):
        super().__init__(name="kvbus-snapshotter", daemon=True)
        self.settings, self.store, self.every, self.metrics = settings, store, every, metrics
        self.stop = threading.Event()
        self._token = uuid.uuid4().hex

    def run(self) -> None:
        writer = None
        while not self.stop.wait(self.every):
            try:
                # held while this snapshot is written (two writers interleaving their records could
                # leave a holder record older than the manifest), then for the rest of the period
                if not self.store.try_lock(LOCK, self._token, LOCK_MS):
                    continue
                writer = writer or SnapshotWriter(self.settings, self.store)
                stats = writer.take()
                self.store.renew_lock(LOCK, self._token, int(self.every * 1000 * 0.9))
                log.info("snapshot %d: %d holders, %d entries, %.1f MB in %.1f s", stats.snapshot, stats.holders,
                         stats.entries, stats.bytes / 1e6, stats.seconds)
                if self.metrics is not None:
                    self.metrics.snapshot_taken(stats.seconds, stats.snapshot / 1000)
            except SnapshotAbandoned as e:
                log.warning("snapshot abandoned: %s", e)
            except (redis.RedisError, KafkaException, OSError) as e:
                log.warning("snapshot failed, retried in %.0f s: %s", self.every, e)
            except Exception:  # a snapshot must never stop the sink
                log.exception("snapshot failed")


class SnapshotReader:
    """Reads the latest complete snapshot of the view under ``prefix`` from ``settings.topics.snapshots``."""

    def __init__(self, settings: Settings, prefix: str):
        self.settings = settings
        self.topic = settings.topics.snapshots
        self.prefix = prefix

    def read(self, timeout: float = 120.0) -> tuple[ViewSnapshot | None, dict[str, ViewSnapshot]]:
        """(the latest manifest or None, holder name -> its latest record): the topic read from its
        start to its end as it is now, later records replacing earlier ones (as compaction will)."""
        c = Consumer(reader_conf(self.settings.kafka(), REBUILD_GROUP_PREFIX, {
            "enable.partition.eof": True, "receive.message.max.bytes": 2 * MAX_RECORD_BYTES,
            "fetch.max.bytes": SNAPSHOT_MAX_MESSAGE_BYTES}))
        try:
            md = c.list_topics(self.topic, timeout=10)
            tmeta = md.topics.get(self.topic)
            if tmeta is None or tmeta.error is not None or not tmeta.partitions:
                return None, {}
            low, high = c.get_watermark_offsets(TopicPartition(self.topic, 0), timeout=10)
            if high <= low:
                return None, {}
            serde = RecordSerde(registry_client(self.settings), "ViewSnapshot", auto_register=False)
            c.assign([TopicPartition(self.topic, 0, OFFSET_BEGINNING)])
            latest: dict[bytes, bytes | None] = {}  # holder name (b"": the manifest) -> value
            mine = record_key(self.prefix, self.settings.topics.blocks, None)
            deadline = time.monotonic() + timeout
            done = False
            while not done:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"reading {self.topic} took more than {timeout:.0f} s")
                first = c.poll(1.0)  # consume(n, t) would wait t whenever fewer than n records are left
                for m in ([first, *c.consume(1000, 0)] if first is not None else []):
                    if m.error() is not None:
                        if m.error().code() == KafkaError._PARTITION_EOF:
                            done = True
                            continue
                        raise KafkaException(m.error())
                    key = m.key() or b""
                    if key.startswith(mine):
                        latest[key[len(mine):]] = m.value()
                    if m.offset() >= high - 1:
                        done = True
        finally:
            c.close()
        manifest = latest.pop(b"", None)
        holders = {k.decode(): serde.loads(v, self.topic) for k, v in latest.items() if v is not None}
        return (serde.loads(manifest, self.topic) if manifest is not None else None), holders
