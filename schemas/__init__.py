"""kvbus's contract: the event model, its Avro schemas, topic names, settings and the lookup protocol,
and what every stage's process does alike (reading settings: env; probes; logs; retry pauses: backoff).

Every stage (producers, streams, sinks) and every external consumer shares
only what is defined here.
"""

if __name__ != "kvbus.schemas":  # schemas/ is installed as kvbus.schemas (pyproject.toml, package-dir)
    raise ImportError(f"import kvbus.schemas, not {__name__}")
