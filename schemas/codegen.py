"""Python source of the Avro encoders, decoders and event scanners of kvbus's records, generated
from the parsed ``.avsc`` schemas (:func:`kvbus.schemas.avro.parsed_schema`); :mod:`kvbus.schemas.codec`
executes it at import.

Why generated: a generic Avro library walks the schema for every value (fastavro's writer and
confluent's serializer take 20-60 µs per kvbus record, most of it resolving ``["null", X]``
unions); code written for one schema does the same in 1-3 µs. Writing that code by hand meant
seven modules to edit for each new field; generating it from the schema means none. The
generated functions call the primitives of :mod:`kvbus.schemas.codec_runtime`.

For each record ``R`` (``kvbus.BlockStored`` -> ``kvbus_BlockStored``) and each union of
records it makes:

* ``w_R(obj) -> bytes``: the body fastavro's ``schemaless_writer`` writes for the struct;
* ``r_R(data, pos) -> (struct, pos)``: the struct at ``pos`` (canonical encoding only, else
  :class:`~kvbus.schemas.codec_runtime.WireError`); ``d_R(data, pos=0)``: a whole value;
* ``k_R(data, pos) -> pos``: past a value without decoding it;
* ``wu_N`` / ``ru_N`` / ``ku_N``: the same for union number N (a union of records is
  written from the struct's type, or from the ``avro`` bytes of a pre-encoded value);
* ``s_R(data, start, pos, raw)``: a scanned union member: ``raw(avro, kept, without)``;
* ``scan_R(data, pos, raw, shared=None)``: a record with one array of union members scanned
  (see :func:`generate`);
* ``head_R`` / ``tail_R``: writers of a leading run of fields and of the rest of a record;
* on request (:meth:`Generator.positional_writer`), a positional writer of some fields of a
  record, the others at their defaults (a producer's common event shape).
"""
from __future__ import annotations

import ast
from typing import Any, Iterable, Optional

from kvbus.schemas import codec_runtime

PRIMITIVES = ("null", "boolean", "int", "long", "float", "double", "bytes", "string")


SCALAR_ENC = {
    "null": "NULL", "boolean": "(b'\\x01' if {v} else NULL)", "int": "LONG[{v}]", "long": "COUNTER[{v}]",
    "float": "FLOAT({v})", "double": "DOUBLE({v})", "string": "STR[{v}]", "bytes": "LONG[len({v})] + {v}",
}
"""Expression encoding a local ``{v}`` of each primitive type (runtime names: kvbus.schemas.codec_runtime).
A scalar ``long`` (epoch, sequence number, offset) goes through the cache of values in use, an
``int`` and the items of an array of longs (token ids) through the cache of small domains."""


RESERVED = {n for n in dir(codec_runtime) if not n.startswith("__")} | {"e", "enc", "head"}
"""Names the generated writers use: a field of that name could not be a parameter of them."""


def mangle(name: str) -> str:
    """A record's full name as a Python identifier."""
    return name.replace(".", "_")


def _is_null(t: Any) -> bool:
    return t == "null" or (isinstance(t, dict) and t.get("type") == "null")


def py_default(value: Any) -> str:
    """Python source of an Avro field default (for a parameter default)."""
    return repr(value)


class _Fixeds:
    """A writer's part: the array of ``fixed`` of ``size`` bytes in local ``v`` (``n``, ``j``:
    locals of its count and joined items)."""

    def __init__(self, v: str, size: int, n: str, j: str):
        self.v, self.size, self.n, self.j = v, size, n, j

    def error(self) -> str:
        return f"raise ValueError('fixed values must be {self.size} bytes each')"

    def check(self, ind: str, count: bool = True) -> list[str]:
        """Statements joining the items (counting them first if ``count``), checking their size."""
        return ([f"{ind}{self.n} = len({self.v})"] if count else []) + [
            f"{ind}{self.j} = b''.join({self.v})", f"{ind}if len({self.j}) != {self.size} * {self.n}:",
            f"{ind}    {self.error()}"]

    def parts(self) -> list[str]:
        return [f"LONG[{self.n}]", self.j, f"(NULL if {self.n} else b'')"]


