"""``kvbus top``: the live console (full screen, refreshed every ``--interval`` seconds, Ctrl-C quits).

    kvbus top [--bridges 9410-9412] [--workers 9401] [--sinks 9402] [--worker-group G] [--sink-group G]
              [--prefix kvbus:] [--interval 1] [--once [--json]]

``--once`` samples everything twice, ``--interval`` apart (so rates are real), prints the screen once
and exits; with ``--json`` it prints the snapshot instead (keys: :mod:`kvbus.top.collect`). Exit code 0
even when sources are unreachable: their panels (and JSON ``error`` fields) say so.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time

from kvbus.runtime.settings import Settings
from kvbus.top.top_config import add_top_config_args, top_config


def add_top_args(p: argparse.ArgumentParser) -> None:
    """Options of ``kvbus top``."""
    add_top_config_args(p)
    p.add_argument("--once", action="store_true", help="sample twice, --interval apart, print once and exit")
    p.add_argument("--json", action="store_true", help="with --once: print the snapshot as one JSON object")


def run_top(args: argparse.Namespace, settings: Settings) -> int:
    """Run the console; 2 on bad arguments, else 0."""
    from rich.console import Console
    from rich.live import Live

    from kvbus.top.collect import Collector
    from kvbus.top.render import render

    try:
        cfg = top_config(args)
    except ValueError as e:
        print(f"kvbus top: {e}", file=sys.stderr)
        return 2
    if args.json and not args.once:
        print("kvbus top: --json needs --once", file=sys.stderr)
        return 2
    if not args.once:  # log lines would tear the screen; what fails shows in its panel
        logging.disable(logging.CRITICAL)
    collector = Collector(cfg, settings)
    console = Console()
    try:
        if args.once:
            collector.collect()
            time.sleep(cfg.interval)
            snap = collector.collect()
            if args.json:
                print(json.dumps(snap, sort_keys=True))
            else:
                console.print(render(snap, console.width))
            return 0
        with Live(console=console, screen=True, auto_refresh=False) as live:
            while True:
                t0 = time.monotonic()
                live.update(render(collector.collect(), console.width), refresh=True)
                time.sleep(max(0.0, cfg.interval - (time.monotonic() - t0)))
    except KeyboardInterrupt:
        return 0
    finally:
        collector.close()
