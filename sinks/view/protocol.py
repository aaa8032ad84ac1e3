"""The writer's side of the ``kvbus`` Redis function protocol (``sinks/view/lua/kvbus.lua``): function names,
key names, how ``kvbus_apply``'s events, offsets and chain are packed, how its replies and
``kvbus_dump``'s are read, and what "view changed" means. One shard of a view (a single Redis, or one
``P{s<i>}:`` prefix of a Redis Cluster view) speaks exactly this; the stores (sinks/view/redis_store.py,
sinks/view/sharded_store.py) only decide where the calls go.

The reader's side (``kvbus_lookup``, ``P meta`` / ``P hname`` / ``P status``, the layout version) is
:mod:`kvbus.schemas.lookup`, shared with the routers; it is used from there, not repeated here.
Layout and cost figures: docs/sinks-layout.md.
"""
from __future__ import annotations

import struct
import uuid
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import redis

from kvbus.schemas import view_keys as vk
from kvbus.schemas.events import AllBlocksCleared, BlockEvent, BlockRemoved, BlockStored, Reset
from kvbus.schemas.lookup import LAYOUT, meta_key, status_key
from kvbus.sinks.view.redis_memory import RedisFull, describe_full, is_oom
from kvbus.sinks.view.refcounts import TierPolicy, group_spec
from kvbus.sinks.view.store import ApplyResult, HolderDump, Offsets, ViewChanged

# ----------------------------------------------------------------------------- functions

APPLY = "kvbus_apply"
DUMP = "kvbus_dump"
RESTORE = "kvbus_restore"
HEARTBEAT = "kvbus_heartbeat"
EXPIRE = "kvbus_expire"
DROP = "kvbus_drop"
"""The library's write-side functions (``kvbus_lookup``: :data:`kvbus.schemas.lookup.LOOKUP_FUNCTION`)."""

# ----------------------------------------------------------------------------- keys


def text(v: Any) -> str:
    """A reply value (bytes or other) as a str."""
    return v.decode() if isinstance(v, bytes) else str(v)


def off_key(prefix: str) -> str:
    """``P off``: (``<topic>:<partition>``) -> next Kafka offset, written with the applies (and a
    batch's chain fields, :data:`CHAIN`)."""
    return vk.OFFSETS(prefix)


def seen_key(prefix: str) -> str:
    """``P seen``: zset of live holder names by when last heard from."""
    return vk.SEEN(prefix)


def stale_key(prefix: str) -> str:
    """``P stale``: zset of expired holder names by when they expired."""
    return vk.STALE(prefix)


def tname_key(prefix: str) -> str:
    """``P tname``: tier code -> tier descriptor."""
    return vk.TIER_NAME(prefix)


def models_key(prefix: str) -> str:
    """``P mh``: model -> the space-separated hids of its live holders."""
    return vk.MODEL_HIDS(prefix)


def holder_state_key(prefix: str, hid: int) -> str:
    """``P H:<hid>``: one holder's state (``p:<topic>`` :data:`STATE_POS`, ``t:<code>``
    :data:`kvbus.schemas.view_keys.STATE_TIER`, ``f`` floor, ``m`` model, ``g:<group>`` spec)."""
    return vk.HOLDER(prefix, hid)


def index_key(prefix: str, hid: int, code: int, bucket: int) -> str:
    """``P I:<hid>:<code>:<bucket>``: one bucket of a (holder, tier) index: a toggle log (:func:`index_live`)."""
    return vk.INDEX(prefix, hid, code, bucket)


def refcount_key(prefix: str, hid: int, code: int) -> str:
    """``P R:<hid>:<code>``: raw -> counts above one on a ref-counted tier."""
    return vk.REFCOUNTS(prefix, hid, code)


def block_key(prefix: str, bucket: int) -> str:
    """``P B:<bucket>``: one bucket of the block table: raw -> member string (3 bytes per member
    ``hid * 64 + code``, sorted; "" when it lives in ``P W:<raw>``)."""
    return vk.BLOCKS(prefix, bucket)


def wide_key(prefix: str, raw: bytes) -> bytes:
    """``P W:<raw>``: the member string of a block held by many holders."""
    return (prefix + vk.WIDE.name).encode() + raw


