"""The lookup protocol: how a reader asks the residency view for the longest cached prefix.

One place for what the view's writer (the sinks' stores) and its readers (:mod:`kvbus.client`,
``kvbus lookup``) must agree on; the specification for other languages is
docs/lookup-protocol.md. Pure Python: no Redis client here (the Redis side is
:mod:`kvbus.sinks.view.cluster`).

* the key layout version (:data:`LAYOUT`; the function library is loaded with it filled in);
* key names: ``P meta``, ``P hname``, ``P status``, the guard key, shard prefixes ``P{s<i>}:``;
* the call: ``FCALL_RO kvbus_lookup <numkeys> [keys] P <chain> <weights> ["\0model" <model>]
  ["\0predicted" <weight>] [candidates...]`` (:func:`lookup_args`, :data:`LOOKUP_OPTIONS`) and its reply
  ``{head, hids, descs}`` (:func:`parse_reply`);
* predictions: ``FCALL kvbus_predict`` (:func:`predict_args`), a router's record of where it sent a prompt;
* holder names: hid -> ``"<replica>#<dp_rank>"`` (``P hname``), display names (:func:`display_name`),
  a cache of them (:class:`HolderNames`);
* the answer (:class:`HolderMatch`), its ranking (:func:`rank_key`) and its JSON form;
* the view's status (:func:`view_status`).
"""
from __future__ import annotations

import math
import struct
import time
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

from kvbus.schemas import view_keys
from kvbus.schemas.events import check_model
from kvbus.schemas.tiers import label

LAYOUT = "3"
"""The key layout version, i.e. the lookup protocol's version: the field ``layout`` of ``P meta``.
It changes whenever anything a reader reads changes incompatibly (keys, the call's arguments, its
reply). The function library (``kvbus.lua``) is loaded with this value filled in."""

DEFAULT_PREFIX = "kvbus:"
"""The view's key prefix ``P`` unless the sinks run with ``--prefix`` / ``KVBUS_SINK_PREFIX``."""
LOOKUP_FUNCTION = "kvbus_lookup"
"""The read-only function a lookup calls (``FCALL_RO``)."""
PREDICT_FUNCTION = "kvbus_predict"
"""The function a router calls (``FCALL``: it writes) to record a prompt's blocks as predicted on the holder
it chose (docs/lookup-protocol.md, "Predicted entries")."""
DEFAULT_PREDICT_TTL = 5.0
"""Seconds a predicted entry counts unless the router says otherwise: long enough for the engine's
BlockStored to reach the view (a prefill, the bridge, the worker, the sink), short enough that a
prediction that never came true soon stops attracting requests."""
MAX_PREDICT_TTL = 600.0
"""The longest TTL ``kvbus_predict`` takes (seconds): predictions are meant to bridge seconds."""
PREDICTED_LABEL = "predicted"
"""The tier label a lookup with the ``predicted`` option gives the run of blocks held or predicted, for a
holder whose answer a prediction lengthened (the reply's pseudo tier code 64, descriptor
``predicted||0``)."""
NAMES_TTL = 10.0
"""Seconds a reader trusts its cache of holder names (display names depend on every holder)."""
SCORE_SCALE = 1_000_000
"""The reply's scores are ``score * SCORE_SCALE`` rounded to integers."""

LAYOUT_FIELD = "layout"
"""Field of ``P meta``: :data:`LAYOUT` of the view (absent: a view with no block yet)."""
SHARDS_FIELD = "shards"
"""Field of ``P{s0}:meta`` on Redis Cluster: the sharded view's number of shards."""

READY, REBUILDING, MISSING = "ready", "rebuilding", "missing"
"""Values of a view's status ``state``: answers complete; a sink is rebuilding a lost view (answers
may miss blocks); no view at all."""


class LayoutMismatch(RuntimeError):
    """The view was written with another key layout than this reader speaks (:data:`LAYOUT`)."""


# ----------------------------------------------------------------------------- keys


def meta_key(prefix: str) -> str:
    """``P meta``: the view's metadata (``layout``, ``vid``, and on shard 0 of a cluster ``shards``)."""
    return view_keys.META(prefix)


