"""The one conversion of engine KV events into :mod:`kvbus.schemas.events` structs, used by the bridge's
decoder (on its wire structs, :mod:`kvbus.producers.wire_structs`) and by the in-process publisher (on an
engine's own event objects) alike.

A :class:`Conversion` is built from the fields the release tables say engines send, per event type
(:data:`kvbus.producers.engines.SENT`), and from the kvbus event structs. Each field an engine sends is
copied into the kvbus field of the same name as it is, unless :data:`RULES` says how it becomes kvbus
fields:

- ``block_hashes``: canonical 8-byte hashes, and for digests ``block_digests`` too
  (:func:`kvbus.schemas.events.canonical_hashes`, the hash rule);
- ``parent_block_hash``: its canonical hash and digest (:func:`kvbus.schemas.events.canonical_parent`);
- ``token_ids``: kept, or SGLang's EAGLE bigram pairs moved to ``token_id_pairs`` (:func:`engine_tokens`);
- ``medium``: :func:`kvbus.schemas.events.normalize_medium`, the medium rule;
- ``extra_keys``: the exact msgpack bytes of the value (:func:`extra_keys_bytes`).

A field the source lacks takes the kvbus struct's default. So an optional field added to a release
table and to its kvbus struct reaches the bridge's records and the publisher's with no edit here.

The converters are generated Python, one per source class, because they run once per event on the
producers' hot paths: a generated function reads the source's fields by attribute, calls the rules
and builds the struct with no loop over field names.
"""
from __future__ import annotations

import linecache
import types
import typing
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import msgspec
from msgspec import Raw

from kvbus.schemas.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    Reset,
    canonical_hashes,
    canonical_parent,
    normalize_medium,
)

ENGINE_EVENTS: dict[str, type] = {c.__name__: c for c in (BlockStored, BlockRemoved, AllBlocksCleared)}
"""Event types the engines publish (their class names, the wire tags) -> the kvbus struct each becomes."""

_MSGPACK = msgspec.msgpack.Encoder()


def extra_keys_bytes(value: Any) -> bytes | None:
    """An engine's ``extra_keys`` as the msgpack bytes kvbus carries: a :class:`msgspec.Raw` (what the
    decoder reads) as the engine sent it, any other value (an engine's own object) encoded. None, nil
    and an absent value give None."""
    if value is None:
        return None
    if type(value) is Raw:
        b = bytes(value)
        return None if not b or b == b"\xc0" else b
    return _MSGPACK.encode(value)


def engine_tokens(tokens: Any) -> tuple[list, list[list[int]] | None]:
    """``(token_ids, token_id_pairs)`` of an engine's ``token_ids``: token ids as a list, and None; or for
    SGLang's EAGLE bigram pairs ``[[a, b], ...]``, [] and the pairs. None gives ``([], None)``."""
    if not tokens:
        return [], None
    first = tokens[0]
    if type(first) is list:
        return [], tokens if type(tokens) is list else list(tokens)
    if type(first) is tuple:
        return [], [list(p) for p in tokens]
    return (tokens if type(tokens) is list else list(tokens)), None


class Memo(dict):
    """``memo[v]``: ``fn(v)``, computed once per value for the first ``size`` values seen (a dict lookup,
    in C, on the hot paths afterwards). For rules over few distinct values, such as mediums."""

    def __init__(self, fn: Callable[[Any], Any], size: int = 256):
        super().__init__()
        self.fn, self.size = fn, size

    def __missing__(self, value: Any) -> Any:
        out = self.fn(value)
        if len(self) < self.size:
            self[value] = out
        return out


MEDIUMS = Memo(normalize_medium)
"""Engine medium -> kvbus medium (:func:`kvbus.schemas.events.normalize_medium`), remembered."""


@dataclass(frozen=True)
class Rule:
    """How one engine field becomes kvbus fields."""

    outputs: tuple[str, ...]
    """The kvbus fields it sets: one, or several that ``convert`` returns as a tuple in this order."""
    convert: Callable[[Any], Any]
    """Engine value (None when the source lacks the field) -> the output value, or the tuple of them."""
    kinds: tuple[type, ...]
    """Python types of the field's msgpack value when set: what the vLLM-vs-SGLang rule accepts for it
    (:meth:`kvbus.producers.engines.Adapter.read`). vLLM's ``extra_keys`` is a list of per-block keys."""
    same_when: str = ""
    """A condition on the engine value ``v`` under which ``convert`` gives ``v`` as the first output and
    None as the others: tested inline by the generated converters, which call ``convert`` otherwise."""


RULES: dict[str, Rule] = {
    "block_hashes": Rule(("block_hashes", "block_digests"), canonical_hashes, (list,)),
    "parent_block_hash": Rule(("parent_block_hash", "parent_block_digest"), canonical_parent, (int, bytes),
                              same_when="v is None"),
    "token_ids": Rule(("token_ids", "token_id_pairs"), engine_tokens, (list,),
                      same_when="type(v) is list and (not v or type(v[0]) is int)"),
    "medium": Rule(("medium",), MEDIUMS.__getitem__, (str,)),
    "extra_keys": Rule(("extra_keys",), extra_keys_bytes, (list,), same_when="v is None"),
}
"""Engine field -> how it becomes kvbus fields; every other field is copied as it is."""