def lock_key(prefix: str, name: str) -> str:
    """``P <name>``: a lock of the sinks (``lock``: rebuild, ``snaplock``: snapshot)."""
    if name not in (vk.LOCK.name, vk.SNAPSHOT_LOCK.name):
        raise ValueError(f"no lock {name!r} in the view's keys")
    return prefix + name


# ----------------------------------------------------------------------------- kvbus_apply's events

EVENT_HEADER = struct.Struct(">BHHddIdHI")
"""Per-event header in ``kvbus_apply``'s event blob: kind, holder index, topic index, epoch, seq, index, ts,
tier index, number of hashes (39 bytes, big-endian; the hashes follow, after the group spec of a kind 5
store: :data:`STORED_WITH_SPEC`)."""
STORED, REMOVED, CLEARED, RESET, STORED_WITH_SPEC = 1, 2, 3, 4, 5
"""Event kinds of the blob; a BlockStored whose event names its KV cache group's kind is sent as
STORED_WITH_SPEC, its spec (:func:`kvbus.sinks.view.refcounts.group_spec`) as one length byte and the text."""

STATE_POS = struct.Struct(">ddd")
"""Holder state ``p:<topic>``: applied position epoch, seq, index (kvbus.lua: POS)."""
FLOOR = struct.Struct(">d")
"""Holder state ``f``: the reset floor epoch."""

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


_pack_header = EVENT_HEADER.pack

Call = tuple[list, list, list[str]]
"""One ``kvbus_apply`` call being packed: its (topic, event) records, its arguments up to the event blob
(:func:`call_args`), and its holders' models (in holder order, "" when not named), which follow the view
id and the offsets (:func:`with_extra`)."""


def call_args(prefix: str, holders: dict, topics: dict, tiers: dict, rcs: list[str], blob: list[bytes]) -> list:
    """``kvbus_apply``'s arguments (after the keys) up to the event blob: ``holders`` (replica,
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


class Packer:
    """Packs records into ``kvbus_apply`` calls for one view under ``prefix``, caching each event's
    tier (``policy``) and group spec. Limits per call: ``max_events``, ``max_hashes``
    (:data:`MAX_EVENTS_PER_CALL`, :data:`MAX_HASHES_PER_CALL`) and :data:`MAX_HOLDERS_PER_CALL`."""

    def __init__(self, prefix: str, policy: TierPolicy, max_events: int = MAX_EVENTS_PER_CALL,
                 max_hashes: int = MAX_HASHES_PER_CALL):
        self.prefix, self.policy, self.max_events, self.max_hashes = prefix, policy, max_events, max_hashes
        self._rc: dict[tuple, tuple[str, str]] = {}
        self._specs: dict[tuple, bytes | None] = {}

    def tier(self, e: BlockStored | BlockRemoved) -> tuple[str, str]:
        """(descriptor, "1" if ref-counted else "0") of an event's tier, cached per (medium, ownership, group)."""
        k = (e.medium, e.ownership, e.group_idx)
        t = self._rc.get(k)
        if t is None:
            desc = self.policy.tier_of(e)
            t = self._rc[k] = (desc, "1" if self.policy.refcounted(desc) else "0")
        return t

    def spec(self, e: BlockStored) -> bytes | None:
        """The length byte and text of a store's group spec (None: the event names no kind), cached per
        (kind, window, block size)."""
        k = (e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window, e.block_size)
        try:
            return self._specs[k]
        except KeyError:
            spec = group_spec(e)
            v = self._specs[k] = None if spec is None else bytes([len(spec)]) + spec.encode()
            return v

    def calls(self, records: Iterable[tuple[str, BlockEvent]], cut: bool = True) -> Iterator[Call]:
        """The calls (:data:`Call`) of ``records``, each yielded as soon as it is packed (a transport
        sends it while the next is packed; :func:`with_extra` completes its arguments): every holder's
        records in record order, grouped by holder, cut at the per-call limits unless ``cut`` is
        False. One pass packs the headers while it cuts (the sink's per-record Python cost)."""
        groups: dict[tuple[str, int], list[tuple[str, BlockEvent]]] = {}
        for rec in records:
            ev = rec[1]
            k = (ev.replica, ev.dp_rank)
            g = groups.get(k)
            if g is None:
                groups[k] = [rec]
            else:
                g.append(rec)
        prefix, tier, spec_of, pack, join = self.prefix, self.tier, self.spec, _pack_header, b"".join
        max_ev, max_h = (self.max_events, self.max_hashes) if cut else (1 << 62, 1 << 62)
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
                yield part, call_args(prefix, holders, topics, tiers, rcs, blob), mods
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
                    yield part, call_args(prefix, holders, topics, tiers, rcs, blob), mods
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
            yield part, call_args(prefix, holders, topics, tiers, rcs, blob), mods

    def one(self, records: list[tuple[str, BlockEvent]], view_id: str | None = None) -> list:
        """``kvbus_apply``'s arguments for ``records`` in one call (any holders, each holder's records in
        record order), checking the view id ``view_id`` if given."""
        return next(with_extra(self.calls(records, cut=False), view_id, None, None))[1]

    def plan(self, records: Iterable[tuple[str, BlockEvent]], view_id: str | None = None,
             offsets: Offsets | None = None,
             expected: Mapping[tuple[str, int], int | None] | None = None) -> Iterator[tuple[list, list]]:
        """(records, arguments) of every ``kvbus_apply`` call of a batch (:func:`with_extra`); a batch
        of no records that stores ``offsets`` is one call of no events."""
        any_call = False
        for call in with_extra(self.calls(records), view_id, offsets, expected):
            any_call = True
            yield call
        if not any_call and offsets:
            yield [], offsets_only(self.prefix, offsets, view_id, expected)