def guard_key(prefix: str) -> str:
    """``P guard``: a key never written, declared by every call on Redis Cluster so that Redis refuses
    the call (TRYAGAIN) while the shard's slot is being migrated."""
    return view_keys.GUARD(prefix)


def hname_key(prefix: str) -> str:
    """``P hname``: holder id (decimal) -> holder name ``"<replica>#<dp_rank>"`` (skip the field ``""``)."""
    return view_keys.HNAME(prefix)


def status_key(prefix: str) -> str:
    """``P status``: whether answers can be trusted (``state``, ``since``, ``phase``, ...)."""
    return view_keys.STATUS(prefix)


def shard_prefix(prefix: str, i: int) -> str:
    """Key prefix of shard ``i`` of a sharded view: ``P{s<i>}:`` (one hash slot per shard)."""
    return f"{prefix}{{s{i}}}:"


def declared_keys(prefix: str) -> tuple[str, str]:
    """The keys a call on Redis Cluster declares: ``P meta`` (routes the call) and ``P guard``."""
    return meta_key(prefix), guard_key(prefix)


def check_layout(prefix: str, layout: str | bytes | None) -> None:
    """Raise :class:`LayoutMismatch` unless ``layout`` (``P meta layout``; None: no block yet) is :data:`LAYOUT`."""
    if isinstance(layout, bytes):
        layout = layout.decode()
    if layout is not None and layout != LAYOUT:
        raise LayoutMismatch(f"the view under {prefix!r} has layout {layout}; this client speaks {LAYOUT}: "
                             "use a kvbus release that speaks it, or rebuild the view under a new prefix")


# ----------------------------------------------------------------------------- the call


@dataclass(frozen=True)
class LookupOption:
    """One option of ``kvbus_lookup``: the argument ``"\\0" + name``, then its value, after the weights and
    before the candidates (an argument that starts with NUL names an option; holder names never contain
    NUL). Declared once in :data:`LOOKUP_OPTIONS`: ``kvbus lookup`` has a flag for each, the Go package's
    ``LookupOptions`` lists the same (``tests/test_lookup_protocol.py``), and the function library answers
    ``kvbus: unknown lookup option`` to any other."""

    name: str
    """Its name: the wire argument after NUL, :meth:`ViewClient.lookup`'s keyword, ``kvbus lookup``'s flag
    ``--<name>`` and the Go client's ``Query.Options`` key."""
    meaning: str
    """What it does (the flags' help)."""
    check: Callable[[Any], str | None]
    """The value as sent (None: not given); ValueError for a value the option refuses."""

    @property
    def wire(self) -> str:
        """The argument naming it."""
        return "\0" + self.name


def check_weight(value: Any) -> str | None:
    """A ``predicted`` weight as sent: a finite number >= 0 (None: not given); ValueError otherwise."""
    if value is None:
        return None
    try:
        w = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"predicted: {value!r} is not a number") from None
    if not math.isfinite(w) or w < 0:
        raise ValueError(f"predicted: the weight must be a finite number >= 0, not {value!r}")
    return repr(w)


LOOKUP_OPTIONS: tuple[LookupOption, ...] = (
    LookupOption("model", "only replicas serving this model (their bridges' --model); default: every replica, "
                          "whatever its model", check_model),
    LookupOption("predicted", "count predicted entries (routers' predictions not yet confirmed by the engine) "
                              "as held, each block with this weight; default: only what the engines reported",
                 check_weight),
)
"""Every lookup option, in the order a call sends them."""
MODEL_OPTION = LOOKUP_OPTIONS[0].wire
"""The lookup option naming a model: only holders whose latest event named that model answer."""
PREDICTED_OPTION = LOOKUP_OPTIONS[1].wire
"""The lookup option counting predicted entries, with their weight."""


