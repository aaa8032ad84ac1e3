"""``kvbus sink`` and ``kvbus lookup``: argparse wiring for the lead's ``kvbus`` command.

    kvbus sink [--group G] [--prefix kvbus:] [--stale-after SEC] [--metrics-port P] [--batch N] ...
                                                    (every flag, its variable and default: docs/configuration.md)
    kvbus lookup (--hashes H1,H2,... | --tokens 1,2,3,... [--block-size 16]
                  [--algo sha256|sha256_cbor|xxhash|xxhash_cbor] [--hash-seed S]
                  [--lora-name NAME [--lora-path PATH]] [--cache-salt SALT] [--engine-version V])
                 [--replicas a,b#1] [--model NAME] [--weights GPU=1,CPU=0.8,STORAGE=0.5] [--prefix kvbus:] [--json]

Standalone: ``python -m kvbus.sinks.cli sink ...`` / ``python -m kvbus.sinks.cli lookup ...``.
"""
from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading

from kvbus.runtime.collector import tune_gc
from kvbus.runtime.env import add_flags, from_flags
from kvbus.runtime.security import check_kafka_access, redact_url
from kvbus.runtime.settings import Settings
from kvbus.schemas.hashing import HASH_ALGOS, HASH_RELEASES, first_release
from kvbus.schemas.lookup import DEFAULT_PREFIX
from kvbus.sinks.config import SinkConfig

log = logging.getLogger("kvbus.sinks")


# -------------------------------------------------------------------------- sink


def add_sink_args(p: argparse.ArgumentParser) -> None:
    """Options of ``kvbus sink``: the flags of :class:`~kvbus.sinks.config.SinkConfig`, each defaulting to
    its ``KVBUS_SINK_*`` variable."""
    add_flags(p, SinkConfig)


def sink_config(args: argparse.Namespace) -> SinkConfig:
    """The SinkConfig of ``kvbus sink``'s flags."""
    return from_flags(SinkConfig, args)


def check_topics(settings: Settings, config: SinkConfig) -> None:
    """Refuse block topics that retain less than one snapshot interval, warn about the doubtful ones
    (:mod:`kvbus.sinks.retention`); a cluster that does not let this sink read topic configurations is
    warned about only."""
    from confluent_kafka import KafkaException

    from kvbus.sinks.retention import INTERVAL_SETTING, check_retention, retentions

    try:
        found = retentions(settings.kafka(), settings.topics.blocks_pattern())
    except KafkaException as e:
        log.warning("could not read the block topics' retention (%s): make sure they retain records longer than %s",
                    e, INTERVAL_SETTING)
        return
    check_retention(found, config.snapshot_every)


def run_sink(args: argparse.Namespace, settings: Settings) -> int:
    """Run the sink until SIGTERM/SIGINT."""
    from kvbus.runtime.probes import Readiness, serve
    from kvbus.sinks.consumer import SinkConsumer
    from kvbus.sinks.metrics import SinkMetrics
    from kvbus.sinks.redis_memory import check_no_eviction
    from kvbus.sinks.store_url import open_store

    config = sink_config(args)
    metrics, readiness = SinkMetrics(), Readiness(starting="Kafka")
    if config.metrics_port:  # first: /healthz answers, and /readyz says what the sink waits for
        serve(config.metrics_port, metrics.registry, readiness)
        log.info("metrics on :%d/metrics, probes on /healthz and /readyz", config.metrics_port)
    check_kafka_access(settings.kafka())  # refused credentials or protocol: exit 2 naming the setting
    # a redis+cluster:// URL: the sharded view
    store = open_store(settings.redis_url, config.prefix, client_kwargs=settings.redis_kwargs())
    check_no_eviction(store.servers())  # a Redis that evicts keys would delete parts of the view: exit 2
    check_topics(settings, config)  # retention shorter than the snapshot interval: exit 2 naming both
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    sink = SinkConsumer(settings, store, config, metrics=metrics)
    probe_view = open_store(settings.redis_url, config.prefix, load=False, client_kwargs=settings.redis_kwargs())
    readiness.add(lambda: sink.not_ready(probe_view))
    readiness.starting = None
    log.info("sink writing the view to %s under prefix %r", redact_url(settings.redis_url), config.prefix)
    snapshotter = None
    if config.snapshot_every > 0:
        from kvbus.sinks.snapshot import Snapshotter

        reader = open_store(settings.redis_url, config.prefix, load=False, client_kwargs=settings.redis_kwargs())
        snapshotter = Snapshotter(settings, reader, config.snapshot_every, metrics)
        snapshotter.start()
    tune_gc()
    try:
        sink.run(stop)
    finally:
        if snapshotter is not None:
            snapshotter.stop.set()
    return 0


# -------------------------------------------------------------------------- lookup