# ----------------------------------------------------------------------------- offsets, view id, chain

VIEW_CHANGED = "view changed"
"""What ``kvbus_apply`` answers when the view is not the one the caller expects."""

CHAIN = "~"
"""First character of the ``P off`` field that chains the calls of one batch (``~<topic>:<partition>``
of a partition of the batch; ``~`` is not allowed in Kafka topic names, so it never names one)."""

DROP_VID = """
if redis.call('HGET', KEYS[1], 'vid') ~= ARGV[1] then return 0 end
redis.call('HDEL', KEYS[1], 'vid')
redis.call('DEL', KEYS[2])
redis.call('HSET', KEYS[2], 'state', 'rebuilding', 'since', ARGV[2], 'phase', ARGV[3])
return 1
"""
"""If ``P meta vid`` (KEYS[1]) is ARGV[1]: delete it and write ``P status`` (KEYS[2]) ``rebuilding``
since ARGV[2] in phase ARGV[3], atomically (:func:`drop_vid_args`). A script of its own:
one compare-and-delete of the sinks' bookkeeping, not part of the view's function library."""


def drop_vid_args(prefix: str, view_id: str, now: float, why: str) -> list:
    """``EVAL DROP_VID``'s numkeys, keys and arguments for the view under ``prefix``."""
    return [2, meta_key(prefix), status_key(prefix), view_id, repr(now), why]


def view_meta(view_id: str) -> dict[str, str]:
    """The ``P meta`` fields that mark a view complete as view ``view_id`` (and its key layout)."""
    return {"vid": view_id, "layout": LAYOUT}


def offsets_arg(expected: Mapping[tuple[str, int], int | None] | None, new: Offsets | None) -> str:
    """``kvbus_apply``'s offsets argument: a line "<topic>:<partition>\\t<expected>\\t<new>" per
    partition of ``expected`` and ``new``; expected "" = absent, "*" = not checked (``expected``
    None); new "" = not written."""
    new = new or {}
    keys = dict.fromkeys([*(expected or {}), *new])

    def s(v: int | None) -> str:
        return "" if v is None else str(v)

    want = (lambda k: s(expected.get(k))) if expected is not None else (lambda k: "*")
    return "\n".join(f"{t}:{p}\t{want((t, p))}\t{s(new.get((t, p)))}" for t, p in keys)


def offsets_only(prefix: str, offsets: Offsets, view_id: str | None,
                 expected: Mapping[tuple[str, int], int | None] | None) -> list:
    """``kvbus_apply``'s arguments storing ``offsets`` without events (checking ``view_id`` and, for
    the partitions of ``offsets``, ``expected``)."""
    want = {k: expected.get(k) for k in offsets} if expected is not None else None
    return [prefix, 0, 0, 0, b"", view_id or "", offsets_arg(want, offsets)]


def parse_offsets(raw: Mapping) -> dict[tuple[str, int], int]:
    """``HGETALL P off`` -> (topic, partition) -> offset (a batch's chain fields left out)."""
    out = {}
    for k, v in raw.items():
        name = text(k)
        if not name.startswith(CHAIN):
            topic, _, part = name.rpartition(":")
            out[(topic, int(part))] = int(v)
    return out