def option_args(**values: Any) -> list[str]:
    """The lookup options named in ``values`` (None: not given) as ``kvbus_lookup`` arguments, checked
    (ValueError for a bad value, TypeError for an option :data:`LOOKUP_OPTIONS` does not declare)."""
    unknown = set(values) - {o.name for o in LOOKUP_OPTIONS}
    if unknown:
        raise TypeError(f"unknown lookup option(s) {sorted(unknown)}: the options are "
                        f"{[o.name for o in LOOKUP_OPTIONS]}")
    out: list[str] = []
    for o in LOOKUP_OPTIONS:
        value = o.check(values.get(o.name))
        if value is not None:
            out += [o.wire, value]
    return out


def lookup_args(prefix: str, chain: Sequence[bytes], weights: str, candidates: Iterable[str] = (),
                options: Sequence[str] = ()) -> list:
    """``kvbus_lookup``'s arguments after the keys: ``P``, the chain (8-byte hashes, block 0 first,
    concatenated), the weights spec ``"NAME=W,..."`` (may be empty), the lookup ``options`` (from
    :func:`option_args`: e.g. the model option, so that only holders whose latest event named that model
    answer), then candidate holder or replica names."""
    return [prefix, b"".join(chain), weights, *options, *candidates]


LOAD_SEPARATOR = "\0"
"""Between a router's name, a replica's name and ``t`` in the fields of ``P load`` (names never contain NUL)."""


@dataclass(frozen=True)
class Load:
    """One replica's load, summed over every router whose lease has not run out."""

    requests: int = 0
    """Requests routed to it and not completed."""
    tokens: int = 0
    """Their prompt tokens."""


def _name(name: str, what: str) -> str:
    if not name or LOAD_SEPARATOR in name:
        raise ValueError(f"a {what} name must be a non-empty string without NUL, got {name!r}")
    return name


def load_fields(router: str, replica: str) -> tuple[str, str]:
    """The fields of ``P load`` counting ``router``'s requests in flight on ``replica`` and their prompt tokens."""
    field = _name(router, "router") + LOAD_SEPARATOR + _name(replica, "replica")
    return field, field + LOAD_SEPARATOR + "t"


def lease_field(router: str) -> str:
    """The field of ``P load`` holding ``router``'s lease: the Unix ms it counts until."""
    return _name(router, "router")


def _split_load(raw: Mapping) -> tuple[dict[str, int], list[tuple[list[str], int, Any]]]:
    leases: dict[str, int] = {}
    counts = []
    for f, v in raw.items():
        parts = _s(f).split(LOAD_SEPARATOR)
        if len(parts) == 1:
            leases[parts[0]] = int(v)
        else:
            counts.append((parts, int(v), f))
    return leases, counts


def parse_load(raw: Mapping, now_ms: int) -> dict[str, Load]:
    """Replica -> its :class:`Load` from ``HGETALL P load``: the counts of routers whose lease ends after
    ``now_ms``, summed; a sum below zero (a completion counted after a Redis restart lost the start) is 0;
    replicas with nothing in flight are left out."""
    leases, counts = _split_load(raw)
    requests: dict[str, int] = {}
    tokens: dict[str, int] = {}
    for parts, n, _ in counts:
        if leases.get(parts[0], 0) <= now_ms:
            continue
        into = tokens if len(parts) > 2 else requests
        into[parts[1]] = into.get(parts[1], 0) + n
    out = {r: Load(max(0, requests.get(r, 0)), max(0, tokens.get(r, 0))) for r in set(requests) | set(tokens)}
    return {r: x for r, x in sorted(out.items()) if x.requests or x.tokens}


def expired_fields(raw: Mapping, before_ms: int) -> list:
    """The fields of ``HGETALL P load`` (as read) of routers whose lease ended before ``before_ms``."""
    leases, counts = _split_load(raw)
    gone = {r for r, until in leases.items() if until < before_ms}
    return [f for f in raw if _s(f) in gone] + [f for parts, _, f in counts if parts[0] in gone]


def predict_holder(name: str) -> tuple[str, int]:
    """The holder a prediction names: ``"<replica>#<dp_rank>"`` (split at the last ``#`` followed by a
    decimal rank), or a replica name alone for its dp rank 0 (what :attr:`HolderMatch.name` is for a
    replica with one holder)."""
    replica, sep, dp = name.rpartition("#")
    if sep and dp.isascii() and dp.isdecimal():
        return replica, int(dp)
    return name, 0


