"""kvbus's contract: the event model, its Avro schemas (and the codec generated from them, the registry's
rules), topic names, vLLM's block hashing, tiers and the lookup protocol.

Every stage (producers, streams, sinks) and every external consumer shares only what is defined here,
and the processes' plumbing (:mod:`kvbus.runtime`).
"""

if __name__ != "kvbus.schemas":  # schemas/ is installed as kvbus.schemas (pyproject.toml, package-dir)
    raise ImportError(f"import kvbus.schemas, not {__name__}")