def add_lookup_args(p: argparse.ArgumentParser) -> None:
    """Options of ``kvbus lookup``."""
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--hashes", help="comma-separated block hashes, block 0 first "
                                      "(decimal uint64, negative int64 or 0x-hex)")
    src.add_argument("--tokens", help="comma-separated prompt token ids (hashed as vLLM does)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per block with --tokens (default 16)")
    p.add_argument("--algo", default="sha256", choices=sorted(HASH_ALGOS),
                   help="vLLM --prefix-caching-hash-algo with --tokens (default sha256)")
    p.add_argument("--hash-seed", default=None,
                   help="the engines' PYTHONHASHSEED with --tokens (default: this process's PYTHONHASHSEED, "
                        "else vLLM's default seed; required for xxhash and xxhash_cbor, whose seed vLLM "
                        "otherwise draws at random per process)")
    p.add_argument("--lora-name", default=None,
                   help="with --tokens: the request's LoRA adapter (vLLM lora_name; default: the base model)")
    p.add_argument("--lora-path", default=None,
                   help="with --lora-name: the path the engines loaded the adapter from (--lora-modules NAME=PATH), "
                        f"which vLLM hashes from {first_release(lora_key='name_path')} on")
    p.add_argument("--cache-salt", default=None, help="with --tokens: the request's cache_salt (default none)")
    p.add_argument("--engine-version", default=None,
                   help="with --tokens: the engines' vLLM release, e.g. 0.30.0, where it hashes differently "
                        f"(default: {HASH_RELEASES[-1].release} and later)")
    p.add_argument("--replicas", help="only these candidates: replica names or <replica>#<dp_rank>, comma-separated")
    p.add_argument("--model", default=None,
                   help="only replicas serving this model (their bridges' --model); default: every replica, "
                        "whatever its model")
    p.add_argument("--weights", help="tier weights NAME=W over the defaults GPU=1,CPU=0.8,STORAGE=0.5,*=0.5 "
                                     "(NAME: a medium or an ownership)")
    p.add_argument("--prefix", default=DEFAULT_PREFIX, help="Redis key prefix of the view (default kvbus:)")
    p.add_argument("--json", action="store_true", help='print {"<replica>": {"matched": N, ...}, ...}')


TOKEN_KEYS = ("lora_name", "lora_path", "cache_salt", "engine_version")
"""``kvbus lookup`` options that change how --tokens are hashed (refused with --hashes)."""


def lookup_answer(args: argparse.Namespace, settings: Settings) -> dict[str, dict]:
    """The ``--json`` answer of ``kvbus lookup``: holders by display name, best first (tied holders
    by name), asked through :class:`kvbus.client.ViewClient`."""
    from kvbus.client import BY_NAME, ViewClient
    from kvbus.sinks.hashes import lora_of, parse_hashes, parse_tokens

    if args.hashes is not None:
        given = [f"--{k.replace('_', '-')}" for k in TOKEN_KEYS if getattr(args, k) is not None]
        if given:
            raise ValueError(f"{', '.join(given)} apply to --tokens: --hashes are hashed already")
        source: dict = {"hashes": parse_hashes(args.hashes)}
    else:
        source = {"tokens": parse_tokens(args.tokens), "block_size": args.block_size, "algo": args.algo,
                  "seed": args.hash_seed, "lora": lora_of(args.lora_name, args.lora_path),
                  "cache_salt": args.cache_salt, "engine_version": args.engine_version}
    candidates = [c.strip() for c in (args.replicas or "").split(",") if c.strip()] or None
    with ViewClient(settings.redis_url, args.prefix, tie_break=BY_NAME, **settings.redis_kwargs()) as view:
        found = view.lookup(**source, weights=args.weights, candidates=candidates, model=args.model)
        status = view.status()
    if not status.ready:
        print(f"kvbus lookup: warning: the view is {status.state} since {status.fields.get('since', '?')} "
              f"({status.fields.get('phase', 'no view yet')}): the answer may miss blocks", file=sys.stderr)
    return {m.name: m.to_json() for m in found}


def run_lookup(args: argparse.Namespace, settings: Settings) -> int:
    """Print which holders hold the longest prefix of a chain."""
    from kvbus.client import FunctionsMissing, LayoutMismatch

    try:
        answer = lookup_answer(args, settings)
    except (ValueError, FunctionsMissing, LayoutMismatch) as e:
        print(f"kvbus lookup: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(answer))
        return 0
    if not answer:
        print("no replica holds block 0 of this chain")
        return 0
    print(f"{'replica':<28} {'matched':>7} {'score':>9}  tiers")
    for name, m in answer.items():
        tiers = " ".join(f"{t}={n}" for t, n in m["tiers"].items())
        print(f"{name:<28} {m['matched']:>7} {m['score']:>9.3f}  {tiers}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m kvbus.sinks.cli {sink,lookup} ...``: the same as ``kvbus sink|lookup ...``."""
    from kvbus.cli import main as kvbus_main

    return kvbus_main(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    sys.exit(main())
