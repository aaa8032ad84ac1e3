"""kvbus: the cluster-wide event bus for LLM inference KV-cache events.

The installed package's only top-level name. Its stages are subpackages: ``kvbus.producers``
(engine side), ``kvbus.streams`` (the Faust worker), ``kvbus.sinks`` (the Redis view),
``kvbus.schemas`` (the contract they share), ``kvbus.analytics`` (``kvbus report``) and
``kvbus.infra`` (the local development stack).
"""

if __name__ != "kvbus":  # commands/ is installed as kvbus (pyproject.toml, package-dir)
    raise ImportError(f"import kvbus, not {__name__}")

__version__ = "0.2.0"
