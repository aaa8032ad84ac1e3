"""Where ``kvbus demo`` puts its processes with its default options: their metrics ports and consumer
groups, and the fleet's size. ``kvbus demo`` starts them there and ``kvbus top`` watches them there by
default, each reading this module (top imports nothing of the demo itself)."""
from __future__ import annotations

BRIDGE_METRICS_BASE = 9410
"""Metrics port of the demo's first bridge; bridge n gets this + n."""
WORKER_METRICS_PORT = 9401
"""Metrics port of the demo's Faust worker."""
SINK_METRICS_PORT = 9402
"""Metrics port of the demo's sink."""
WORKER_GROUP = "kvbus-streams"
"""The demo worker's app id (its consumer group)."""
SINK_GROUP = "kvbus-sink"
"""The demo sink's consumer group."""
REPLICAS = 3
"""Engine replicas of the demo's fleet (``kvbus demo --replicas``'s default)."""
WORKERS = 1
"""Tensor-parallel workers per replica (``kvbus demo --workers``'s default): one stream and bridge each."""


def metrics_endpoints(bridges: int) -> dict[str, str]:
    """The metrics ports the demo gives its processes (``kvbus top``'s endpoint lists), per role,
    with ``bridges`` bridges."""
    return {"bridges": f"{BRIDGE_METRICS_BASE}-{BRIDGE_METRICS_BASE + bridges - 1}",
            "workers": str(WORKER_METRICS_PORT), "sinks": str(SINK_METRICS_PORT)}