def shard_of(holder: str, shards: int) -> int:
    """The shard of holder ``"<replica>#<dp>"`` in the sharded view: crc32 of its name mod ``shards``
    (stable across processes and languages: zlib's CRC-32, as Go's ``hash/crc32.ChecksumIEEE``)."""
    return zlib.crc32(holder.encode()) % shards


def holder_shard(replica: str, dp_rank: int, shards: int) -> int:
    """:func:`shard_of` the holder ``(replica, dp_rank)``."""
    return shard_of(f"{replica}#{dp_rank}", shards)


def predict_ttl_ms(ttl: float) -> int:
    """A prediction's TTL in seconds as ``kvbus_predict`` takes it (ms, at least 1); ValueError beyond
    :data:`MAX_PREDICT_TTL` or for a TTL that is not positive."""
    if isinstance(ttl, bool) or not (isinstance(ttl, (int, float)) and 0 < ttl <= MAX_PREDICT_TTL):
        raise ValueError(f"ttl={ttl!r}: a prediction lives more than 0 and at most {MAX_PREDICT_TTL:g} seconds")
    return max(1, round(ttl * 1000))


def predict_args(prefix: str, replica: str, dp_rank: int, chain: Sequence[bytes], ttl: float,
                 model: str | None = None) -> list:
    """``kvbus_predict``'s arguments after the keys: ``P``, the holder's replica and dp rank, the TTL in ms,
    the chain (8-byte hashes concatenated), the model (``""``: none named)."""
    return [prefix, replica, str(dp_rank), str(predict_ttl_ms(ttl)), b"".join(chain), check_model(model) or ""]


@dataclass(frozen=True)
class Group:
    """One group of ``kvbus_lookup``'s reply: holders with identical answers."""

    matched: int
    """Leading blocks of the chain held, in any tier."""
    score_micro: int
    """Score in millionths (``score * SCORE_SCALE``)."""
    tiers: dict[str, int]
    """Tier label -> leading blocks of the chain held in that tier."""
    hids: tuple[int, ...]
    """Holder ids (per view: resolve them through that view's ``P hname``)."""
    groups: dict[int, int] = field(default_factory=dict)
    """Hybrid-model holders (two KV cache groups or more): KV cache group -> that group's own hit, in
    blocks of the chain; empty for any other holder (docs/lookup-protocol.md, "Hybrid models")."""


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def parse_reply(reply: Sequence) -> list[Group]:
    """Decode ``kvbus_lookup``'s reply ``{head, hids, descs}`` (docs/lookup-protocol.md, "Reply"), with the
    KV cache groups' runs of the trailing part of ``head`` when there is one."""
    head, blobs, descs = reply[:3]
    labels = {int(descs[i]): label(_s(descs[i + 1])) for i in range(0, len(descs), 2)}
    parts = []
    k = 0
    for blob in blobs:
        matched, score, n = int(head[k]), int(head[k + 1]), int(head[k + 2])
        tiers = {labels[int(head[k + 3 + 2 * j])]: int(head[k + 4 + 2 * j]) for j in range(n)}
        k += 3 + 2 * n
        parts.append((matched, score, tiers, struct.unpack(f">{len(blob) // 4}I", blob)))
    groups: list[dict[int, int]] = []
    if k < len(head):  # the trailing part: per group, n pairs (KV cache group, run)
        for _ in parts:
            n = int(head[k])
            groups.append({int(head[k + 1 + 2 * j]): int(head[k + 2 + 2 * j]) for j in range(n)})
            k += 1 + 2 * n
    return [Group(*p, groups[i] if groups else {}) for i, p in enumerate(parts)]


# ----------------------------------------------------------------------------- holders and answers


def split_holder(name: str) -> tuple[str, int]:
    """``"<replica>#<dp_rank>"`` -> (replica, dp_rank), split at the last ``#``."""
    replica, _, dp = name.rpartition("#")
    return replica, int(dp)


