"""kvbus sinks stage: consolidated block events (Kafka) -> residency view (Redis) <- routers.

Modules:
  consumer.py      the Kafka loop (``SinkConsumer``): decode, check, apply, dead-letter, commit, expire
  view/            the residency view itself: its reader, writer and recovery interfaces, the Redis
                   stores, the function library (view/__init__.py lists its modules)
  retention.py     the block topics' retention against the snapshot interval (checked at start)
  rebuild.py       rebuilding a lost view; snapshot.py: snapshots of the view to Kafka
  layout_gate.py   the order of a holder's events across the two block layouts while workers move
  validate.py      checks a record must pass (else: dead-letter topic)
  config.py        the sink's settings (``SinkConfig``)
  metrics.py       Prometheus metrics
  cli.py           ``kvbus sink``
Layout and semantics: docs/sinks-layout.md.
"""

if __name__ != "kvbus.sinks":  # sinks/ is installed as kvbus.sinks (pyproject.toml, package-dir)
    raise ImportError(f"import kvbus.sinks, not {__name__}")
