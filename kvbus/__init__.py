"""kvbus: the cluster-wide event bus for LLM inference KV-cache events.

The installed package's only top-level name. Its stages are subpackages: ``kvbus.producers``
(engine side), ``kvbus.streams`` (the Faust worker), ``kvbus.sinks`` (the Redis view),
``kvbus.schemas`` (the contract they share), ``kvbus.analytics`` (``kvbus report``) and
``kvbus.infra`` (the local development stack).
"""

__version__ = "0.2.0"