def display_name(replica: str, dp_rank: int, dp_ranks: int) -> str:
    """A holder's name in answers: ``<replica>`` when the replica has one holder (``dp_ranks``, the
    holders the views list for it) and its rank is 0, else ``<replica>#<dp_rank>``."""
    return replica if dp_ranks <= 1 and dp_rank == 0 else f"{replica}#{dp_rank}"


def display_names(holders: Iterable[str]) -> dict[str, str]:
    """Display name of each holder name ``"<replica>#<dp_rank>"`` (:func:`display_name`)."""
    split = {h: split_holder(h) for h in holders}
    counts: dict[str, int] = {}
    for replica, _ in split.values():
        counts[replica] = counts.get(replica, 0) + 1
    return {h: display_name(replica, dp, counts[replica]) for h, (replica, dp) in split.items()}


@dataclass
class HolderMatch:
    """One holder's answer to a lookup."""

    replica: str
    """Engine replica id (what a router routes to)."""
    dp_rank: int
    """Data-parallel rank of the engine within the replica."""
    matched: int
    """Leading blocks of the chain held, in any tier (0 is never answered: a holder must hold block 0); for
    a hybrid-model holder (:attr:`groups`), the blocks vLLM's hybrid coordinator would hit (0 is not
    answered either)."""
    tiers: dict[str, int]
    """Per tier label (``GPU``, ``CPU``, ``CPU@kvcr``, ``GPU/g1``): leading blocks of the chain held in that tier."""
    score: float
    """Sum over the matched blocks of the best weight among the tiers holding each block."""
    dp_ranks: int = 1
    """Holders the view lists for the replica (decides :attr:`name`)."""
    groups: dict[int, int] = field(default_factory=dict)
    """Hybrid-model holders (their events named two KV cache groups or more): KV cache group -> that
    group's own hit in blocks of the chain (vLLM's ``find_longest_cache_hit_per_group``); empty for any
    other holder (docs/lookup-protocol.md, "Hybrid models")."""

    @property
    def name(self) -> str:
        """Display name: ``<replica>`` for a replica whose only holder has rank 0, else ``<replica>#<rank>``."""
        return display_name(self.replica, self.dp_rank, self.dp_ranks)

    @property
    def holder(self) -> str:
        """The holder's full name ``"<replica>#<dp_rank>"`` (what ``candidates`` accepts too)."""
        return f"{self.replica}#{self.dp_rank}"

    def to_json(self) -> dict:
        """The value of ``kvbus lookup --json`` for this holder; ``groups`` (keys: the group indices as
        strings, ascending) only for a hybrid-model holder."""
        out = {
            "matched": self.matched,
            "tiers": dict(sorted(self.tiers.items())),
            "score": round(self.score, 6),
            "replica": self.replica,
            "dp_rank": self.dp_rank,
        }
        if self.groups:
            out["groups"] = {str(g): run for g, run in sorted(self.groups.items())}
        return out


def rank_key(m: HolderMatch) -> tuple:
    """The order of answers, best first: score descending, then matched descending, then display name
    ascending (what ``kvbus lookup --json`` prints). Holders equal on (score, matched) are tied: the
    name only makes the order reproducible (:mod:`kvbus.sinks.view.ties` for routers)."""
    return -m.score, -m.matched, m.name


def tie_key(m: HolderMatch) -> tuple[float, int]:
    """What two holders must share to be tied: (score, matched)."""
    return m.score, m.matched


HolderTable = Mapping[int, str]
"""One view's ``P hname``: holder id -> holder name ``"<replica>#<dp_rank>"``."""


def parse_hname(raw: Mapping) -> dict[int, str]:
    """``HGETALL P hname`` (bytes or str) -> {hid: holder name}, without the padding field ``""``."""
    return {int(k): _s(v) for k, v in raw.items() if k not in (b"", "")}