def _chained(want: Mapping[tuple[str, int], int | None] | None, offsets: Offsets | None) -> str | None:
    """The chain field of a batch: ``~`` and a partition of the batch, which only the sink that owns
    the partition writes (None: the batch names no partition, its calls are not chained)."""
    first = next(iter(offsets or want or {}), None)
    return None if first is None else f"{CHAIN}{first[0]}:{first[1]}"


def chain_broken(e: BaseException) -> bool:
    """Whether a call was refused because the call before it in its batch did not run."""
    return VIEW_CHANGED in str(e) and f"({CHAIN}" in str(e)


def with_extra(calls: Iterator[Call], view_id: str | None, offsets: Offsets | None,
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
        check = offsets_arg(want, offsets) if last else (offsets_arg(want, None) if want else "")
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


# ----------------------------------------------------------------------------- replies


def apply_result(reply: Sequence) -> ApplyResult:
    """``kvbus_apply``'s reply: applied, skipped, entries delta, resets, clears."""
    applied, skipped, delta, resets, clears = (int(x) for x in reply)
    return ApplyResult(applied, skipped, delta, resets, clears)


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


def parse_dump(reply: Sequence) -> HolderDump:
    """``kvbus_dump``'s reply (holder state fields, seen, tiers) as a :class:`HolderDump`."""
    state, seen, tiers = reply
    fields = {text(state[j]): state[j + 1] for j in range(0, len(state), 2)}
    out = HolderDump(seen=float(seen) if seen is not None else None)
    f = fields.get("f")
    out.floor = FLOOR.unpack(f)[0] if f is not None else None
    m = fields.get("m")
    out.model = text(m) if m is not None else None
    for name, v in fields.items():
        if name.startswith("p:"):
            e, sq, i = (int(x) for x in STATE_POS.unpack(v))
            out.positions.append((name[2:], e, sq, i))
    for code, desc, rc, raws, extra in tiers:
        origin = text(fields[f"t:{int(code)}"][vk.STATE_TIER.size:])
        more = b"".join(extra[j] * int(extra[j + 1]) for j in range(0, len(extra), 2))
        out.tiers.append((text(desc), text(rc) == "1", origin, raws, more))
    out.groups = sorted((int(name[2:]), text(v)) for name, v in fields.items() if name.startswith("g:"))
    return out


def restore_calls(prefix: str, replica: str, dp_rank: int, state: HolderDump, max_hashes: int = 16384) -> list[list]:
    """``kvbus_restore``'s arguments writing one holder from ``state``: one call per tier piece of at
    most ``max_hashes`` hashes (Redis stays responsive: ~40 ms per call)."""
    head = [prefix, replica, dp_rank, "" if state.seen is None else repr(state.seen),
            "" if state.floor is None else repr(state.floor), len(state.positions)]
    for topic, e, sq, i in state.positions:
        head += (topic, e, sq, i)
    step = 8 * max_hashes
    pieces: list[tuple[str, str, str, bytes, bytes]] = []
    for desc, rc, origin, raws, extra in state.tiers:
        for j in range(0, max(len(raws), len(extra), 1), step):
            pieces.append((desc, "1" if rc else "0", origin, raws[j:j + step], extra[j:j + step]))
    groups: list = [len(state.groups)] if state.groups else []
    for g, spec in state.groups:
        groups += (g, spec)
    out = []
    for j in range(max(len(pieces), 1)):
        part = pieces[j:j + 1]
        args = head + [len(part)]
        for piece in part:
            args += piece
        args.append(state.model or "")
        out.append(args + groups)
    return out


# ----------------------------------------------------------------------------- locks


def take_lock(r: Any, key: str, token: str, ttl_ms: int) -> bool:
    """``SET key token NX PX ttl_ms``: whether ``token`` now holds the lock."""
    return bool(r.set(key, token, nx=True, px=ttl_ms))


def renew_lock(r: Any, key: str, token: str, ttl_ms: int) -> bool:
    """Hold the lock ``ttl_ms`` more if ``token`` holds it."""
    if r.get(key) != token.encode():
        return False
    r.set(key, token, px=max(1, ttl_ms))
    return True


def free_lock(r: Any, key: str, token: str) -> None:
    """Delete the lock if ``token`` holds it."""
    if r.get(key) == token.encode():
        r.delete(key)
