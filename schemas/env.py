"""How kvbus reads a ``KVBUS_*`` variable or a flag: every value has a :class:`Form`, and a value not
of its form is one :class:`SettingError` whose message names the variable (or the flag) and the form
expected, on one line. ``kvbus`` prints that line and exits 2, without a traceback.

    read(os.environ, "KVBUS_SINK_BATCH", COUNT, 2000)   # unset or blank: 2000; "2k": SettingError
    p.add_argument("--batch", type=COUNT)               # "--batch 2k": argparse names the flag

Forms are parsers (``Form.parse``), also usable as argparse ``type=``.
"""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Callable, Generic, Mapping, TypeVar

T = TypeVar("T")


class SettingError(ValueError):
    """A ``KVBUS_*`` variable or a flag has a value kvbus cannot use; the message is one line that
    names it and says what is expected (``KVBUS_SINK_BATCH=2k: expected a whole number >= 1``)."""


@dataclass(frozen=True)
class Form(Generic[T]):
    """What a value must look like. ``expected``: the form in words, as error messages say it (``a
    whole number >= 1``); ``parse``: the text to the value, raising ValueError when it is not of the form."""

    expected: str
    parse: Callable[[str], T]

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


def _seconds(text: str) -> float:
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
    return Form(f"one of {', '.join(choices)}", parse)


COUNT: Form[int] = Form("a whole number >= 1", _whole(1))
"""Partitions, batch sizes, bytes, replicas: at least one."""
NATURAL: Form[int] = Form("a whole number >= 0", _whole(0))
"""A count that may be zero (standby replicas, rank numbers)."""
PORT: Form[int] = Form("a port number 0-65535", _whole(0, 65535))
"""A TCP port; 0 turns an endpoint off where the setting says so."""
SECONDS: Form[float] = Form("a number of seconds >= 0, e.g. 2.5", _seconds)
"""A duration in seconds; 0 means what the setting says (never, none, no wait)."""
TEXT: Form[str] = Form("text", str)
"""Anything (names, URLs, paths)."""


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
