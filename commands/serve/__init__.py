"""``kvbus serve``: an HTTP query API over the residency view, in the shape of Mooncake's conductor
indexer API (docs/serve.md).

* :mod:`kvbus.serve.query`: requests (decoded and checked), the one lookup call, answers;
* :mod:`kvbus.serve.app`: the aiohttp service (``/query``, ``/query_by_hash``, ``/healthz``,
  ``/readyz``, ``/metrics``);
* :mod:`kvbus.serve.serve_config`: its ``KVBUS_SERVE_*`` settings; :mod:`kvbus.serve.cli`: its flags;
* :mod:`kvbus.serve.metrics`: its Prometheus metrics.

It reads the view through :mod:`kvbus.client` only.
"""
