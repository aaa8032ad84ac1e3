"""``RedisStore``: the residency view in Redis, written and read through the ``kvbus`` functions.

Layout and cost figures: docs/sinks-layout.md. A batch of records is written with one FCALL (each
holder's events in record order; more calls only past the per-call limits), pipelined: one round
trip; every lookup is one FCALL_RO.
"""
from __future__ import annotations

import logging
import re
import struct
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import redis

from kvbus.schemas.events import AllBlocksCleared, BlockEvent, BlockRemoved, BlockStored, Reset, holder_key
from kvbus.schemas.lookup import (
    DEFAULT_PREFIX,
    LOOKUP_FUNCTION,
    HolderNames,
    declared_keys,
    lookup_args,
    meta_key,
    parse_hname,
    status_key,
)
from kvbus.sinks import functions
from kvbus.sinks.redis_memory import RedisFull, describe_full, is_oom
from kvbus.sinks.refcounts import DEFAULT_POLICY, TierPolicy, Weights, group_spec, label
from kvbus.sinks.store import ApplyResult, HolderMatch, ResidencyStore, Snapshot, summary_from_counts

log = logging.getLogger("kvbus.sinks")

DEFAULT_WEIGHTS = Weights()

EVENT_HEADER = struct.Struct(">BHHddIdHI")
"""Per-event header in ``kvbus_apply``'s event blob: kind, holder index, topic index, epoch, seq, index, ts,
tier index, number of hashes (39 bytes, big-endian; the hashes follow, after the group spec of a kind 5
store: :data:`STORED_WITH_SPEC`)."""
STORED, REMOVED, CLEARED, RESET, STORED_WITH_SPEC = 1, 2, 3, 4, 5
"""Event kinds of the blob; a BlockStored whose event names its KV cache group's kind is sent as
STORED_WITH_SPEC, its spec (:func:`kvbus.sinks.refcounts.group_spec`) as one length byte and the text."""

STATE_POS = struct.Struct(">ddd")
"""Holder state ``p:<topic>``: applied position epoch, seq, index (kvbus.lua: POS)."""
STATE_TIER = struct.Struct(">dII")
"""Holder state ``t:<code>``: entries, L, S of the tier's index, then its origin topic (kvbus.lua: TSTATE)."""

MAX_EVENTS_PER_CALL = 256
MAX_HASHES_PER_CALL = 1024
"""Events and block hashes per FCALL: bound how long one call keeps Redis busy, i.e. how long a lookup
may wait behind it (~2.5 us per hash inside Redis on a 2-core VM: ~3 ms per call at most, ~7 ms when
the VM is loaded; docs/sinks-layout.md)."""
MAX_HOLDERS_PER_CALL = 65535
"""Holders per FCALL (the event header's holder index is 16 bits)."""


def index_live(log: bytes) -> list[bytes]:
    """Raws held according to one index bucket's toggle log (8-byte records; a raw occurring an odd
    number of times is held), in order of first occurrence (kvbus.lua: index_live)."""
    odd: dict[bytes, bool] = {}
    for j in range(0, len(log), 8):
        r = log[j:j + 8]
        odd[r] = not odd.get(r, False)
    return [r for r, held in odd.items() if held]


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


_pack_header = EVENT_HEADER.pack


Call = tuple[list, list, list[str]]
"""One ``kvbus_apply`` call being packed: its (topic, event) records, its arguments up to the event blob
(:func:`_call_args`), and its holders' models (in holder order, "" when not named), which follow the view
id and the offsets (:func:`_with_extra`)."""


def _call_args(prefix: str, holders: dict, topics: dict, tiers: dict, rcs: list[str], blob: list[bytes]) -> list:
    """``kvbus_apply``'s arguments (after the key count) up to the event blob: ``holders`` (replica,
    dp_rank) -> index, ``topics`` topic -> index, ``tiers`` descriptor -> index (each 1-based, in order
    of first use), ``rcs`` per tier "1" if reference-counted, ``blob`` the event headers and hashes
    (kvbus.lua)."""
    args: list = [prefix, len(holders)]
    for replica, dp in holders:
        args += (replica, dp)
    args.append(len(topics))
    args += topics
    args.append(len(tiers))
    for desc, rc in zip(tiers, rcs):
        args += (desc, rc)
    args.append(b"".join(blob))
    return args


VIEW_CHANGED = "view changed"
"""What ``kvbus_apply`` answers when the view is not the one the caller expects."""
LAYOUT = functions.layout_version()
"""The key layout version (written once, in kvbus.lua: LAYOUT)."""


