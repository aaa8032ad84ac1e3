"""``kvbus schemas check|register``: is a schema change compatible with what the registry holds?"""
from __future__ import annotations

import argparse
import json

from kvbus.runtime.settings import Settings
from kvbus.schemas.registry import check, register


def add_schemas_args(p: argparse.ArgumentParser) -> None:
    """Options of ``kvbus schemas``."""
    p.add_argument("action", choices=["check", "register"],
                   help="check: compatibility against the registry (exit 1 if any is incompatible); "
                        "register: register every kvbus subject")
    p.add_argument("--ownership", action="append", default=[],
                   help="also the tier topic kvbus.blocks.<ownership> (repeatable)")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def run_schemas(args: argparse.Namespace, settings: Settings) -> int:
    """Run ``kvbus schemas``; exit code 1 when a schema is incompatible or refused."""
    own = tuple(args.ownership)
    if args.action == "register":
        try:
            ids = register(settings.registry_url, settings.topics, own, settings.security.registry)
        except ValueError as e:
            print(f"refused: {e}")
            return 1
        print(json.dumps(ids) if args.json else "\n".join(f"{s}: id {i}" for s, i in ids.items()))
        return 0
    results = check(settings.registry_url, settings.topics, own, settings.security.registry)
    if args.json:
        print(json.dumps([r.__dict__ for r in results]))
    else:
        for r in results:
            print(f"{r.subject:40s} {r.record:12s} {r.status}")
            for m in r.messages:
                print(f"    {m}")
    return 1 if any(r.status in ("incompatible", "error") for r in results) else 0
