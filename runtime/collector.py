"""Python's garbage collector in a kvbus stage (bridge, worker, sink).

Their hot paths allocate ~10 tracked Python objects per event, almost all freed by reference
counting; Python's default collector thresholds (700, 10, 10) still ran a young collection every ~80
events and full ones over the whole heap. :func:`tune_gc`, called by each stage once it has started,
freezes what start-up allocated and collects less often (:data:`GC_THRESHOLD`). Standard library only:
the sink's module also serves ``kvbus lookup`` in the ``[client]`` install.
"""
from __future__ import annotations

import gc

GC_THRESHOLD = (50_000, 20, 100)
"""``gc.set_threshold`` of a stage: GC off halved the worker's aggregation time in a micro-benchmark; the
sink's decoding, checking and packing fell from 4.3 to 3.1 µs per event (docs/performance.md, "The
collector, lz4 weighed, and where the rest goes")."""


def tune_gc() -> None:
    """Move what start-up allocated (modules, clients, Faust) out of the collector's sight
    (``gc.freeze``) and collect less often (:data:`GC_THRESHOLD`); cycles are still collected."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLD)