DROP_VID = """
if redis.call('HGET', KEYS[1], 'vid') ~= ARGV[1] then return 0 end
redis.call('HDEL', KEYS[1], 'vid')
redis.call('DEL', KEYS[2])
redis.call('HSET', KEYS[2], 'state', 'rebuilding', 'since', ARGV[2], 'phase', ARGV[3])
return 1
"""
"""If ``P meta vid`` (KEYS[1]) is ARGV[1]: delete it and write ``P status`` (KEYS[2]) ``rebuilding``
since ARGV[2] in phase ARGV[3], atomically (:meth:`RedisStore.drop_view_id`). A script of its own:
one compare-and-delete of the sinks' bookkeeping, not part of the view's function library."""


class ViewChanged(RuntimeError):
    """The view the sink was applying to is gone or was rebuilt (Redis restarted empty, FLUSHALL,
    another sink rebuilt it): nothing of the batch was written; resynchronise first."""


def refused(replies: Sequence[Any], what: str, view_id: str | None, server: Callable[[], redis.Redis]) -> None:
    """Raise what the replies of a batch's calls say about the whole batch, in this order:
    :class:`ViewChanged` (the view is not ``view_id``, or another sink moved a partition on),
    Redis's ACL refusing the call (a setting to fix, not bad events), :class:`RedisFull` (OOM at
    ``maxmemory``: ``server()`` is asked for the figures). Other errors (a table full) are the caller's:
    it retries those calls event by event. ``what``: the view, as messages name it."""
    errors = [x for x in replies if isinstance(x, Exception)]
    for e in errors:
        if isinstance(e, redis.ResponseError) and VIEW_CHANGED in str(e) and not chain_broken(e):
            raise ViewChanged(f"{what} is not view {view_id!r} any more: {e}") from e
    for e in errors:
        if isinstance(e, redis.exceptions.NoPermissionError):
            raise e
    for e in errors:
        if is_oom(e):
            raise RedisFull(describe_full(server())) from e


Offsets = Mapping[tuple[str, int], int]
"""(topic, partition) -> Kafka offset."""


def _offsets_arg(expected: Mapping[tuple[str, int], int | None] | None, new: Offsets | None) -> str:
    """``kvbus_apply``'s offsets argument: a line "<topic>:<partition>\\t<expected>\\t<new>" per
    partition of ``expected`` and ``new``; expected "" = absent, "*" = not checked (``expected``
    None); new "" = not written."""
    new = new or {}
    keys = dict.fromkeys([*(expected or {}), *new])

    def s(v: int | None) -> str:
        return "" if v is None else str(v)

    want = (lambda k: s(expected.get(k))) if expected is not None else (lambda k: "*")
    return "\n".join(f"{t}:{p}\t{want((t, p))}\t{s(new.get((t, p)))}" for t, p in keys)


CHAIN = "~"
"""First character of the ``P off`` field that chains the calls of one batch (``~<topic>:<partition>``
of a partition of the batch; ``~`` is not allowed in Kafka topic names, so it never names one)."""


def _chained(want: Mapping[tuple[str, int], int | None] | None, offsets: Offsets | None) -> str | None:
    """The chain field of a batch: ``~`` and a partition of the batch, which only the sink that owns
    the partition writes (None: the batch names no partition, its calls are not chained)."""
    first = next(iter(offsets or want or {}), None)
    return None if first is None else f"{CHAIN}{first[0]}:{first[1]}"


def chain_broken(e: BaseException) -> bool:
    """Whether a call was refused because the call before it in its batch did not run."""
    return VIEW_CHANGED in str(e) and f"({CHAIN}" in str(e)


def _with_extra(calls: Iterator[Call], view_id: str | None, offsets: Offsets | None,
                expected: Mapping[tuple[str, int], int | None] | None) -> Iterator[tuple[list, list]]:
    """The calls (records, arguments) with ``kvbus_apply``'s optional arguments appended: to each the
    view id and the offset checks ("" when not checked), to the last also the new offsets (one call is
    looked ahead to know it is the last), then the holders' models. A partition of ``offsets``
    missing from ``expected`` is expected absent.

    The calls of a batch of several are chained through one more offsets line: call k writes
    ``<nonce>.k`` into the batch's chain field (:func:`_chained`) and call k+1 runs only if it finds it
    there. So a batch always runs as a prefix of its calls: a call refused (Redis full at
    ``maxmemory``, a table full) makes every later call of the batch refuse too (:func:`chain_broken`),
    instead of a later call running, and the last one storing offsets past events that were not
    applied, when memory comes free between two calls (``CONFIG SET maxmemory``, a client buffer
    shrinking)."""
    want = None if expected is None else {k: expected.get(k) for k in [*expected, *(offsets or {})]}
    field = _chained(want, offsets)
    nonce = uuid.uuid4().hex[:16]

    def lines(k: int, last: bool) -> str:
        check = _offsets_arg(want, offsets) if last else (_offsets_arg(want, None) if want else "")
        if field is None or (last and k == 1):
            return check
        link = f"{field}\t{'*' if k == 1 else f'{nonce}.{k - 1}'}\t{'' if last else f'{nonce}.{k}'}"
        return f"{check}\n{link}" if check else link

    prev = None
    k = 0
    for call in calls:
        if prev is not None:
            yield prev[0], prev[1] + [view_id or "", lines(k, False), *prev[2]]
        prev = call
        k += 1
    if prev is not None:
        yield prev[0], prev[1] + [view_id or "", lines(k, True), *prev[2]]


