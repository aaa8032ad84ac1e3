"""What every kvbus process does alike, whichever stage it runs: its settings (``settings``, read from the
environment and flags by ``env``; ``security``: credentials and TLS), its Kafka clients
(``kafka_clients``), logs (``logs``), health and readiness
probes with metrics (``probes``), retry pauses (``backoff``), load that decides batching (``load_rate``),
and its memory (``allocator``: malloc trimming; ``collector``: Python's garbage collector).

The stages share this plumbing and the contract (:mod:`kvbus.schemas`), nothing else.
"""

if __name__ != "kvbus.runtime":  # runtime/ is installed as kvbus.runtime (pyproject.toml, package-dir)
    raise ImportError(f"import kvbus.runtime, not {__name__}")

