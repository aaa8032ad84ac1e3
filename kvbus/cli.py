"""The ``kvbus`` command: one subcommand per stage, plus the demo.

Subcommand names are a contract other tools rely on:
``demo fleet bridge worker sink lookup top report`` (and ``schemas check|register``), and ``-V``/``--version``.
Every subcommand honours the ``KVBUS_*`` settings (see ``kvbus.schemas.settings``).
Stage modules are imported only by the subcommand that needs them.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import sys
from typing import Callable, Sequence

from kvbus import __version__
from kvbus.schemas.security import SecurityConfigError, SecurityRefused, redis_security_hint
from kvbus.schemas.settings import Settings

#: subcommand -> (module, add-arguments function, run function, help)
SUBCOMMANDS: dict[str, tuple[str, str, str, str]] = {
    "demo": ("kvbus.demo", "add_demo_args", "run_demo",
             "bring the stack up, stream a demo fleet end to end, show the view and a lookup"),
    "fleet": ("kvbus.fleet", "add_fleet_args", "run_fleet",
              "synthetic engine replicas publishing KV events over ZMQ like vLLM/SGLang"),
    "bridge": ("kvbus.producers.cli", "add_bridge_args", "run_bridge",
               "ZMQ subscriber of one engine -> Avro -> Kafka (gap recovery via replay)"),
    "worker": ("kvbus.streams.cli", "add_worker_args", "run_worker",
               "Faust worker: aggregate worker reports, split tiers into topics"),
    "sink": ("kvbus.sinks.cli", "add_sink_args", "run_sink",
             "consolidated events -> block-residency view in Redis (exactly-once effect)"),
    "lookup": ("kvbus.sinks.cli", "add_lookup_args", "run_lookup",
               "longest cached prefix per replica for a chain of block hashes or tokens"),
    "top": ("kvbus.top.cli", "add_top_args", "run_top",
            "live console: flow, lag, freshness, bridges, workers, sinks, dead letters, the view"),
    "schemas": ("kvbus.schemas.cli", "add_schemas_args", "run_schemas",
                "check or register kvbus's Avro schemas against the registry"),
    "report": ("kvbus.analytics.cli", "add_report_args", "run_report",
               "analytics: read the block topics for a time range, print a summary, write HTML and Parquet"),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The argument parser with every subcommand's name; only ``command``'s options are loaded,
    so only that stage's CLI module is imported (a fast ``kvbus lookup``)."""
    parser = argparse.ArgumentParser(prog="kvbus", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("-V", "--version", action="version", version=f"kvbus {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, add_args, _run, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == command:
            _load(module, add_args)(p)
    return parser


def _load(module: str, attr: str) -> Callable:
    return getattr(importlib.import_module(module), attr)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvbus`` console script; returns the process exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(command)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    module, _add, run, _help = SUBCOMMANDS[args.command]
    try:
        settings = Settings.from_env()
    except SecurityConfigError as e:
        print(f"kvbus {args.command}: {e}", file=sys.stderr)
        return 2
    try:
        return int(_load(module, run)(args, settings) or 0)
    except KeyboardInterrupt:
        return 130
    except SecurityRefused as e:
        logging.getLogger("kvbus").error("%s: %s", args.command, e)
        return 2
    except Exception as e:  # noqa: BLE001 - only security refusals are answered here; the rest re-raised
        hint = redis_security_hint(e, settings.security.redis)
        if hint is None:
            raise
        logging.getLogger("kvbus").error("%s: %s -- %s", args.command, e, hint)
        return 2


if __name__ == "__main__":
    sys.exit(main())