@dataclass
class HolderDump:
    """One holder's state as :meth:`RedisStore.dump_holder` reads it and
    :meth:`RedisStore.restore_holder` writes it."""

    seen: float | None = None
    """Staleness clock (P seen), epoch s; None if expired."""
    floor: float | None = None
    """Reset floor epoch; None if none."""
    positions: list[tuple[str, int, int, int]] = field(default_factory=list)
    """(topic, epoch, seq, index) applied per topic."""
    tiers: list[tuple[str, bool, str, bytes, bytes]] = field(default_factory=list)
    """(descriptor, ref-counted, origin topic, raws held, raws once more per extra count) per tier."""
    model: str | None = None
    """The model the view records for the holder; None if unknown."""
    groups: list[tuple[int, str]] = field(default_factory=list)
    """(KV cache group, its spec ``"<kind>,<window>,<block_size max>,<block_size min>"``) per group its
    events named (kvbus.lua, "KV cache groups of a holder"); empty for engines that name none."""


class RedisStore(ResidencyStore):
    """The view in Redis under key prefix ``prefix``.

    ``client``: a ``redis.Redis`` (``decode_responses=False``) or a URL. ``load``: check the server
    version and load the function library now (a read-only lookup client passes False).
    ``declare_keys``: every FCALL declares ``P meta`` and ``P guard`` (a key never written), so it
    routes on Redis Cluster and is refused (ASK, TRYAGAIN: retried) while ``P``'s slot is being
    migrated (one shard of :class:`kvbus.sinks.sharded_store.ShardedRedisStore`).
    """

    def __init__(
        self,
        client: redis.Redis | str,
        prefix: str = DEFAULT_PREFIX,
        policy: TierPolicy = DEFAULT_POLICY,
        *,
        load: bool = True,
        max_events_per_call: int = MAX_EVENTS_PER_CALL,
        max_hashes_per_call: int = MAX_HASHES_PER_CALL,
        declare_keys: bool = False,
    ):
        self.r = redis.Redis.from_url(client) if isinstance(client, str) else client
        self.prefix = prefix
        self.policy = policy
        self.max_events_per_call = max_events_per_call
        self.max_hashes_per_call = max_hashes_per_call
        self._rc: dict[tuple, tuple[str, str]] = {}
        self._specs: dict[tuple, bytes | None] = {}
        self._names = HolderNames()
        self.fkeys: tuple[str, ...] = declared_keys(prefix) if declare_keys else ()
        """Keys every FCALL declares (none on a standalone Redis)."""
        if load:
            functions.check_server(self.r)
            functions.ensure_library(self.r)

    def _fcall(self, name: str, *args: Any, readonly: bool = False) -> Any:
        return functions.call(self.r, name, *args, readonly=readonly, keys=self.fkeys)

    # -- writes ---------------------------------------------------------------

    def _tier(self, e: BlockStored | BlockRemoved) -> tuple[str, str]:
        """(descriptor, "1" if ref-counted else "0") of an event's tier, cached per (medium, ownership, group)."""
        k = (e.medium, e.ownership, e.group_idx)
        t = self._rc.get(k)
        if t is None:
            desc = self.policy.tier_of(e)
            t = self._rc[k] = (desc, "1" if self.policy.refcounted(desc) else "0")
        return t

    def _spec(self, e: BlockStored) -> bytes | None:
        """The length byte and text of a store's group spec (None: the event names no kind), cached per
        (kind, window, block size)."""
        k = (e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window, e.block_size)
        try:
            return self._specs[k]
        except KeyError:
            spec = group_spec(e)
            v = self._specs[k] = None if spec is None else bytes([len(spec)]) + spec.encode()
            return v

    def _pack(self, part: list[tuple[str, BlockEvent]], view_id: str | None = None) -> list:
        """FCALL arguments of ``kvbus_apply`` for ``part`` (any holders; format: kvbus.lua), checking
        the view id ``view_id`` if given.

        ``part`` keeps each holder's records in record order (other orders do not matter)."""
        return next(_with_extra(self._iter_calls(part, cut=False), view_id, None, None))[1]

    def _calls(self, records: Iterable[tuple[str, BlockEvent]],
               cut: bool = True) -> list[tuple[list[tuple[str, BlockEvent]], list]]:
        """(records, FCALL args) per call, no view id or offsets checked: every holder's records in record
        order, grouped by holder, cut at the per-call limits (events, hashes, holders) unless ``cut`` is False."""
        return list(_with_extra(self._iter_calls(records, cut), None, None, None))

    def _iter_calls(self, records: Iterable[tuple[str, BlockEvent]], cut: bool = True) -> Iterator[Call]:
        """The calls (:data:`Call`), each yielded as soon as it is packed (:meth:`_stream` sends it while
        the next is packed; :func:`_with_extra` completes its arguments). One pass packs the headers while
        it cuts (the sink's per-record Python cost)."""
        groups: dict[tuple[str, int], list[tuple[str, BlockEvent]]] = {}
        for rec in records:
            ev = rec[1]
            k = (ev.replica, ev.dp_rank)
            g = groups.get(k)
            if g is None:
                groups[k] = [rec]
            else:
                g.append(rec)
        prefix, tier, spec_of, pack, join = self.prefix, self._tier, self._spec, _pack_header, b"".join
        max_ev, max_h = (self.max_events_per_call, self.max_hashes_per_call) if cut else (1 << 62, 1 << 62)
        # the call being packed: its records, holders / topics / tiers -> 1-based index, rc flags, blob,
        # the holders' models
        part: list = []
        holders: dict = {}
        topics: dict = {}
        tiers: dict = {}
        rcs: list[str] = []
        blob: list[bytes] = []
        mods: list[str] = []
        nh = 0  # its block hashes
        for hk, recs in groups.items():
            if len(holders) >= MAX_HOLDERS_PER_CALL:
                yield part, _call_args(prefix, holders, topics, tiers, rcs, blob), mods
                part, holders, topics, tiers, rcs, blob, mods, nh = [], {}, {}, {}, [], [], [], 0
            hi = 0  # its index in the call, given at its first record there
            for rec in recs:
                topic, ev = rec
                e = ev.event
                t = type(e)
                hashed = t is BlockStored or t is BlockRemoved
                n = len(e.block_hashes) if hashed else 0
                model = ev.model or ""
                # a holder's records in one call share one model (its model is that of its last applied event)
                if part and (len(part) >= max_ev or nh + n > max_h or (hi and mods[hi - 1] != model)):
                    yield part, _call_args(prefix, holders, topics, tiers, rcs, blob), mods
                    part, holders, topics, tiers, rcs, blob, mods, nh = [], {}, {}, {}, [], [], [], 0
                    hi = 0
                part.append(rec)
                if not hi:
                    hi = holders[hk] = len(holders) + 1
                    mods.append(model)
                ti = topics.get(topic)
                if ti is None:
                    ti = topics[topic] = len(topics) + 1
                if hashed:
                    desc, rc = tier(e)
                    di = tiers.get(desc)
                    if di is None:
                        di = tiers[desc] = len(tiers) + 1
                        rcs.append(rc)
                    hashes = e.block_hashes
                    joined = hashes[0] if n == 1 and type(hashes[0]) is bytes else join(hashes)
                    if len(joined) != 8 * n:
                        raise ValueError(f"block hashes of {ev.replica}#{ev.dp_rank} at {ev.position} "
                                         "are not 8 bytes each")
                    spec = spec_of(e) if t is BlockStored else None
                    if spec is None:
                        blob += (pack(STORED if t is BlockStored else REMOVED, hi, ti, ev.epoch, ev.seq, ev.index,
                                      ev.ts, di, n), joined)
                    else:
                        blob += (pack(STORED_WITH_SPEC, hi, ti, ev.epoch, ev.seq, ev.index, ev.ts, di, n), spec, joined)
                    nh += n
                elif t is AllBlocksCleared or t is Reset:
                    blob.append(pack(CLEARED if t is AllBlocksCleared else RESET, hi, ti, ev.epoch, ev.seq, ev.index,
                                     ev.ts, 0, 0))
                else:
                    raise TypeError(f"not a kvbus event: {t.__name__}")
        if part:
            yield part, _call_args(prefix, holders, topics, tiers, rcs, blob), mods

    def apply(self, records: Iterable[tuple[str, BlockEvent]], *, view_id: str | None = None,
              offsets: Offsets | None = None,
              expected: Mapping[tuple[str, int], int | None] | None = None) -> ApplyResult:
        """Apply records: one FCALL for the whole batch (more when it exceeds the per-call limits), all
        on one connection, each written as soon as it is packed and the replies read at the end (one
        round trip; Redis runs a call while the next is packed); each holder's records are applied in
        record order.

        ``view_id``: every call fails with :class:`ViewChanged`, before writing, unless the view's id
        (:meth:`view_id`) is this one. ``offsets``: (topic, partition) -> next Kafka offset, stored in
        ``P off`` by the batch's last call, atomically with it (:meth:`offsets`). ``expected``: what
        ``P off`` holds for each partition of ``offsets`` (None: nothing) as far as the caller knows
        (what it last wrote or read); every call fails with :class:`ViewChanged` if it does not.

        A group the functions refuse (e.g. tier table full) is retried event by event; the events
        still refused are returned in ``failed`` and the rest is applied.
        """
        res = ApplyResult()
        calls: list = []
        replies = self._stream(_with_extra(self._iter_calls(records), view_id, offsets, expected), calls)
        if not calls:
            return res
        if any(functions.needs_library(x) for x in replies if isinstance(x, Exception)):
            functions.ensure_library(self.r)  # missing, or another version that refuses these calls
            replies = self._pipeline(calls)
        refused(replies, f"the view under {self.prefix!r}", view_id, lambda: self.r)
        for (part, args), reply in zip(calls, replies):
            if isinstance(reply, Exception):
                self._apply_one_by_one(part, args, reply, res, view_id)
            else:
                self._add_reply(res, reply)
        if offsets and isinstance(replies[-1], Exception):  # the call that stores them was refused
            self.set_offsets(offsets, view_id, expected)
        return res

    def _pipeline(self, calls: list) -> list:
        """FCALL ``kvbus_apply`` for each (records, args) of ``calls`` in one redis-py pipeline; the
        replies, an error reply as its exception."""
        pipe = self.r.pipeline(transaction=False)
        for _, args in calls:
            pipe.fcall("kvbus_apply", len(self.fkeys), *self.fkeys, *args)
        return pipe.execute(raise_on_error=False)

    def _stream(self, calls: Iterator[tuple[list, list]], sent: list) -> list:
        """Like :meth:`_pipeline`, but each call is written to the socket as soon as ``calls`` yields
        it, so packing the next call overlaps Redis running this one (packing is ~10% of apply); the
        calls are appended to ``sent``. A connection error falls back to :meth:`_pipeline` of all of
        them (redis-py's retries; positions make a call that ran twice harmless)."""
        pool = self.r.connection_pool
        conn = pool.get_connection()
        try:
            for call in calls:
                first = not sent
                sent.append(call)  # before sending: a call lost with the connection is sent again
                packed = conn.pack_command("FCALL", "kvbus_apply", len(self.fkeys), *self.fkeys, *call[1])
                conn.send_packed_command(packed, check_health=first)
            replies: list = []
            for _ in sent:
                try:
                    replies.append(self.r.parse_response(conn, "FCALL"))
                except redis.ResponseError as e:
                    replies.append(e)
            return replies
        except (redis.ConnectionError, redis.TimeoutError):
            conn.disconnect()
            sent.extend(calls)  # the calls not packed yet
            return self._pipeline(sent)
        except BaseException:
            conn.disconnect()  # replies of the calls sent so far are unread: the connection is out of step
            raise
        finally:
            pool.release(conn)

    def _apply_one_by_one(self, part, args, err: Exception, res: ApplyResult, view_id: str | None) -> None:
        """The events of a refused call, one call each, in order: those still refused go to ``failed``
        (for the dead-letter topic); Redis full or the view changed stop the batch
        (:class:`RedisFull`, :class:`ViewChanged`)."""
        if not chain_broken(err):
            log.warning("apply refused for %d holders (%s): retrying event by event", args[1], err)
        for topic, ev in part:
            one = self._pack([(topic, ev)], view_id)
            try:
                self._add_reply(res, self._fcall("kvbus_apply", *one))
            except redis.ResponseError as e:
                refused([e], f"the view under {self.prefix!r}", view_id, lambda: self.r)
                res.failed.append((topic, ev, f"{type(e).__name__}: {e}"))

    @staticmethod
    def _add_reply(res: ApplyResult, reply: list) -> None:
        applied, skipped, delta, resets, clears = (int(x) for x in reply)
        res.add(ApplyResult(applied, skipped, delta, resets, clears))

    # -- the view's identity, offsets and recovery (sinks/rebuild.py, sinks/snapshot.py) ----------

    def view_id(self) -> str | None:
        """The view's id (``P meta vid``), set when it is created or rebuilt; None: no view (never
        created, or lost: Redis restarted without persistence, FLUSHALL, a new server)."""
        v = self.r.hget(meta_key(self.prefix), "vid")
        return _s(v) if v is not None else None

    def drop_view_id(self, view_id: str, why: str) -> bool:
        """Forget the view's id if it is still ``view_id``, and mark it ``rebuilding`` (phase ``why``)
        for routers, atomically: the view counts as lost, so the sinks rebuild it (sinks/rebuild.py).
        False: it had another id already (rebuilt meanwhile)."""
        return bool(self.r.eval(DROP_VID, 2, meta_key(self.prefix), status_key(self.prefix), view_id,
                                repr(time.time()), why))

    def servers(self) -> list[tuple[str, redis.Redis]]:
        """(name, client) of the server the view is written to."""
        kw = self.r.connection_pool.connection_kwargs
        return [(str(kw.get("path") or f"{kw.get('host', '?')}:{kw.get('port', '?')}"), self.r)]

    def lost_shards(self) -> None:
        """Shards that lost the view while others kept it: none on one server (a view is lost whole)."""
        return None

    def set_view_id(self, view_id: str) -> None:
        """Mark the view under this prefix as view ``view_id`` (complete, ready to be applied to)."""
        self.r.hset(self.prefix + "meta", mapping={"vid": view_id, "layout": LAYOUT})

    def offsets(self) -> dict[tuple[str, int], int]:
        """(topic, partition) -> next Kafka offset to apply, as stored with the applies."""
        out = {}
        for k, v in self.r.hgetall(self.prefix + "off").items():
            name = _s(k)
            if not name.startswith(CHAIN):  # a batch's chain field, not a partition
                topic, _, part = name.rpartition(":")
                out[(topic, int(part))] = int(v)
        return out

    def set_offsets(self, offsets: Offsets, view_id: str | None = None,
                    expected: Mapping[tuple[str, int], int | None] | None = None) -> None:
        """Store offsets without events (a batch of dead letters only, a rebuilt view's replay start):
        a ``kvbus_apply`` of no events, so it fails with :class:`ViewChanged` like an apply would."""
        if not offsets:
            return
        want = {k: expected.get(k) for k in offsets} if expected is not None else None
        try:
            self._fcall("kvbus_apply", self.prefix, 0, 0, 0, b"", view_id or "", _offsets_arg(want, offsets))
        except redis.ResponseError as e:
            refused([e], f"the view under {self.prefix!r}", view_id, lambda: self.r)
            raise

    def checkpoint(self, partitions: Iterable[tuple[str, int]]) -> dict[tuple[str, int], int | None]:
        """What the view stores for ``partitions`` (None: nothing), in the form ``apply(expected=)``
        takes: a sink keeps it as what it believes the view holds."""
        off = self.offsets()
        return {tp: off.get(tp) for tp in partitions}

    @staticmethod
    def advance(expected: Any, offsets: Offsets) -> Any:
        """``expected`` after a batch that stored ``offsets`` was applied."""
        return {**expected, **offsets}

    def holds(self, expected: Any) -> bool:
        """Whether the view still stores what ``expected`` says (False: rolled back, rebuilt, or
        another sink moved the partition on)."""
        return self.checkpoint(expected) == expected

    def identity(self) -> tuple:
        """What changes when the server restarts or is replaced (Redis's run id)."""
        return (str(self.r.info("server").get("run_id", "")),)

    def status(self) -> dict[str, str]:
        """``P status``: ``state`` "ready" or "rebuilding" (answers may be partial), ``since`` (epoch s),
        and what the rebuild started from; {} for a view that never had one written."""
        return {_s(k): _s(v) for k, v in self.r.hgetall(status_key(self.prefix)).items()}

    def set_status(self, **fields: Any) -> None:
        """Replace ``P status`` with ``fields`` (values as strings)."""
        pipe = self.r.pipeline(transaction=True)
        pipe.delete(self.prefix + "status")
        pipe.hset(self.prefix + "status", mapping={k: str(v) for k, v in fields.items()})
        pipe.execute()

    def wipe(self, keep: Sequence[str] = ("status", "lock")) -> int:
        """Delete every key of the view (SCAN + UNLINK) but ``P <keep>``; returns the keys deleted."""
        pattern = re.sub(r"([*?\[\]\\])", r"\\\1", self.prefix) + "*"
        spared = {(self.prefix + k).encode() for k in keep}
        n = 0
        batch: list[bytes] = []
        for key in self.r.scan_iter(match=pattern, count=1000):
            if key not in spared:
                batch.append(key)
            if len(batch) >= 1000:
                n += self.r.unlink(*batch)
                batch = []
        if batch:
            n += self.r.unlink(*batch)
        return n

    def holder_ids(self) -> dict[int, str]:
        """hid -> holder name "<replica>#<dp_rank>" of every holder the view knows."""
        return self._holders()

    def dump_holder(self, hid: int) -> HolderDump:
        """One holder's state, read atomically (``kvbus_dump``)."""
        state, seen, tiers = self._fcall("kvbus_dump", self.prefix, hid, readonly=True)
        fields = {_s(state[j]): state[j + 1] for j in range(0, len(state), 2)}
        out = HolderDump(seen=float(seen) if seen is not None else None)
        f = fields.get("f")
        out.floor = struct.unpack(">d", f)[0] if f is not None else None
        m = fields.get("m")
        out.model = _s(m) if m is not None else None
        for name, v in fields.items():
            if name.startswith("p:"):
                e, sq, i = (int(x) for x in STATE_POS.unpack(v))
                out.positions.append((name[2:], e, sq, i))
        for code, desc, rc, raws, extra in tiers:
            origin = _s(fields[f"t:{int(code)}"][STATE_TIER.size:])
            more = b"".join(extra[j] * int(extra[j + 1]) for j in range(0, len(extra), 2))
            out.tiers.append((_s(desc), _s(rc) == "1", origin, raws, more))
        out.groups = sorted((int(name[2:]), _s(v)) for name, v in fields.items() if name.startswith("g:"))
        return out

    def restore_holder(self, replica: str, dp_rank: int, state: HolderDump, max_hashes: int = 16384) -> int:
        """Write one holder from a snapshot (``kvbus_restore``), in calls of at most ``max_hashes``
        hashes per tier piece (Redis stays responsive: ~40 ms per call). Returns the entries added."""
        head = [self.prefix, replica, dp_rank, "" if state.seen is None else repr(state.seen),
                "" if state.floor is None else repr(state.floor), len(state.positions)]
        for topic, e, sq, i in state.positions:
            head += (topic, e, sq, i)
        added = 0
        step = 8 * max_hashes
        pieces: list[tuple[str, str, str, bytes, bytes]] = []
        for desc, rc, origin, raws, extra in state.tiers:
            for j in range(0, max(len(raws), len(extra), 1), step):
                pieces.append((desc, "1" if rc else "0", origin, raws[j:j + step], extra[j:j + step]))
        groups: list = [len(state.groups)] if state.groups else []
        for g, spec in state.groups:
            groups += (g, spec)
        for j in range(0, max(len(pieces), 1), 1):
            part = pieces[j:j + 1]
            args = head + [len(part)]
            for piece in part:
                args += piece
            args.append(state.model or "")
            added += int(self._fcall("kvbus_restore", *args, *groups))
        return added

    def heartbeat(self, replica: str, dp_rank: int, ts: float) -> None:
        self._fcall("kvbus_heartbeat", self.prefix, replica, dp_rank, repr(ts))

    def expire_stale(self, max_age: float, now: float, batch: int = 64) -> list[str]:
        out: list[str] = []
        while True:
            names = self._fcall("kvbus_expire", self.prefix, repr(now - max_age), repr(now), batch)
            out.extend(_s(n) for n in names)
            if len(names) < batch:
                return out

    def drop_holder(self, replica: str, dp_rank: int, now: float) -> int:
        return int(self._fcall("kvbus_drop", self.prefix, holder_key(replica, dp_rank), repr(now)))

    # -- reads ----------------------------------------------------------------

    def lookup(
        self,
        chain: Sequence[bytes],
        *,
        weights: Weights | None = None,
        candidates: Sequence[str] | None = None,
        model: str | None = None,
    ) -> dict[str, HolderMatch]:
        """One FCALL_RO (works on replicas and for read-only ACL users). Holder names come from a
        client-side cache of the holder table (:class:`kvbus.schemas.lookup.HolderNames`), read again
        when a reply names an unknown holder id or the cache is older than ``NAMES_TTL`` seconds."""
        if not chain:
            return {}
        spec = (weights or DEFAULT_WEIGHTS).spec()
        args = lookup_args(self.prefix, chain, spec, candidates or (), model)
        reply = self._fcall(LOOKUP_FUNCTION, *args, readonly=True)
        return {m.name: m for m in self._names.answer([reply], lambda: [self._holders()])}

    def stale(self) -> dict[str, float]:
        return {_s(n): float(s) for n, s in self.r.zrange(self.prefix + "stale", 0, -1, withscores=True)}

    def _holders(self) -> dict[int, str]:
        return parse_hname(self.r.hgetall(self.prefix + "hname"))

    def _tier_names(self) -> dict[int, str]:
        return {int(k): _s(v) for k, v in self.r.hgetall(self.prefix + "tname").items()}

    def _holder_state(self, hid: int) -> dict[str, bytes]:
        """Holder state fields (p:<topic>, t:<code>, f) -> binary values (kvbus.lua: POS, TSTATE, FLOOR)."""
        return {_s(k): v for k, v in self.r.hgetall(f"{self.prefix}H:{hid}").items()}

    def positions(self) -> dict[tuple[str, str], tuple[int, int, int]]:
        out = {}
        for hid, name in self._holders().items():
            for f, v in self._holder_state(hid).items():
                if f.startswith("p:"):
                    e, s, i = (int(x) for x in STATE_POS.unpack(v))
                    out[(name, f[2:])] = (e, s, i)
        return out

    def models(self) -> dict[str, str]:
        """From ``P mh`` (model -> the hids of its live holders)."""
        names = self._holders()
        return {names[int(hid)]: _s(model) for model, hids in self.r.hgetall(self.prefix + "mh").items()
                for hid in hids.split()}

    def _tiers_of(self, hid: int) -> dict[int, tuple[int, int, int]]:
        """tier code -> (entries, L, S of its index) of one holder."""
        out = {}
        for f, v in self._holder_state(hid).items():
            if f.startswith("t:"):
                n, L, S = STATE_TIER.unpack_from(v)
                out[int(f[2:])] = (int(n), L, S)
        return out

    def holder_blocks(self, hid: int, code: int) -> dict[bytes, int]:
        """Blocks of one (holder, tier) from its index, with reference counts."""
        n, L, S = self._tiers_of(hid).get(code, (0, 0, 0))
        pipe = self.r.pipeline(transaction=False)
        for b in range(2**L + S):
            pipe.get(f"{self.prefix}I:{hid}:{code}:{b}")
        blocks = {raw: 1 for log in pipe.execute() for raw in index_live(log or b"")}
        for raw, extra in self.r.hgetall(f"{self.prefix}R:{hid}:{code}").items():
            blocks[raw] = blocks.get(raw, 1) + int(extra)
        return blocks

    def snapshot(self) -> Snapshot:
        tnames = self._tier_names()
        out: Snapshot = {}
        for hid, name in self._holders().items():
            tiers = {}
            for code in self._tiers_of(hid):
                blocks = self.holder_blocks(hid, code)
                if blocks:
                    tiers[label(tnames[code])] = blocks
            if tiers:
                out[name] = tiers
        return out

    def block_table(self) -> dict[bytes, set[tuple[str, str]]]:
        """The forward map read from the block table: hash -> {(holder name, tier label)} (tests)."""
        meta = {_s(k): int(v) for k, v in self.r.hgetall(self.prefix + "meta").items()}
        holders, tnames = self._holders(), self._tier_names()
        out: dict[bytes, set[tuple[str, str]]] = {}

        def add(raw: bytes, m: int) -> None:
            out.setdefault(raw, set()).add((holders[m // 64], label(tnames[m % 64])))

        for b in range(2 ** meta.get("bL", 0) + meta.get("bS", 0)):
            for raw, v in self.r.hgetall(f"{self.prefix}B:{b}").items():
                if v == b"":
                    v = self.r.get(f"{self.prefix}W:".encode() + raw)
                members = [int.from_bytes(v[j:j + 3], "big") for j in range(0, len(v), 3)]
                assert members == sorted(set(members)), f"member string of {raw.hex()} is not sorted"
                for m in members:
                    add(raw, m)
        return out

    def summary(self) -> dict[str, dict[str, int]]:
        tnames = self._tier_names()
        counts = {
            name: {label(tnames[code]): n for code, (n, _, _) in self._tiers_of(hid).items() if n}
            for hid, name in self._holders().items()
        }
        return summary_from_counts(counts)

    def size(self, exact: bool = True) -> dict[str, int]:
        meta = self.r.hmget(self.prefix + "meta", "entries", "blocks")
        return {
            "entries": int(meta[0] or 0),
            "blocks": int(meta[1] or 0),
            "holders": int(self.r.zcard(self.prefix + "seen")),
        }