class Generator:
    """Collects the schemas' named types and emits the source (see the module doc).

    ``structs``: record full name -> struct class (``msgspec.Struct``): what readers build
    and writers' unions dispatch on. ``scan``: (record, array field, raw member records,
    kept field, blanked field) for :meth:`scan_fn`; ``split``: (record, head field names,
    pre-encoded field) for :meth:`split_writers`.
    """

    def __init__(self, structs: dict[str, type]):
        self.structs = structs
        self.named: dict[str, dict] = {}
        self.unions: dict[tuple[str, ...], int] = {}
        self.out: list[str] = []
        self.done: set[str] = set()
        self.n = 0

    # -- types ---------------------------------------------------------------------------

    def resolve(self, t: Any) -> Any:
        """``t`` with a named-type reference replaced by its definition (registered on first sight)."""
        if isinstance(t, str):
            return self.named.get(t, t)
        if isinstance(t, dict) and t.get("type") in ("record", "fixed", "enum"):
            self.named.setdefault(t["name"], t)
            if t["type"] == "record":
                for f in t["fields"]:
                    self.resolve(f["type"])
        elif isinstance(t, dict) and t.get("type") == "array":
            self.resolve(t["items"])
        elif isinstance(t, dict) and t.get("type") in PRIMITIVES:
            return t["type"]
        elif isinstance(t, list):
            for b in t:
                self.resolve(b)
        return t

    def kind(self, t: Any) -> str:
        t = self.resolve(t)
        if isinstance(t, str):
            if t not in PRIMITIVES:
                raise NotImplementedError(f"unknown Avro type {t!r}")
            return t
        if isinstance(t, list):
            return "union"
        return t["type"]

    def optional(self, t: Any) -> Optional[tuple[int, Any]]:
        """For a two-branch union with null: (index of the null branch, the other branch)."""
        t = self.resolve(t)
        if isinstance(t, list) and len(t) == 2 and sum(map(_is_null, t)) == 1:
            i = 0 if _is_null(t[0]) else 1
            return i, t[1 - i]
        return None

    def record_union(self, t: Any) -> int:
        """Number of a union of records (no null), generating its functions once."""
        branches = [self.resolve(b) for b in t]
        if not all(isinstance(b, dict) and b["type"] == "record" for b in branches):
            raise NotImplementedError(f"only [null, X] unions and unions of records are supported: {t!r}")
        key = tuple(b["name"] for b in branches)
        if key not in self.unions:
            self.unions[key] = n = len(self.unions)
            for b in branches:
                self.record(b)
            self._union_fns(n, key)
        return self.unions[key]

    def record(self, t: dict) -> str:
        """Generate the functions of record ``t`` (once); its mangled name."""
        name = t["name"]
        m = mangle(name)
        if name not in self.done:
            self.done.add(name)
            for f in t["fields"]:  # nested types first
                self._prepare(f["type"])
            self._writer(t)
            self._reader(t)
            self._skipper(t)
        return m

    def _prepare(self, t: Any) -> None:
        k = self.kind(t)
        t = self.resolve(t)
        if k == "record":
            self.record(t)
        elif k == "array":
            self._prepare(t["items"])
        elif k == "union":
            opt = self.optional(t)
            if opt is not None:
                self._prepare(opt[1])
            else:
                self.record_union(t)

    def tmp(self, stem: str) -> str:
        self.n += 1
        return f"{stem}{self.n}"

    # -- encoding ------------------------------------------------------------------------

    def enc(self, t: Any, v: str) -> str:
        """Expression encoding the local ``v`` of type ``t``."""
        k = self.kind(t)
        t = self.resolve(t)
        if k in SCALAR_ENC:
            return SCALAR_ENC[k].format(v=v)
        if k == "fixed":
            return f"fixed({v}, {t['size']})"
        if k == "enum":
            return f"LONG[{t['symbols']!r}.index({v})]"
        if k == "record":
            return f"w_{mangle(t['name'])}({v})"
        if k == "array":
            items = t["items"]
            ik = self.kind(items)
            if ik in ("int", "long"):
                return f"longs({v})"
            if ik == "fixed":
                return f"fixeds({v}, {self.resolve(items)['size']})"
            x = self.tmp("x")
            if ik == "record":
                body = f"b''.join(map(w_{mangle(self.resolve(items)['name'])}, {v}))"
            elif ik == "union" and self.optional(items) is None:
                body = f"b''.join(map(wu_{self.record_union(items)}, {v}))"
            else:
                body = f"b''.join([{self.enc(items, x)} for {x} in {v}])"
            return f"((LONG[len({v})] + {body} + NULL) if {v} else NULL)"
        if k == "union":
            opt = self.optional(t)
            if opt is None:
                return f"wu_{self.record_union(t)}({v})"
            null_i, other = opt
            return (f"({self._branch(null_i)} if {v} is None else "
                    f"{self._branch(1 - null_i)} + {self.enc(other, v)})")
        raise NotImplementedError(f"Avro type {k} is not supported")

    @staticmethod
    def _branch(i: int) -> str:
        return repr(bytes(((i << 1),)))

    CACHEABLE = ("boolean", "int", "long", "string", "bytes", "fixed", "enum")
    """Types of optional fields whose runs are encoded through a cache keyed by their values (not
    floats: -0.0 == 0.0 as keys, but their encodings differ)."""
    CACHE_SIZE = 1024

    def _runs(self, fields: list[dict]) -> list[tuple[str, int, int]]:
        """The fields as segments (kind, start, end): ``cache`` (2+ consecutive optional fields of
        scalar types: one dict lookup for them all), ``nulls`` (3+ other consecutive optional
        fields: one constant when all are None), ``one`` (any other field)."""
        def cacheable(f: dict) -> bool:
            opt = self.optional(f["type"])
            return opt is not None and self.kind(opt[1]) in self.CACHEABLE

        out, i = [], 0
        while i < len(fields):
            j = i
            if cacheable(fields[i]):
                while j < len(fields) and cacheable(fields[j]):
                    j += 1
                if j - i >= 2:
                    out.append(("cache", i, j))
                    i = j
                    continue
            j = i
            while j < len(fields) and self.optional(fields[j]["type"]) is not None and not (
                    j + 1 < len(fields) and cacheable(fields[j]) and cacheable(fields[j + 1])):
                j += 1
            if j - i >= 3:
                out.append(("nulls", i, j))
                i = j
                continue
            out.append(("one", i, i + 1))
            i += 1
        return out

    def _writer(self, t: dict, prefix: str = "", fn: Optional[str] = None, params: bool = False) -> None:
        """``w_R(e)``: the body of record ``t`` (``prefix`` first); optional fields in runs
        (:meth:`_runs`) cost one lookup or one test for the run in the common cases.
        ``params``: a writer of the field values instead, ``fn(<field>=..., ...)`` (the trailing
        fields with a default may be left out)."""
        m = mangle(t["name"])
        fn = fn or f"w_{m}"
        fields = t["fields"]
        if params:
            defaulted = len(fields)
            while defaulted and "default" in fields[defaulted - 1]:
                defaulted -= 1
            names = [f["name"] for f in fields]
            self._check_params(t, names)
            args = [f"{n}={py_default(f['default'])}" if i >= defaulted else n
                    for i, (n, f) in enumerate(zip(names, fields))]
            head = [f"def {fn}({', '.join(args)}):"]
            local: list[Optional[str]] = list(names)
        else:
            head = [f"def {fn}(e):"]
            local = [f"f{i}" for i in range(len(fields))]
            head += [f"    f{i} = e.{f['name']}" for i, f in enumerate(fields)]
        self.out.append(self._body(t, head, local, prefix, m))

    def positional_writer(self, t: dict, given: Iterable[str], prefix: str = "", fn: Optional[str] = None) -> str:
        """``fn(<given fields, in that order>)``: the body of record ``t`` (``prefix`` first) with
        every other field at its schema default, its encoding computed here (a constant, or
        part of the key of a run's cache). For a producer's common event shape: a positional
        call, no ``**kwargs``. Returns the function's name; its source goes to ``out``."""
        m = mangle(t["name"])
        fields = t["fields"]
        given = list(given)
        byname = {f["name"]: i for i, f in enumerate(fields)}
        unknown = [g for g in given if g not in byname]
        if unknown or len(set(given)) != len(given):
            raise LookupError(f"{t['name']}: not its fields, or repeated: {given}")
        missing = [f["name"] for f in fields if f["name"] not in given and "default" not in f]
        if missing:
            raise LookupError(f"{t['name']}: fields without a default must be given: {missing}")
        self._check_params(t, given)
        fn = fn or self.tmp(f"p_{m}_")
        local: list[Optional[str]] = [f["name"] if f["name"] in given else None for f in fields]
        self.out.append(self._body(t, [f"def {fn}({', '.join(given)}):"], local, prefix, fn))
        return fn

    @staticmethod
    def _check_params(t: dict, names: Iterable[str]) -> None:
        clash = set(names) & RESERVED | {n for n in names if n.startswith("__")}
        if clash:
            raise NotImplementedError(f"{t['name']}: field names {sorted(clash)} shadow names of the codec")

    def const(self, t: Any, value: Any) -> bytes:
        """The encoding of ``value`` (a field default) of type ``t``, computed now."""
        expr = self.enc(t, "v")
        try:
            out = eval(expr, {k: getattr(codec_runtime, k) for k in dir(codec_runtime)}, {"v": value})
        except Exception as exc:
            raise NotImplementedError(f"cannot encode the default {value!r} in advance ({expr}): {exc}") from exc
        return bytes(out)

    def _field(self, t: Any, v: str, stmts: list[str]) -> list[Any]:
        """Parts encoding the local ``v`` of type ``t`` (a field of its own), checks in ``stmts``:
        an array of ``fixed`` is its items joined (count, bytes, terminator; no call per item;
        a :class:`_Fixeds` part, see :meth:`_body`), an optional ``fixed`` its branch + the
        value, an array of longs its count, items and terminator (no call)."""
        k = self.kind(t)
        r = self.resolve(t)
        if k == "array" and self.kind(r["items"]) == "fixed":
            return [_Fixeds(v, self.resolve(r["items"])["size"], self.tmp("__n"), self.tmp("__j"))]
        if k == "array" and self.kind(r["items"]) in ("int", "long"):
            n = self.tmp("__n")
            stmts.append(f"    {n} = len({v})")
            return [f"LONG[{n}]", f"(b''.join(itemgetter(*{v})(LONG)) if {n} > 1 else LONG[{v}[0]] if {n} else b'')",
                    f"(NULL if {n} else b'')"]
        opt = self.optional(t)
        if opt is not None and self.kind(opt[1]) == "fixed":
            null_i, other = opt
            size = self.resolve(other)["size"]
            o = self.tmp("__o")
            stmts += [f"    if {v} is None:", f"        {o} = {self._branch(null_i)}", f"    elif len({v}) == {size}:",
                      f"        {o} = {self._branch(1 - null_i)} + {v}", "    else:",
                      f"        raise ValueError('fixed values must be {size} bytes each')"]
            return [o]
        return [self.enc(t, v)]

    def _body(self, t: dict, head: list[str], local: list[Optional[str]], prefix: str, stem: str) -> str:
        """Source of a writer of record ``t``: ``head`` (its ``def`` line and the statements
        binding the locals), then the encoding. ``local[i]``: the local holding field ``i``, or
        None for a field at its default. Runs of optional fields (:meth:`_runs`): ``cache``
        runs are looked up by the given fields of the run (``C_<stem>_<start>``), ``nulls`` runs
        tested for None; a run or field with no given value is a constant. The first array of
        ``fixed`` gets a branch of its own for one item (a block hash): count and terminator
        become part of the constants around it."""
        fields = t["fields"]
        stmts: list[str] = []
        parts: list[Any] = [ast.literal_eval(prefix)] if prefix else []  # bytes: constants; str: expressions
        for kind, a, b in self._runs(fields):
            idx = range(a, b)
            given = [i for i in idx if local[i] is not None]
            if not given:
                parts.append(b"".join(self.const(fields[i]["type"], fields[i]["default"]) for i in idx))
                continue
            exprs = [self.enc(fields[i]["type"], local[i]) if local[i] is not None
                     else repr(self.const(fields[i]["type"], fields[i]["default"])) for i in idx]
            if kind == "one":
                parts += self._field(fields[a]["type"], local[a], stmts)
            elif kind == "nulls":
                nulls = b"".join(bytes((self.optional(fields[i]["type"])[0] << 1,)) if local[i] is not None
                                 else self.const(fields[i]["type"], fields[i]["default"]) for i in idx)
                test = " and ".join(f"{local[i]} is None" for i in given)
                parts.append(f"({nulls!r} if {test} else b''.join(({', '.join(exprs)},)))")
            else:
                names = [local[i] for i in given]
                cache = f"C_{stem}_{a}"
                key = names[0] if len(names) == 1 else f"({', '.join(names)},)"
                if cache not in self.done:
                    self.done.add(cache)
                    self.out.append(f"""{cache} = {{}}
def c_{stem}_{a}({', '.join(names)}):
    enc = b''.join(({', '.join(exprs)},))
    if len({cache}) < {self.CACHE_SIZE}:
        {cache}[{key}] = enc
    return enc""")
                parts.append(f"({cache}.get({key}) or c_{stem}_{a}({', '.join(names)}))")
        arrays = [i for i, p in enumerate(parts) if isinstance(p, _Fixeds)]
        lines = head + stmts
        for i in reversed(arrays[1:]):  # from the last: a replacement shifts what follows it
            lines += parts[i].check("    ")
            parts[i:i + 1] = parts[i].parts()
        if arrays:
            f = parts[arrays[0]]
            lines += [f"    {f.n} = len({f.v})", f"    if {f.n} == 1:", f"        {f.j} = {f.v}[0]",
                      f"        if len({f.j}) != {f.size}:", f"            {f.error()}"]
            lines += self._return(parts[:arrays[0]] + [codec_runtime.ONE, f.j, codec_runtime.NULL]
                                  + parts[arrays[0] + 1:], "        ")
            lines += f.check("    ", count=False)
            parts[arrays[0]:arrays[0] + 1] = f.parts()
        lines += self._return(parts, "    ")
        return "\n".join(lines)

    @staticmethod
    def _return(parts: list[Any], ind: str) -> list[str]:
        """``return`` of the parts joined (adjacent constants merged)."""
        merged: list[Any] = []
        for p in parts:
            if isinstance(p, bytes) and merged and isinstance(merged[-1], bytes):
                merged[-1] += p
            else:
                merged.append(p)
        src = [p if isinstance(p, str) else repr(p) for p in merged if p != b""]
        if not src:
            return [f"{ind}return b''"]
        if len(src) == 1:
            return [f"{ind}return {src[0]}"]
        return [f"{ind}return b''.join(("] + [f"{ind}    {p}," for p in src] + [f"{ind}))"]

    def _union_fns(self, n: int, names: tuple[str, ...]) -> None:
        entries = []
        for i, name in enumerate(names):
            m = mangle(name)
            self._writer(self.named[name], prefix=self._branch(i), fn=f"wb{n}_{m}")
            self._writer(self.named[name], prefix=self._branch(i), fn=f"wv{n}_{m}", params=True)
            entries.append(f"    S_{m}: wb{n}_{m},")
        self.out.append(f"WU_{n} = {{\n" + "\n".join(entries) + "\n}")
        self.out.append(f"""def wu_{n}(v):
    w = WU_{n}.get(type(v))
    if w is not None:
        return w(v)
    a = getattr(v, "avro", None)
    if type(a) is bytes:
        return a
    raise TypeError(f"not a value of union {n} ({', '.join(names)}): {{type(v).__name__}}")""")
        read = [f"def ru_{n}(data, pos):", "    b = data[pos]"]
        skip = [f"def ku_{n}(data, pos):", "    b = data[pos]"]
        for i, name in enumerate(names):
            kw = "if" if i == 0 else "elif"
            read += [f"    {kw} b == {i << 1}:", f"        return r_{mangle(name)}(data, pos + 1)"]
            skip += [f"    {kw} b == {i << 1}:", f"        return k_{mangle(name)}(data, pos + 1)"]
        err = f"    raise WireError(f\"unknown branch {{b}} of union {n}\")"
        self.out.append("\n".join(read + [err]))
        self.out.append("\n".join(skip + [err]))

    # -- decoding ------------------------------------------------------------------------

    def dec(self, t: Any, v: str, ind: str) -> list[str]:
        """Statements reading a value of type ``t`` at ``pos`` into ``v`` (``pos`` advanced)."""
        k = self.kind(t)
        t = self.resolve(t)
        if k == "null":
            return [f"{ind}{v} = None"]
        if k == "boolean":
            return [f"{ind}{v}, pos = read_bool(data, pos)"]
        if k in ("int", "long"):
            return [f"{ind}b = data[pos]", f"{ind}if b < 0x80:", f"{ind}    {v} = (b >> 1) ^ -(b & 1)",
                    f"{ind}    pos += 1", f"{ind}else:", f"{ind}    {v}, pos = read_long(data, pos)"]
        if k in ("float", "double"):
            size, fn = (4, "READ_FLOAT") if k == "float" else (8, "READ_DOUBLE")
            return [f"{ind}({v},) = {fn}(data, pos)", f"{ind}pos += {size}"]
        if k == "string":
            return [f"{ind}{v}, pos = read_str(data, pos)"]
        if k == "bytes":
            return [f"{ind}{v}, pos = read_bytes(data, pos)"]
        if k == "fixed":
            return [f"{ind}{v}, pos = read_fixed(data, pos, {t['size']})"]
        if k == "enum":
            n = self.tmp("n")
            return [f"{ind}{n}, pos = read_long(data, pos)", f"{ind}{v} = {t['symbols']!r}[{n}]"]
        if k == "record":
            return [f"{ind}{v}, pos = r_{mangle(t['name'])}(data, pos)"]
        if k == "array":
            items = t["items"]
            ik = self.kind(items)
            if ik in ("int", "long"):
                return [f"{ind}{v}, pos = read_longs(data, pos)"]
            if ik == "fixed":
                return [f"{ind}{v}, pos = read_fixeds(data, pos, {self.resolve(items)['size']})"]
            n, x = self.tmp("n"), self.tmp("x")
            return ([f"{ind}{n}, pos = read_count(data, pos)", f"{ind}{v} = []", f"{ind}if {n}:",
                     f"{ind}    for _ in range({n}):"]
                    + self.dec(items, x, ind + "        ")
                    + [f"{ind}        {v}.append({x})", f"{ind}    pos = end_array(data, pos)"])
        if k == "union":
            opt = self.optional(t)
            if opt is None:
                return [f"{ind}{v}, pos = ru_{self.record_union(t)}(data, pos)"]
            null_i, other = opt
            return ([f"{ind}b = data[pos]", f"{ind}if b == {null_i << 1}:", f"{ind}    {v} = None",
                     f"{ind}    pos += 1", f"{ind}elif b == {(1 - null_i) << 1}:", f"{ind}    pos += 1"]
                    + self.dec(other, v, ind + "    ")
                    + [f"{ind}else:", f"{ind}    raise WireError('bad union branch')"])
        raise NotImplementedError(f"Avro type {k} is not supported")

    def construct(self, t: dict, values: list[str], ind: str, target: str = "obj") -> list[str]:
        """Statements building the struct of record ``t`` from the locals ``values`` (one per
        field): optional fields whose struct default is None are set only when not None
        (keyword arguments cost more than attribute stores)."""
        name = t["name"]
        cls = self.structs.get(name)
        if cls is None:
            raise LookupError(f"no struct for Avro record {name}")
        defaults = _struct_defaults(cls)
        kwargs, later = [], []
        for f, v in zip(t["fields"], values):
            if f["name"] not in defaults:
                raise LookupError(f"struct {cls.__name__} has no field {f['name']!r} (record {name})")
            if self.optional(f["type"]) is not None and defaults[f["name"]] is None:
                later.append((f["name"], v))
            else:
                kwargs.append(f"{f['name']}={v}")
        missing = set(defaults) - {f["name"] for f in t["fields"]}
        if missing:
            raise LookupError(f"struct {cls.__name__} has fields not in record {name}: {sorted(missing)}")
        lines = [f"{ind}{target} = S_{mangle(name)}({', '.join(kwargs)})"]
        for fname, v in later:
            lines += [f"{ind}if {v} is not None:", f"{ind}    {target}.{fname} = {v}"]
        return lines

    def _reader(self, t: dict) -> None:
        m = mangle(t["name"])
        lines = [f"def r_{m}(data, pos):"]
        values = []
        for i, f in enumerate(t["fields"]):
            lines += self.dec(f["type"], f"f{i}", "    ")
            values.append(f"f{i}")
        lines += self.construct(t, values, "    ")
        lines.append("    return obj, pos")
        self.out.append("\n".join(lines))
        self.out.append(f"""def d_{m}(data, pos=0):
    try:
        value, end = r_{m}(data, pos)
    except READ_ERRORS as exc:
        raise WireError(str(exc)) from exc
    if end != len(data):
        raise WireError("trailing bytes")
    return value""")

    # -- skipping and scanning -----------------------------------------------------------

    def skip(self, t: Any, ind: str) -> list[str]:
        """Statements advancing ``pos`` past a value of type ``t`` (bounds checked by the caller)."""
        k = self.kind(t)
        t = self.resolve(t)
        if k == "null":
            return []
        if k in ("boolean", "float", "double", "fixed"):
            size = {"boolean": 1, "float": 4, "double": 8}.get(k) or t["size"]
            return [f"{ind}pos += {size}"]
        if k in ("int", "long", "enum"):
            return [f"{ind}pos = skip_long(data, pos)"]
        if k in ("string", "bytes"):
            return [f"{ind}pos = skip_bytes(data, pos)"]
        if k == "record":
            return [f"{ind}pos = k_{mangle(t['name'])}(data, pos)"]
        if k == "array":
            items = t["items"]
            ik = self.kind(items)
            if ik in ("int", "long"):
                return [f"{ind}pos = skip_longs(data, pos)"]
            if ik == "fixed":
                return [f"{ind}pos = skip_fixeds(data, pos, {self.resolve(items)['size']})"]
            n = self.tmp("n")
            return ([f"{ind}{n}, pos = read_count(data, pos)", f"{ind}if {n}:", f"{ind}    for _ in range({n}):"]
                    + (self.skip(items, ind + "        ") or [f"{ind}        pass"])
                    + [f"{ind}    pos = end_array(data, pos)"])
        if k == "union":
            opt = self.optional(t)
            if opt is None:
                return [f"{ind}pos = ku_{self.record_union(t)}(data, pos)"]
            null_i, other = opt
            return ([f"{ind}b = data[pos]", f"{ind}if b == {null_i << 1}:", f"{ind}    pos += 1",
                     f"{ind}elif b == {(1 - null_i) << 1}:", f"{ind}    pos += 1"]
                    + self.skip(other, ind + "    ")
                    + [f"{ind}else:", f"{ind}    raise WireError('bad union branch')"])
        raise NotImplementedError(f"Avro type {k} is not supported")

    def _skipper(self, t: dict) -> None:
        lines = [f"def k_{mangle(t['name'])}(data, pos):"]
        for f in t["fields"]:
            lines += self.skip(f["type"], "    ")
        lines += ["    if pos > len(data):", "        raise WireError('truncated')", "    return pos"]
        self.out.append("\n".join(lines))

    def scanned_member(self, t: dict, kept: str, blank: str) -> None:
        """``s_R(data, start, pos, raw)``: skip record ``t`` at ``pos`` (its union branch at
        ``start``) and return ``raw(avro, kept value, avro with field blank null)``."""
        lines = [f"def s_{mangle(t['name'])}(data, start, pos, raw):", "    kept = None", "    b0 = b1 = 0"]
        null = "b'\\x00'"
        for f in t["fields"]:
            if f["name"] == kept:
                lines += self.dec(f["type"], "kept", "    ")
            elif f["name"] == blank:
                opt = self.optional(f["type"])
                if opt is None:
                    raise NotImplementedError(f"{blank} must be an optional field to be blanked")
                null = self._branch(opt[0])
                lines.append("    b0 = pos")
                lines += self.skip(f["type"], "    ")
                lines.append("    b1 = pos")
            else:
                lines += self.skip(f["type"], "    ")
        lines += ["    if pos > len(data):", "        raise WireError('truncated')",
                  "    without = None",
                  "    if b1 - b0 > 1:",
                  f"        without = data[start:b0] + {null} + data[b1:pos]",
                  "    return raw(data[start:pos], kept, without), pos"]
        self.out.append("\n".join(lines))

    def scan_fn(self, t: dict, array: str, members: Iterable[str], kept: str, blank: str) -> None:
        """``scan_R(data, pos, raw, shared=None)``: the struct of record ``t`` whose field
        ``array`` (an array of a union of records) keeps its ``members`` as ``raw(...)`` objects
        (:meth:`scanned_member`) and decodes the other branches.

        ``shared`` (optional, ``get(key)`` / ``put(key, struct)``): records whose bytes from the
        array to the end of the fields that follow it (when those are all int/long, found from
        the end) equal an earlier record's share its scanned list: ``get`` returns it (or None),
        ``put`` is called after a full scan."""
        m = mangle(t["name"])
        fields = t["fields"]
        ai = next(i for i, f in enumerate(fields) if f["name"] == array)
        items = self.resolve(self.resolve(fields[ai]["type"])["items"])
        u = self.record_union(items)
        names = [self.resolve(b)["name"] for b in items]
        self.out.append(f"SCAN_UNION = {u}")
        members = set(members)
        for name in names:
            if name in members:
                self.scanned_member(self.named[name], kept, blank)
        after = fields[ai + 1:]
        tail_ok = all(self.kind(f["type"]) in ("int", "long") for f in after)
        values = [f"f{i}" for i in range(len(fields))]
        lines = [f"def scan_{m}(data, pos, raw, shared=None):", "    key = None", "    try:"]
        for i, f in enumerate(fields[:ai]):
            lines += self.dec(f["type"], f"f{i}", "        ")
        tail, shared_tail = [], []
        for i, f in enumerate(after, ai + 1):
            tail += self.dec(f["type"], f"f{i}", "        ")
            shared_tail += self.dec(f["type"], f"f{i}", "                    ")
        if tail_ok and after:
            lines += ["        if shared is not None:",
                      f"            end = tail_varints(data, pos, {len(after)})",
                      "            if end >= 0:",
                      "                key = data[pos:end]",
                      f"                f{ai} = shared.get(key)",
                      f"                if f{ai} is not None:",
                      "                    pos = end"]
            lines += shared_tail
            lines += ["                    if pos != len(data):",
                      "                        raise WireError('trailing bytes')"]
            lines += self.construct(t, values, "                    ")
            lines += ["                    return obj"]
        n = self.tmp("n")
        lines += [f"        {n}, pos = read_count(data, pos)", f"        f{ai} = []", f"        if {n}:",
                  f"            append = f{ai}.append",
                  f"            for _ in range({n}):",
                  "                b = data[pos]"]
        for i, name in enumerate(names):
            kw = "if" if i == 0 else "elif"
            lines.append(f"                {kw} b == {i << 1}:")
            if name in members:
                lines.append(f"                    x, pos = s_{mangle(name)}(data, pos, pos + 1, raw)")
            else:
                lines.append(f"                    x, pos = r_{mangle(name)}(data, pos + 1)")
        lines += ["                else:", "                    raise WireError(f'unknown union branch {b}')",
                  "                append(x)", "            pos = end_array(data, pos)"]
        lines += tail
        lines += ["    except READ_ERRORS as exc:", "        raise WireError(str(exc)) from exc",
                  "    if pos != len(data):", "        raise WireError('trailing bytes')"]
        lines += self.construct(t, values, "    ")
        lines += ["    if key is not None:", "        shared.put(key, obj)", "    return obj"]
        self.out.append("\n".join(lines))

    def split_writers(self, t: dict, head: tuple[str, ...], raw: str) -> None:
        """``head_R(<head fields>)``: the encoding of the leading fields ``head`` (cache it);
        ``tail_R(head, <other fields in schema order>)``: ``head`` + the encoding of the rest,
        field ``raw`` given already encoded; fields with a default may be left out."""
        m = mangle(t["name"])
        fields = t["fields"]
        lead = [f["name"] for f in fields[:len(head)]]
        if sorted(lead) != sorted(head):
            raise LookupError(f"{t['name']}: {head} are not its leading fields ({lead})")
        byname = {f["name"]: f for f in fields}
        parts = [self.enc(byname[h]["type"], h) for h in head]
        self.out.append(f"def head_{m}({', '.join(head)}):\n    return b''.join(({', '.join(parts)},))")
        rest = fields[len(head):]
        defaulted = len(rest)  # the trailing fields with a default get it as parameter default
        while defaulted and "default" in rest[defaulted - 1] and rest[defaulted - 1]["name"] != raw:
            defaulted -= 1
        params, parts = ["head"], ["head"]
        for i, f in enumerate(rest):
            name = f["name"]
            params.append(f"{name}={py_default(f['default'])}" if i >= defaulted else name)
            parts.append(name if name == raw else self.enc(f["type"], name))
        self.out.append(f"def tail_{m}({', '.join(params)}):\n    return b''.join(({', '.join(parts)},))")


