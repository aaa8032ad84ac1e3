"""How often the schema registry leaves a request unanswered, per endpoint.

    .venv/bin/python benchmarks/registry_probe.py                 # 300 requests per endpoint
    .venv/bin/python benchmarks/registry_probe.py --requests 1000 --timeout 2

Against the running registry (``KVBUS_REGISTRY_URL``), one ``SchemaRegistryClient`` with
``--timeout`` seconds per request and no retries sends ``--requests`` GETs, 50 ms apart, to each of:

- ``associations``: ``/associations/resources/-/<topic>`` (what confluent-kafka >= 2.13's default
  subject-name strategy asks on every record it deserializes; Apicurio answers 404);
- ``subjects``: ``/subjects`` (200);
- ``schema_by_id``: ``/schemas/ids/<id of the first subject's latest version>`` (200);
- ``missing_subject``: ``/subjects/<unknown>/versions`` (404).

A request that times out counts as unanswered. The last line printed is one JSON object:
``{endpoint: {"requests": n, "unanswered": k}}``.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Callable

from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.common._httpx_compat import httpx  # httpx2 or httpx, as confluent uses
from confluent_kafka.schema_registry.error import SchemaRegistryError

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvbus.runtime.settings import Settings  # noqa: E402


def count_unanswered(call: Callable[[int], object], requests: int, gap_s: float = 0.05) -> int:
    """Calls ``call(i)`` for i in range(requests); returns how many timed out (HTTP errors are answers)."""
    unanswered = 0
    for i in range(requests):
        try:
            call(i)
        except SchemaRegistryError:
            pass
        except httpx.TimeoutException:
            unanswered += 1
            print(f"  request {i}: no answer", flush=True)
        time.sleep(gap_s)
    return unanswered


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=300, help="requests per endpoint")
    ap.add_argument("--timeout", type=float, default=2.0, help="seconds before a request counts as unanswered")
    args = ap.parse_args()
    url = Settings.from_env().registry_url
    client = SchemaRegistryClient({"url": url, "timeout": args.timeout, "max.retries": 0})
    rest = client._rest_client  # noqa: SLF001 - raw GETs, without the client's caches
    subjects = client.get_subjects()
    schema_id = client.get_latest_version(subjects[0]).schema_id if subjects else 1
    endpoints: dict[str, Callable[[int], object]] = {
        "associations": lambda i: client.get_associations_by_resource_name(f"probe{i}", "-", "topic", ["value"]),
        "subjects": lambda i: rest.get("subjects"),
        "schema_by_id": lambda i: rest.get(f"schemas/ids/{schema_id}"),
        "missing_subject": lambda i: rest.get(f"subjects/probe-missing-{i}/versions"),
    }
    figures = {}
    for name, call in endpoints.items():
        print(f"{name}: {args.requests} requests to {url}", flush=True)
        figures[name] = {"requests": args.requests, "unanswered": count_unanswered(call, args.requests)}
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
