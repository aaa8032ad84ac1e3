"""Analytics over kvbus's topics: ``kvbus report`` and the Flink SQL job.

Reads the topics the way any analytics user would (a plain registry-aware consumer: confluent-kafka's
``AvroDeserializer`` and ``SchemaRegistryClient``, the writer's schema from the registry), turns the
records into tables (polars, Arrow) and computes what fleet operators ask of KV events: churn, block
lifetimes, re-announcements, fleet-wide sharing, incomplete aggregates and dead letters.

Modules: :mod:`kvbus.analytics.timerange` (``--since``/``--until``), :mod:`kvbus.analytics.reader` (the consumer),
:mod:`kvbus.analytics.progress` (what reading shows), :mod:`kvbus.analytics.tables` (records -> per-event tables),
:mod:`kvbus.analytics.lifecycle` (each block's store-to-remove life), :mod:`kvbus.analytics.metrics` (series, lifetimes,
sharing, prefixes), :mod:`kvbus.analytics.summary` (terminal text), :mod:`kvbus.analytics.html_report` (the one-file
report), :mod:`kvbus.analytics.sample` (``--sample``), :mod:`kvbus.analytics.topics_doc` (docs/topics.md),
:mod:`kvbus.analytics.flink_job` (the SQL job under ``analytics/flink/``). Imports only :mod:`schemas`.
"""

if __name__ != "kvbus.analytics":  # analytics/ is installed as kvbus.analytics (pyproject.toml, package-dir)
    raise ImportError(f"import kvbus.analytics, not {__name__}")
