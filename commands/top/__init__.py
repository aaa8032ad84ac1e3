"""``kvbus top``: the operators' live console of a running pipeline.

It reads what the processes and services publish, never a stage's internals:
the bridges', Faust workers' and sinks' Prometheus endpoints, Kafka (committed offsets and
watermarks of the worker's and the sink's groups) and the residency view through its reader
(``kvbus.client.ViewClient``), as routers read it.

Modules:
  config.py    TopConfig: which endpoints, groups and view to watch (KVBUS_TOP_* and flags)
  metrics.py   reading one /metrics endpoint; the metric names the console reads, per role
  sources.py   Kafka (lag per hop and partition, topic ends) and the Redis view
  collect.py   one snapshot of everything, with rates and latency quantiles over the interval
  render.py    the snapshot as rich tables (the live screen and ``--once``)
  cli.py       ``kvbus top`` arguments and loop (``--once --json`` for scripts)
"""
