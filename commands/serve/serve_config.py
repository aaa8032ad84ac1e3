"""Options of ``kvbus serve`` (besides the shared :class:`kvbus.runtime.settings.Settings`, whose
``KVBUS_REDIS_*`` name the view's Redis).

Each option is a variable and a flag, declared once in :class:`ServeConfig`; all of them:
docs/configuration.md.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from kvbus.runtime.env import COUNT, NATURAL, PORT, TEXT, Form, load, one_of, setting
from kvbus.schemas.hashing import HASH_ALGOS, hash_rules
from kvbus.schemas.lookup import DEFAULT_PREFIX
from kvbus.serve.query import Hashing

TIE_BREAKS = ("shuffle", "name")
"""Values of ``--tie-break``: tied instances in a random order, or by name (reproducible)."""


def _lora_module(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise ValueError(text)
    return name.strip(), path.strip()


LORA_MODULE: Form[tuple[str, str]] = Form("NAME=PATH (an adapter and the path the engines loaded it from)",
                                          _lora_module)
"""One adapter of ``--lora-module``."""


def _lora_modules(text: str) -> dict[str, str]:
    return dict(_lora_module(part) for part in text.split())


LORA_MODULES: Form[dict[str, str]] = Form("NAME=PATH pairs separated by spaces", _lora_modules)
"""``KVBUS_SERVE_LORA_MODULES``."""
ALGO: Form[str] = one_of(*sorted(HASH_ALGOS))
ENGINE_VERSION: Form[str] = Form("a vLLM release, e.g. 0.33.0", lambda text: (hash_rules(text), text)[1])
TIE_BREAK: Form[str] = one_of(*TIE_BREAKS)


@dataclass(frozen=True)
class ServeConfig:
    """How ``kvbus serve`` runs; every field is a ``KVBUS_SERVE_*`` variable and a flag
    (:func:`kvbus.runtime.env.setting`)."""

    host: str = setting("KVBUS_SERVE_HOST", TEXT, "0.0.0.0", "address to listen on", flag="--host")
    port: int = setting("KVBUS_SERVE_PORT", PORT, 8090, "port of the query API, /healthz, /readyz and /metrics "
                        "(0: any free port, logged)", flag="--port")
    prefix: str = setting("KVBUS_SERVE_PREFIX", TEXT, DEFAULT_PREFIX,
                          "Redis key prefix of the view (the sinks' --prefix)", flag="--prefix")
    algo: str = setting("KVBUS_SERVE_ALGO", ALGO, "sha256",
                        "the engines' --prefix-caching-hash-algo: how /query hashes token_ids", flag="--algo")
    hash_seed: str | None = setting("KVBUS_SERVE_HASH_SEED", TEXT, None, "the engines' PYTHONHASHSEED; unset: this "
                                    "process's, else vLLM's default", flag="--hash-seed")
    engine_version: str | None = setting("KVBUS_SERVE_ENGINE_VERSION", ENGINE_VERSION, None,
                                         "the engines' vLLM release where it hashes differently; unset: the newest "
                                         "rules", flag="--engine-version")
    lora_modules: tuple[tuple[str, str], ...] = setting(
        "KVBUS_SERVE_LORA_MODULES", LORA_MODULE, (),
        "an adapter the engines serve and the path they loaded it from (a request names only the adapter; "
        "repeatable; the variable: NAME=PATH pairs separated by spaces)", flag="--lora-module", many=True,
        metavar="NAME=PATH")
    threads: int = setting("KVBUS_SERVE_THREADS", NATURAL, 8, "threads that run lookups (Redis calls); 0: on the "
                           "event loop itself", flag="--threads")
    tie_break: str = setting("KVBUS_SERVE_TIE_BREAK", TIE_BREAK, "shuffle",
                             "order of instances tied on the answer: shuffle (random) or name", flag="--tie-break")
    max_body: int = setting("KVBUS_SERVE_MAX_BODY", COUNT, 8 * 1024 * 1024,
                            "largest request body in bytes (8 MiB: about a million token ids; 413 above)",
                            flag="--max-body")

    @property
    def hashing(self) -> Hashing:
        """How ``/query`` hashes token ids: the engines' settings above."""
        return Hashing(self.algo, self.hash_seed, self.engine_version, dict(self.lora_modules))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "ServeConfig":
        """Options from KVBUS_SERVE_* (of ``environ``, default the process's), defaults for the unset or
        blank ones; :class:`~kvbus.runtime.env.SettingError` names a malformed one."""
        return load(cls, environ)