class HolderNames:
    """A reader's cache of holder names over one view or the shards of a sharded view.

    Holder ids are per view and never reused; display names count a replica's holders over all
    views. The cache is read again when it is older than ``ttl`` seconds or a reply names a holder
    id it does not know (:meth:`answer`).
    """

    def __init__(self, ttl: float = NAMES_TTL, clock: Callable[[], float] = time.monotonic):
        self.ttl = ttl
        self.clock = clock
        self._names: list[dict[int, tuple[str, int, int]]] = []
        self._at = float("-inf")

    @property
    def stale(self) -> bool:
        """Whether the cache must be read again before it is used."""
        return self.clock() - self._at > self.ttl

    def update(self, tables: Sequence[HolderTable]) -> None:
        """Replace the cache by ``tables`` (one per view, in the order replies are given)."""
        split = [{hid: split_holder(name) for hid, name in t.items()} for t in tables]
        ranks: dict[str, int] = {}
        for view in split:
            for replica, _ in view.values():
                ranks[replica] = ranks.get(replica, 0) + 1
        self._names = [{hid: (r, dp, ranks[r]) for hid, (r, dp) in view.items()} for view in split]
        self._at = self.clock()

    def matches(self, replies: Sequence[Sequence | None]) -> list[HolderMatch]:
        """The holders of ``replies`` (one ``kvbus_lookup`` reply per view, None for a view not asked);
        KeyError for a holder id the cache does not know."""
        out = []
        for view, reply in enumerate(replies):
            if not reply or not reply[1]:
                continue
            names = self._names[view]
            for g in parse_reply(reply):
                score = g.score_micro / SCORE_SCALE
                for hid in g.hids:
                    replica, dp, nr = names[hid]
                    out.append(HolderMatch(replica, dp, g.matched, dict(g.tiers), score, nr, dict(g.groups)))
        return out

    def answer(self, replies: Sequence[Sequence | None],
               fetch: Callable[[], Sequence[HolderTable]]) -> list[HolderMatch]:
        """:meth:`matches`, after reading the tables with ``fetch`` when the cache is stale, and once
        more when a reply names a holder created since they were read."""
        if self.stale or len(self._names) != len(replies):
            self.update(fetch())
        try:
            return self.matches(replies)
        except KeyError:
            self.update(fetch())
            return self.matches(replies)


# ----------------------------------------------------------------------------- status


@dataclass(frozen=True)
class ViewStatus:
    """Whether a view's answers can be trusted (``P status``, written by the sinks)."""

    state: str
    """:data:`READY` (complete as of its Kafka offsets), :data:`REBUILDING` (a sink is rebuilding a lost
    view: answers may miss blocks) or :data:`MISSING` (no view: Redis lost it and no sink started rebuilding)."""
    fields: dict[str, str] = field(default_factory=dict)
    """Everything ``P status`` holds: ``since`` (epoch s), during a rebuild ``phase`` (``restoring``,
    ``replaying``), ``snapshot``, ``target``; empty for a view written without a sink."""

    @property
    def ready(self) -> bool:
        """Whether answers are complete."""
        return self.state == READY

    @property
    def since(self) -> float | None:
        """When the state began (epoch s), if recorded."""
        v = self.fields.get("since")
        try:
            return float(v) if v is not None else None
        except ValueError:
            return None

    @property
    def phase(self) -> str | None:
        """The rebuild's phase (``restoring``, ``replaying``), if rebuilding."""
        return self.fields.get("phase")

    def as_dict(self) -> dict[str, str]:
        """``fields`` with ``state`` set (the form ``kvbus.sinks.rebuild.view_status`` returns)."""
        return {**self.fields, "state": self.state}


def view_status(statuses: Sequence[Mapping], meta_exists: Iterable[bool]) -> ViewStatus:
    """The status of a view from each view's (shard's) ``HGETALL P status`` and whether its ``P meta``
    exists: rebuilding if any says so, else the first state recorded, else ready if any ``P meta``
    exists (a view written without a sink), else missing."""
    decoded = [{_s(k): _s(v) for k, v in st.items()} for st in statuses]
    for st in decoded:
        if st.get("state") == REBUILDING:
            return ViewStatus(REBUILDING, st)
    for st in decoded:
        if st.get("state"):
            return ViewStatus(st["state"], st)
    return ViewStatus(READY if any(meta_exists) else MISSING, next((st for st in decoded if st), {}))
