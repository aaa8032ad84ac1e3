"""Options of ``kvbus serve`` (besides the shared :class:`kvbus.schemas.settings.Settings`, whose
``KVBUS_REDIS_*`` name the view's Redis).

``kvbus serve`` flags default to these variables; :class:`ServeConfig` is what the server runs with.

| variable | default | meaning |
|---|---|---|
| ``KVBUS_SERVE_HOST`` | ``0.0.0.0`` | address to listen on |
| ``KVBUS_SERVE_PORT`` | ``8090`` | port of the query API, ``/healthz``, ``/readyz`` and ``/metrics`` |
| ``KVBUS_SERVE_PREFIX`` | ``kvbus:`` | Redis key prefix of the view (the sinks' ``--prefix``) |
| ``KVBUS_SERVE_ALGO`` | ``sha256`` | the engines' ``--prefix-caching-hash-algo``: how ``/query`` hashes ``token_ids`` |
| ``KVBUS_SERVE_HASH_SEED`` | unset | the engines' ``PYTHONHASHSEED`` (unset: this process's, else vLLM's default) |
| ``KVBUS_SERVE_ENGINE_VERSION`` | unset | the engines' vLLM release where it hashes differently (unset: the newest) |
| ``KVBUS_SERVE_LORA_MODULES`` | empty | the engines' adapters: ``NAME=PATH`` pairs separated by spaces |
| ``KVBUS_SERVE_THREADS`` | ``8`` | threads that run lookups (Redis calls); 0: on the event loop itself |
| ``KVBUS_SERVE_TIE_BREAK`` | ``shuffle`` | order of instances tied on the answer: ``shuffle`` (random) or ``name`` |
| ``KVBUS_SERVE_MAX_BODY`` | ``8388608`` | largest request body in bytes (8 MiB: about a million token ids) |
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Mapping

from kvbus.schemas.env import COUNT, NATURAL, PORT, TEXT, Form, one_of, read
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
    """How ``kvbus serve`` runs; every field has a ``KVBUS_SERVE_*`` variable (module doc)."""

    host: str = "0.0.0.0"
    """Address to listen on."""
    port: int = 8090
    """Port of the query API and the probes (0: any free port, logged)."""
    prefix: str = DEFAULT_PREFIX
    """Redis key prefix of the view."""
    algo: str = "sha256"
    """The engines' ``--prefix-caching-hash-algo`` (how ``/query`` hashes token ids)."""
    hash_seed: str | None = None
    """The engines' ``PYTHONHASHSEED``; None: this process's, else vLLM's default."""
    engine_version: str | None = None
    """The engines' vLLM release where it hashes differently; None: the newest rules."""
    lora_modules: Mapping[str, str] = field(default_factory=dict)
    """Adapter name -> path the engines loaded it from (a request names only the adapter)."""
    threads: int = 8
    """Threads that run lookups; 0 runs them on the event loop (each blocks it for its Redis call)."""
    tie_break: str = "shuffle"
    """Order of tied instances: ``shuffle`` or ``name``."""
    max_body: int = 8 * 1024 * 1024
    """Largest request body accepted, bytes (413 above)."""

    @property
    def hashing(self) -> Hashing:
        """How ``/query`` hashes token ids: the engines' settings above."""
        return Hashing(self.algo, self.hash_seed, self.engine_version, dict(self.lora_modules))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "ServeConfig":
        """Options from KVBUS_SERVE_* (of ``environ``, default the process's), defaults for the unset or
        blank ones; :class:`~kvbus.schemas.env.SettingError` names a malformed one."""
        env = os.environ if environ is None else environ
        return cls(
            host=read(env, "KVBUS_SERVE_HOST", TEXT, cls.host),
            port=read(env, "KVBUS_SERVE_PORT", PORT, cls.port),
            prefix=read(env, "KVBUS_SERVE_PREFIX", TEXT, cls.prefix),
            algo=read(env, "KVBUS_SERVE_ALGO", ALGO, cls.algo),
            hash_seed=read(env, "KVBUS_SERVE_HASH_SEED", TEXT, None),
            engine_version=read(env, "KVBUS_SERVE_ENGINE_VERSION", ENGINE_VERSION, None),
            lora_modules=read(env, "KVBUS_SERVE_LORA_MODULES", LORA_MODULES, {}),
            threads=read(env, "KVBUS_SERVE_THREADS", NATURAL, cls.threads),
            tie_break=read(env, "KVBUS_SERVE_TIE_BREAK", TIE_BREAK, cls.tie_break),
            max_body=read(env, "KVBUS_SERVE_MAX_BODY", COUNT, cls.max_body),
        )
