"""``kvbus serve``: the HTTP query API over the residency view (docs/serve.md).

    kvbus serve [--host 0.0.0.0] [--port 8090] [--prefix kvbus:]
                [--algo sha256|sha256_cbor|xxhash|xxhash_cbor] [--hash-seed S] [--engine-version V]
                [--lora-module NAME=PATH ...] [--threads 8] [--tie-break shuffle|name] [--max-body BYTES]
                                                        (defaults: KVBUS_SERVE_*, kvbus/serve/config.py)
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from dataclasses import replace

from kvbus.schemas.env import COUNT, NATURAL, PORT, SettingError
from kvbus.schemas.hashing import resolve_seed
from kvbus.schemas.security import redact_url
from kvbus.schemas.settings import Settings
from kvbus.serve.config import ALGO, ENGINE_VERSION, LORA_MODULE, TIE_BREAK, TIE_BREAKS, ServeConfig

log = logging.getLogger("kvbus.serve")


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """Options of ``kvbus serve``; each defaults to its ``KVBUS_SERVE_*`` variable (:mod:`kvbus.serve.config`)."""
    d = ServeConfig.from_env()
    p.add_argument("--host", default=d.host, help=f"address to listen on (KVBUS_SERVE_HOST; now {d.host})")
    p.add_argument("--port", type=PORT, default=d.port,
                   help="port of the query API, /healthz, /readyz and /metrics; 0: any free port, logged "
                        f"(KVBUS_SERVE_PORT; now {d.port})")
    p.add_argument("--prefix", default=d.prefix,
                   help=f"Redis key prefix of the view (KVBUS_SERVE_PREFIX; now {d.prefix})")
    p.add_argument("--algo", type=ALGO, default=d.algo,
                   help=f"the engines' --prefix-caching-hash-algo, how /query hashes token_ids (KVBUS_SERVE_ALGO; now "
                        f"{d.algo})")
    p.add_argument("--hash-seed", default=d.hash_seed,
                   help="the engines' PYTHONHASHSEED (KVBUS_SERVE_HASH_SEED; default: this process's "
                        "PYTHONHASHSEED, else vLLM's default seed; required for xxhash and xxhash_cbor)")
    p.add_argument("--engine-version", type=ENGINE_VERSION, default=d.engine_version,
                   help="the engines' vLLM release, e.g. 0.30.0, where it hashes differently "
                        "(KVBUS_SERVE_ENGINE_VERSION; default: the newest rules)")
    p.add_argument("--lora-module", type=LORA_MODULE, action="append", default=None, metavar="NAME=PATH",
                   help="an adapter the engines serve and the path they loaded it from, as vLLM's --lora-modules; "
                        "repeat for each (KVBUS_SERVE_LORA_MODULES: NAME=PATH separated by spaces; the flags "
                        f"replace it; now {' '.join(f'{k}={v}' for k, v in d.lora_modules.items()) or 'none'})")
    p.add_argument("--threads", type=NATURAL, default=d.threads,
                   help=f"threads that run lookups; 0: on the event loop (KVBUS_SERVE_THREADS; now {d.threads})")
    p.add_argument("--tie-break", type=TIE_BREAK, default=d.tie_break, metavar="|".join(TIE_BREAKS),
                   help="order of instances tied on score and matched blocks: shuffle (random) or name "
                        f"(KVBUS_SERVE_TIE_BREAK; now {d.tie_break})")
    p.add_argument("--max-body", type=COUNT, default=d.max_body,
                   help=f"largest request body in bytes (KVBUS_SERVE_MAX_BODY; now {d.max_body})")


def serve_config(args: argparse.Namespace) -> ServeConfig:
    """The ServeConfig of ``kvbus serve``'s flags; SettingError for engines' settings no router can
    hash for (a seed the engines draw at random, an algorithm their release lacks)."""
    d = ServeConfig.from_env()
    config = replace(d, host=args.host, port=args.port, prefix=args.prefix, algo=args.algo, hash_seed=args.hash_seed,
                     engine_version=args.engine_version,
                     lora_modules=dict(args.lora_module) if args.lora_module is not None else d.lora_modules,
                     threads=args.threads, tie_break=args.tie_break, max_body=args.max_body)
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
                 ", ".join(sorted(config.lora_modules)) or "none")
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
