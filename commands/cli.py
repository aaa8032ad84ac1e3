"""The ``kvbus`` command: one subcommand per stage, plus the demo.

Subcommand names are a contract other tools rely on:
``demo fleet bridge worker sink lookup serve top report`` (and ``schemas check|register``), and ``-V``/``--version``.
Every subcommand honours the ``KVBUS_*`` settings (see ``kvbus.runtime.settings``).
Stage modules are imported only by the subcommand that needs them. A malformed ``KVBUS_*`` value
or flag ends the command with exit code 2 and one line naming it (:mod:`kvbus.runtime.env`).
"""
from __future__ import annotations

import argparse
import importlib
import logging
import sys
from typing import Callable, Sequence

from kvbus import __version__
from kvbus.runtime import logs
from kvbus.runtime.env import SettingError
from kvbus.runtime.security import SecurityRefused, redis_security_hint
from kvbus.runtime.settings import Settings

#: subcommand -> (module, add-arguments function, run function, help)
SUBCOMMANDS: dict[str, tuple[str, str, str, str]] = {
    "demo": ("kvbus.demo", "add_demo_args", "run_demo",
             "bring the stack up, stream a demo fleet end to end, show the view and a lookup"),
    "fleet": ("kvbus.simulator.fleet", "add_fleet_args", "run_fleet",
              "synthetic engine replicas publishing KV events over ZMQ like vLLM/SGLang"),
    "bridge": ("kvbus.producers.cli", "add_bridge_args", "run_bridge",
               "ZMQ subscriber of one engine -> Avro -> Kafka (gap recovery via replay)"),
    "worker": ("kvbus.streams.cli", "add_worker_args", "run_worker",
               "Faust worker: aggregate worker reports, split tiers into topics"),
    "sink": ("kvbus.sinks.cli", "add_sink_args", "run_sink",
             "consolidated events -> block-residency view in Redis (exactly-once effect)"),
    "lookup": ("kvbus.client.lookup_cli", "add_lookup_args", "run_lookup",
               "longest cached prefix per replica for a chain of block hashes or tokens"),
    "serve": ("kvbus.serve.cli", "add_serve_args", "run_serve",
              "HTTP query API over the view (Mooncake's indexer API: /query, /query_by_hash), probes, metrics"),
    "top": ("kvbus.top.cli", "add_top_args", "run_top",
            "live console: flow, lag, freshness, bridges, workers, sinks, dead letters, the view"),
    "schemas": ("kvbus.schemas.cli", "add_schemas_args", "run_schemas",
                "check or register kvbus's Avro schemas against the registry"),
    "report": ("kvbus.analytics.cli", "add_report_args", "run_report",
               "analytics: read the block topics for a time range, print a summary, write HTML and Parquet"),
}


SERVICES = frozenset({"bridge", "worker", "sink", "serve"})
"""The subcommands that run until stopped: they fix the C allocator's mmap threshold
(``KVBUS_MALLOC_MMAP_THRESHOLD``), cap its arenas (``KVBUS_MALLOC_ARENA_MAX``) and give its free pages
back every ``KVBUS_MALLOC_TRIM_INTERVAL`` seconds (:mod:`kvbus.runtime.allocator`)."""


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors: a bad flag raises :class:`SettingError` (``kvbus`` prints the
    line and exits 2) instead of printing the usage text."""

    def error(self, message: str):  # type: ignore[override]
        raise SettingError(f"{message} (see {self.prog} --help)")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The argument parser with every subcommand's name; only ``command``'s options are loaded,
    so only that stage's CLI module is imported (a fast ``kvbus lookup``)."""
    parser = Parser(prog="kvbus", description=__doc__.splitlines()[0])
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
    command = command if command in SUBCOMMANDS else None
    settings: Settings | None = None
    try:
        logs.configure(command or "kvbus", fmt=logs.log_format())
        parser = build_parser(command)  # flag defaults read KVBUS_* variables
        args = parser.parse_args(argv)
        if args.verbose:
            logging.getLogger().setLevel(logging.DEBUG)
        module, _add, run, _help = SUBCOMMANDS[args.command]
        settings = Settings.from_env()
        if args.command in SERVICES:  # imported here: a client-only install has no prometheus_client
            from kvbus.runtime import allocator
            allocator.start(settings.malloc_trim_interval, settings.malloc_mmap_threshold, settings.malloc_arena_max)
        return int(_load(module, run)(args, settings) or 0)
    except SettingError as e:
        _bad_setting(command, e)
        return 2
    except KeyboardInterrupt:
        return 130
    except SecurityRefused as e:
        logging.getLogger("kvbus").error("%s: %s", command, e)
        return 2
    except Exception as e:  # noqa: BLE001 - only security refusals are answered here; the rest re-raised
        hint = redis_security_hint(e, settings.security.redis) if settings is not None else None
        if hint is None:
            raise
        logging.getLogger("kvbus").error("%s: %s -- %s", command, e, hint)
        return 2


def _bad_setting(command: str | None, e: SettingError) -> None:
    """The one line of a malformed setting or flag: plain on stderr, a JSON log line in JSON mode."""
    line = f"kvbus {command}: {e}" if command else f"kvbus: {e}"
    if logs.json_enabled():
        logging.getLogger("kvbus").error("%s", line)
    else:
        print(line, file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