def _struct_defaults(cls: type) -> dict[str, Any]:
    """Field name -> default (``...`` when required) of a msgspec struct."""
    import msgspec

    out = {}
    for f in msgspec.structs.fields(cls):
        if f.default is not msgspec.NODEFAULT:
            out[f.name] = f.default
        elif f.default_factory is not msgspec.NODEFAULT:
            out[f.name] = f.default_factory()
        else:
            out[f.name] = ...
    return out


def generator(records: dict[str, dict], structs: dict[str, type],
              scan: Optional[tuple[str, str, tuple[str, ...], str, str]] = None,
              split: Optional[tuple[str, tuple[str, ...], str]] = None) -> Generator:
    """The :class:`Generator` that has emitted the codec of the parsed top-level ``records``
    (short name -> parsed schema) into its ``out``; see :class:`Generator` for ``scan`` and
    ``split``. It can emit more later (:meth:`Generator.positional_writer`)."""
    g = Generator(structs)
    for schema in records.values():
        g.resolve(schema)
    for schema in records.values():
        g.record(schema)
    if scan is not None:
        record, array, members, kept, blank = scan
        g.scan_fn(g.named[record], array, members, kept, blank)
    if split is not None:
        record, head, raw = split
        g.split_writers(g.named[record], head, raw)
    return g


HEADER = "# generated by schemas/codegen.py from schemas/avro/*.avsc: do not edit\n"


def generate(records: dict[str, dict], structs: dict[str, type],
             scan: Optional[tuple[str, str, tuple[str, ...], str, str]] = None,
             split: Optional[tuple[str, tuple[str, ...], str]] = None) -> str:
    """Python source of the codec of the parsed top-level ``records`` (see :func:`generator`).
    The source refers to the structs as ``S_<mangled name>`` and to
    :mod:`kvbus.schemas.codec_runtime`'s names."""
    return HEADER + "\n\n\n".join(generator(records, structs, scan, split).out) + "\n"
