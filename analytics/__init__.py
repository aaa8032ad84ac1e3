"""Analytics over kvbus's topics: ``kvbus report`` and the Flink SQL job.

Reads the topics the way any analytics user would (a plain registry-aware consumer: confluent-kafka's
``AvroDeserializer`` and ``SchemaRegistryClient``, the writer's schema from the registry), turns the
records into tables (polars, Arrow) and computes what fleet operators ask of KV events: churn, block
lifetimes, re-announcements, fleet-wide sharing, incomplete aggregates and dead letters.

Modules: :mod:`analytics.timerange` (``--since``/``--until``), :mod:`analytics.reader` (the consumer),
:mod:`analytics.progress` (what reading shows), :mod:`analytics.tables` (records -> per-event tables),
:mod:`analytics.lifecycle` (each block's store-to-remove life), :mod:`analytics.metrics` (series, lifetimes,
sharing, prefixes), :mod:`analytics.summary` (terminal text), :mod:`analytics.html_report` (the one-file
report), :mod:`analytics.sample` (``--sample``), :mod:`analytics.topics_doc` (docs/topics.md),
:mod:`analytics.flink_job` (the SQL job under ``analytics/flink/``). Imports only :mod:`schemas`.
"""
