"""``kvbus serve``: the HTTP query API over the residency view (docs/serve.md).

    kvbus serve [--host 0.0.0.0] [--port 8090] [--prefix kvbus:]
                [--algo sha256|sha256_cbor|xxhash|xxhash_cbor] [--hash-seed S] [--engine-version V]
                [--lora-module NAME=PATH ...] [--threads 8] [--tie-break shuffle|name] [--max-body BYTES]
                                                        (defaults: KVBUS_SERVE_*, commands/serve/serve_config.py)
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import signal

from kvbus.runtime.env import SettingError, add_flags, from_flags
from kvbus.runtime.security import redact_url
from kvbus.runtime.settings import Settings
from kvbus.schemas.hashing import resolve_seed
from kvbus.serve.serve_config import ServeConfig

log = logging.getLogger("kvbus.serve")


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """Options of ``kvbus serve``: the flags of :class:`ServeConfig`, each defaulting to its ``KVBUS_SERVE_*``
    variable."""
    add_flags(p, ServeConfig)


def serve_config(args: argparse.Namespace) -> ServeConfig:
    """The ServeConfig of ``kvbus serve``'s flags; SettingError for engines' settings no router can
    hash for (a seed the engines draw at random, an algorithm their release lacks)."""
    config = from_flags(ServeConfig, args)
    try:
        resolve_seed(config.algo, config.hash_seed, engine_version=config.engine_version)
    except ValueError as e:
        raise SettingError(str(e)) from None
    return config


async def _serve(config: ServeConfig, settings: Settings) -> None:
    from aiohttp import web

    from kvbus.serve.app import Service, view_client

    view = view_client(settings.redis_url, config, **settings.redis_kwargs())
    service = Service(view, config)
    runner = web.AppRunner(service.app(), access_log=None, handle_signals=False)
    await runner.setup()
    try:
        site = web.TCPSite(runner, config.host, config.port)
        await site.start()
        host, port = runner.addresses[0][:2]
        log.info("serving the view at %s (prefix %r) on http://%s:%d: POST /query, /query_by_hash; GET /healthz, "
                 "/readyz, /metrics; hashing %s, %d lookup threads, adapters: %s",
                 redact_url(settings.redis_url), config.prefix, host, port, config.algo, config.threads,
                 ", ".join(sorted(dict(config.lora_modules))) or "none")
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        log.info("stopping")
    finally:
        await runner.cleanup()
        service.close()
        view.close()


def run_serve(args: argparse.Namespace, settings: Settings) -> int:
    """Serve the query API until SIGTERM/SIGINT."""
    config = serve_config(args)
    try:
        asyncio.run(_serve(config, settings))
    except OSError as e:
        if e.errno is None:
            raise
        log.error("cannot listen on %s:%d: %s", config.host, config.port, e.strerror or e)
        return 1
    return 0
