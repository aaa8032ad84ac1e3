"""How kvbus reads a ``KVBUS_*`` variable or a flag: every value has a :class:`Form`, and a value not
of its form is one :class:`SettingError` whose message names the variable (or the flag) and the form
expected, on one line. ``kvbus`` prints that line and exits 2, without a traceback.

    read(os.environ, "KVBUS_SINK_BATCH", COUNT, 2000)   # unset or blank: 2000; "2k": SettingError
    p.add_argument("--batch", type=COUNT)               # "--batch 2k": argparse names the flag

Forms are parsers (``Form.parse``), also usable as argparse ``type=``.

Each option is declared once, as a :class:`Setting`: its variable, its flag, its form, its default
and what it means. An options dataclass declares its fields with :func:`setting`; from those
declarations come its ``from_env`` (:func:`load`), its flags (:func:`add_flags`, :func:`from_flags`)
and the reference of every option, ``docs/configuration.md`` (``python -m kvbus.configuration_doc``)::

    @dataclass(frozen=True)
    class SinkConfig:
        batch: int = setting("KVBUS_SINK_BATCH", COUNT, 2000, "records per poll and apply batch", flag="--batch")

A flag defaults to its variable's value, and its ``--help`` says which variable and the value now.

Hand-written on purpose: a settings library (pydantic-settings, typed-settings) would be a dependency
of every role, the routers' ``[client]`` install included, for what is here a few functions over the
forms kvbus already has, and the one-line exit-2 errors naming the variable stay as they are.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Any, Callable, Generic, Iterator, Mapping, TypeVar

T = TypeVar("T")
C = TypeVar("C")


class SettingError(ValueError):
    """A ``KVBUS_*`` variable or a flag has a value kvbus cannot use; the message is one line that
    names it and says what is expected (``KVBUS_SINK_BATCH=2k: expected a whole number >= 1``)."""


@dataclass(frozen=True)
class Form(Generic[T]):
    """What a value must look like. ``expected``: the form in words, as error messages say it (``a
    whole number >= 1``); ``parse``: the text to the value, raising ValueError when it is not of the form."""

    expected: str
    parse: Callable[[str], T]
    choices: tuple[str, ...] = ()
    """The values it takes, when it is one of a few words (:func:`one_of`; a flag's ``choices``)."""

    def __call__(self, text: str) -> T:
        """argparse ``type=``: the value, or ArgumentTypeError (argparse prefixes the flag's name)."""
        try:
            return self.parse(text.strip())
        except (ValueError, TypeError):
            raise argparse.ArgumentTypeError(f"expected {self.expected}, got {text!r}") from None


def _whole(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = int(text)
        if value < minimum or (maximum is not None and value > maximum):
            raise ValueError(text)
        return value
    return parse


def _non_negative(text: str) -> float:
    value = float(text)
    if not math.isfinite(value) or value < 0:
        raise ValueError(text)
    return value


def one_of(*choices: str) -> Form[str]:
    """One of ``choices``, in any letter case (the value is the choice as written here)."""
    by_upper = {c.upper(): c for c in choices}

    def parse(text: str) -> str:
        try:
            return by_upper[text.upper()]
        except KeyError:
            raise ValueError(text) from None
    return Form(f"one of {', '.join(choices)}", parse, tuple(choices))


COUNT: Form[int] = Form("a whole number >= 1", _whole(1))
"""Partitions, batch sizes, bytes, replicas: at least one."""
NATURAL: Form[int] = Form("a whole number >= 0", _whole(0))
"""A count that may be zero (standby replicas, rank numbers)."""
PORT: Form[int] = Form("a port number 0-65535", _whole(0, 65535))
"""A TCP port; 0 turns an endpoint off where the setting says so."""
SECONDS: Form[float] = Form("a number of seconds >= 0, e.g. 2.5", _non_negative)
"""A duration in seconds; 0 means what the setting says (never, none, no wait)."""
RATE: Form[float] = Form("a number per second >= 0, e.g. 400", _non_negative)
"""Things a second; 0 means what the setting says (never)."""
TEXT: Form[str] = Form("text", str)
"""Anything (names, URLs, paths)."""


def _switch(text: str) -> bool:
    value = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False,
             "off": False}.get(text.lower())
    if value is None:
        raise ValueError(text)
    return value


def _existing_file(text: str) -> str:
    if not os.path.isfile(text):
        raise ValueError(text)
    return text


SWITCH: Form[bool] = Form("true or false (1, yes, on / 0, no, off)", _switch)
"""On or off; a flag of this form is given without a value (``--no-recover``)."""
FILE: Form[str] = Form("the path of an existing file", _existing_file)
"""A file that must exist when the setting is given (certificates, properties files)."""


def read(environ: Mapping[str, str], name: str, form: Form[T], default: T) -> T:
    """Variable ``name`` of ``environ`` parsed by ``form``; ``default`` when it is unset or blank.
    Raises :class:`SettingError` naming the variable and the form when the value is not of the form."""
    raw = environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return form.parse(raw)
    except (ValueError, TypeError):
        raise SettingError(f"{name}={raw}: expected {form.expected}") from None


MISSING: Any = dataclasses.MISSING
"""The default of a setting that has none: its flag is required."""
KEY = "kvbus.setting"
"""Where a dataclass field made by :func:`setting` keeps its :class:`Setting` (``field.metadata``)."""


@dataclass(frozen=True)
class Setting(Generic[T]):
    """One option, declared once: where its value comes from, its form, its default and its meaning."""

    variable: str | None
    """Its ``KVBUS_*`` environment variable; None: a flag only."""
    form: Form[T]
    """What a value must look like (the variable's and the flag's)."""
    default: Any
    """The value when neither the variable nor the flag is given; :data:`MISSING`: the flag is required."""
    doc: str
    """What the value means and the values it takes: the flag's ``--help`` and the reference's text."""
    flag: str | None = None
    """Its command-line flag (``--batch``); None: a variable only."""
    shown: str | None = None
    """How the default is shown where its value says too little (``<workdir>/<app-id>-data``)."""
    many: bool = False
    """Takes several values: a repeatable flag, a variable of values separated by spaces; the value is a tuple."""
    secret: bool = False
    """A secret: its value is never shown, and ``<variable>_FILE`` may name a file that holds it."""
    metavar: str | None = None
    """The flag's value as ``--help`` names it (argparse ``metavar``)."""

    def read(self, environ: Mapping[str, str]) -> T:
        """The value of :attr:`variable` in ``environ``, :attr:`default` when it is unset, blank or
        there is no variable; :class:`SettingError` naming the variable when it is not of the form."""
        if self.variable is None:
            return self.default
        if not self.many:
            return read(environ, self.variable, self.form, self.default)
        raw = environ.get(self.variable, "").strip()
        if not raw:
            return self.default
        return tuple(read({self.variable: part}, self.variable, self.form, None) for part in raw.split())

    def show(self, value: Any) -> str:
        """``value`` as ``--help`` and the reference show it."""
        if self.secret:
            return "unset" if not value else "***"
        if self.shown is not None and value == self.default:
            return self.shown
        if value is None or value == () or value is MISSING:
            return "unset"
        if isinstance(value, float):
            return f"{value:g}"
        if isinstance(value, bool):
            return "on" if value else "off"
        if isinstance(value, tuple):
            return (" " if self.many else ",").join(str(v) for v in value)
        return str(value) if value != "" else "unset"

    def help(self, value: Any) -> str:
        """The flag's ``--help``: :attr:`doc`, then its variable and ``value`` (the flag's default now)."""
        text = self.doc
        if self.variable is not None:
            text += f" ({self.variable}; now {self.show(value)})"
        elif self.default not in (MISSING, None, (), "") and self.form is not SWITCH:
            text += f" (default {self.show(value)})"
        return text.replace("%", "%%")


def setting(variable: str | None, form: Form[T], default: Any = MISSING, doc: str = "", *, flag: str | None = None,
            shown: str | None = None, many: bool = False, secret: bool = False, metavar: str | None = None) -> Any:
    """A dataclass field declared by a :class:`Setting` (its arguments), with ``default`` as the field's default."""
    declared = Setting(variable, form, default, doc, flag, shown, many, secret, metavar)
    metadata = {KEY: declared}
    if default is MISSING:
        return dataclasses.field(metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def reuse(cls: type, name: str, **changes: Any) -> Any:
    """A dataclass field declared by the Setting of ``cls``'s field ``name`` with ``changes`` (e.g. its
    own ``flag`` and ``doc``): an option of another stage's variable, declared once there."""
    declared_as = dataclasses.replace(dict(declared(cls))[name], **changes)
    return dataclasses.field(default=declared_as.default, metadata={KEY: declared_as})


def declared(cls: type) -> Iterator[tuple[str, Setting]]:
    """(field name, its :class:`Setting`) of every field of the dataclass ``cls`` made by :func:`setting`, in order."""
    for f in dataclasses.fields(cls):
        if KEY in f.metadata:
            yield f.name, f.metadata[KEY]


def load(cls: type[C], environ: Mapping[str, str] | None = None, **given: Any) -> C:
    """An instance of the dataclass ``cls``: ``given`` values, then its declared fields' variables
    (of ``environ``, default the process's), then the fields' defaults; :class:`SettingError` names a
    malformed variable."""
    env = os.environ if environ is None else environ
    values = {name: s.read(env) for name, s in declared(cls) if s.variable is not None and name not in given}
    return cls(**values, **given)


def add_flag(parser: argparse.ArgumentParser | Any, dest: str, declared_as: Setting,
             environ: Mapping[str, str] | None = None) -> argparse.Action:
    """Add ``declared_as``'s flag to ``parser`` (an argparse parser or argument group) as ``dest``,
    defaulting to its variable's value in ``environ`` (default the process's), with its doc, the
    variable and that value as its ``--help``. The action carries the Setting (``action.setting``)."""
    s = declared_as
    value = s.read(os.environ if environ is None else environ)
    kw: dict[str, Any] = {"dest": dest, "help": s.help(value)}
    if s.default is MISSING:
        kw["required"] = True
    else:
        kw["default"] = value
    if s.form is SWITCH:
        kw["action"] = "store_true"
    else:
        kw["type"] = s.form
        if s.form.choices:
            kw["choices"] = s.form.choices
        if s.many:
            kw["action"] = "append"
            kw["default"] = list(value or ())
        if s.metavar:
            kw["metavar"] = s.metavar
    action = parser.add_argument(s.flag, **kw)
    action.setting = s
    return action


def add_flags(parser: argparse.ArgumentParser | Any, cls: type, environ: Mapping[str, str] | None = None) -> None:
    """The flag of every declared field of the dataclass ``cls`` that has one (:func:`add_flag`), in order."""
    for name, s in declared(cls):
        if s.flag is not None:
            add_flag(parser, name, s, environ)


def from_flags(cls: type[C], args: argparse.Namespace, environ: Mapping[str, str] | None = None, **given: Any) -> C:
    """The instance of ``cls`` a command's parsed flags (:func:`add_flags`) describe: each flag's
    value, the variables of the fields without a flag, ``given`` over both."""
    flags = {name: (tuple(getattr(args, name)) if s.many else getattr(args, name))
             for name, s in declared(cls) if s.flag is not None and hasattr(args, name)}
    return load(cls, environ, **{**flags, **given})


def to_env(obj: Any) -> dict[str, str]:
    """The variables that make :func:`load` in a child process return the declared fields of the
    dataclass instance ``obj`` (fields whose value is unset are left out)."""
    out = {}
    for name, s in declared(type(obj)):
        value = getattr(obj, name)
        if s.variable is None or value is None or value == ():
            continue
        out[s.variable] = " ".join(map(str, value)) if s.many else str(value)
    return out