def _python_types(t: Any) -> tuple[type, ...]:
    """The Python types of a msgspec field type, None left out (``int | None`` -> ``(int,)``)."""
    origin = typing.get_origin(t)
    if isinstance(t, types.UnionType) or origin is typing.Union:
        return tuple(x for a in typing.get_args(t) for x in _python_types(a))
    if origin is typing.Annotated:
        return _python_types(typing.get_args(t)[0])
    if t is type(None):
        return ()
    if t is Any:
        return (object,)
    return (origin if isinstance(origin, type) else t,)


def _kinds(cls: type) -> dict[str, tuple[type, ...]]:
    out = {f.name: _python_types(f.type) for f in msgspec.structs.fields(cls)}
    out.update((name, r.kinds) for name, r in RULES.items() if name in out)
    return out


KINDS: dict[str, dict[str, tuple[type, ...]]] = {tag: _kinds(cls) for tag, cls in ENGINE_EVENTS.items()}
"""Event type -> field -> the Python types of its msgpack value when set: the rule's for a converted
field, else the kvbus struct's field type."""


def _default(f: msgspec.structs.FieldInfo) -> tuple[str, Any]:
    """``("value", default)`` or ``("factory", default_factory)`` of a kvbus field."""
    if f.default_factory is not msgspec.NODEFAULT:
        return "factory", f.default_factory
    return "value", (None if f.default is msgspec.NODEFAULT else f.default)


class Conversion:
    """Engine events -> kvbus event structs, from ``sent``: event type -> the fields some release of
    some engine sends (the union of the release tables). ValueError when a table names a field that
    neither a rule nor the kvbus struct knows."""

    def __init__(self, sent: Mapping[str, tuple[str, ...]]):
        self.sent = {tag: tuple(sent.get(tag, ())) for tag in ENGINE_EVENTS}
        for tag, names in self.sent.items():
            known = {f.name for f in msgspec.structs.fields(ENGINE_EVENTS[tag])}
            made = {o for n in names if n in RULES for o in RULES[n].outputs}
            for name in names:
                targets = RULES[name].outputs if name in RULES else (name,)
                if any(t not in known for t in targets) or (name not in RULES and name in made):
                    raise ValueError(f"engines send {tag}.{name}, which the kvbus {tag} struct cannot hold "
                                     f"(it needs the fields {', '.join(targets)})")
        self._converters: dict[tuple[type, str], Callable[[Any], Event]] = {}

    def copied(self, tag: str) -> tuple[tuple[str, Any], ...]:
        """``(field, kvbus default)`` of the fields of event type ``tag`` copied as they are."""
        fields = {f.name: f for f in msgspec.structs.fields(ENGINE_EVENTS[tag])}
        return tuple((n, _default(fields[n])[1]) for n in self.sent[tag] if n not in RULES)

    def converter(self, source: type, tag: str) -> Callable[[Any], Event]:
        """The conversion of events of class ``source`` and type ``tag`` (BlockStored, BlockRemoved,
        AllBlocksCleared) to their kvbus struct, generated on first request and kept. A msgspec struct
        class is read by its fields; any other object by ``getattr``, absent attributes at their
        defaults. ValueError for another ``tag``."""
        key = (source, tag)
        fn = self._converters.get(key)
        if fn is None:
            if tag not in ENGINE_EVENTS:
                raise ValueError(f"unknown KV event type {tag}")
            fn = self._converters[key] = self._generate(source, tag)
        return fn

    def event(self, obj: Any) -> Event:
        """An engine's event object as its kvbus struct, by its class name (BlockStored, BlockRemoved,
        AllBlocksCleared); a kvbus event struct is returned as it is. ValueError for any other type."""
        t = type(obj)
        if t in _KVBUS:
            return obj
        fn = self._converters.get((t, t.__name__))
        if fn is None:
            fn = self.converter(t, t.__name__)
        return fn(obj)

    def _generate(self, source: type, tag: str) -> Callable[[Any], Event]:
        cls = ENGINE_EVENTS[tag]
        fields = {f.name: f for f in msgspec.structs.fields(cls)}
        has: tuple[str, ...] | None = getattr(source, "__struct_fields__", None)
        ns: dict[str, Any] = {"K": cls, "_get": getattr}
        lines, args = [], []
        for name in self.sent[tag]:
            if has is not None and name not in has:
                continue  # the source never has it: the kvbus default
            read = f"w.{name}" if has is not None else f"_get(w, {name!r}, None)"
            rule = RULES.get(name)
            if rule is not None:
                ns[f"R_{name}"] = rule.convert
                outs = ", ".join(rule.outputs)
                if rule.same_when:
                    same = f"({', '.join(['v', *['None'] * (len(rule.outputs) - 1)])})"
                    lines += [f"    v = {read}", f"    {outs} = {same} if {rule.same_when} else R_{name}(v)"]
                else:
                    lines.append(f"    {outs} = R_{name}({read})")
                args += [f"{o}={o}" for o in rule.outputs]
            elif has is not None:
                args.append(f"{name}={read}")
            else:
                kind, default = _default(fields[name])
                ns[f"D_{name}"] = default
                args.append(f"{name}=_get(w, {name!r}, None) or D_{name}()" if kind == "factory"
                            else f"{name}=_get(w, {name!r}, D_{name})")
        src = "def convert(w):\n" + "".join(f"{line}\n" for line in lines) + f"    return K({', '.join(args)})\n"
        filename = f"<kvbus.producers.engines.convert {tag} from {source.__qualname__}>"
        linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)
        exec(compile(src, filename, "exec"), ns)
        return ns["convert"]


_KVBUS = frozenset({BlockStored, BlockRemoved, AllBlocksCleared, Reset})
