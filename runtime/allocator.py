"""Give the C allocator's free memory back to the operating system, now and then.

A kvbus process that runs for days keeps glibc's malloc busy from many threads (librdkafka's
broker threads, Faust's consumer thread, the probes' server). glibc keeps one arena per thread
that contends, and frees a chunk into its arena's free lists without returning the pages to the
system unless they sit at the arena's top. After rebalances and broker outages (buffers grown,
then freed) those free lists hold pages no one uses again soon, and the process's RSS rises in
small steps. ``malloc_trim(0)`` returns every whole free page of every arena (glibc 2.8 and
later); free chunks that share a page with live ones stay resident (what remains, measured:
docs/benchmarks.md, "Soak").

:class:`Trimmer` calls it every ``KVBUS_MALLOC_TRIM_INTERVAL`` seconds on a thread of its own
(:func:`start`), from the long-running subcommands (bridge, worker, sink, serve); never in an
engine's process, whose allocator is the engine's business. Its counters are served on the
stage's ``/metrics`` (:func:`register`) beside the process's own metrics (``process_*``: RSS,
CPU, open files) of ``prometheus_client``.

glibc also raises its mmap threshold to the size of every large block freed (up to 32 MiB), so the
large buffers of later fetches and rebalances come from the arenas instead of their own mappings, and
their free space stays behind in the arenas' free lists between live chunks, where a trim cannot reach
it. :func:`start` fixes the threshold at ``KVBUS_MALLOC_MMAP_THRESHOLD`` bytes (``mallopt``; default
256 KiB): a block that large or larger is mapped on its own and unmapped when freed.

glibc gives each thread that allocates an arena of its own, up to eight per core; a sink or worker has
a dozen librdkafka threads or more. Each arena keeps the free space of its own threads' peaks, which
no other thread reuses. :func:`start` can cap the number of
arenas at ``KVBUS_MALLOC_ARENA_MAX`` (``mallopt(M_ARENA_MAX)``, before the stage starts its threads).

Hand-written on purpose: libc's ``malloc_trim`` and ``mallopt`` through ``ctypes``; no maintained library wraps them.
On a C library without ``malloc_trim`` or ``mallopt`` (musl, macOS) :func:`start` logs that and does
without.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import threading
import time
from typing import Any, Callable, Iterator, Optional

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

log = logging.getLogger("kvbus.allocator")

PAGE = os.sysconf("SC_PAGE_SIZE")


def resident_bytes() -> int:
    """This process's resident set size now, in bytes (``/proc/self/statm``)."""
    with open("/proc/self/statm", "rb") as f:
        return int(f.read().split()[1]) * PAGE


M_MMAP_THRESHOLD = -3
"""``mallopt``'s parameter number for the mmap threshold (glibc's ``malloc.h``)."""
M_ARENA_MAX = -8
"""``mallopt``'s parameter number for the largest number of arenas (glibc's ``malloc.h``)."""


def _libc_function(name: str, *argtypes: Any) -> Optional[Callable[..., int]]:
    """The C library's function ``name`` returning an int, or None where the C library has none."""
    library = ctypes.util.find_library("c")
    function = getattr(ctypes.CDLL(library), name, None) if library is not None else None
    if function is not None:
        function.argtypes = list(argtypes)
        function.restype = ctypes.c_int
    return function


def libc_trim() -> Optional[Callable[[int], int]]:
    """glibc's ``malloc_trim(pad)``, or None where the C library has none."""
    return _libc_function("malloc_trim", ctypes.c_size_t)


def _mallopt(param: int, value: int) -> bool:
    """glibc's ``mallopt(param, value)``: False where the C library has none or refuses the value."""
    mallopt = _libc_function("mallopt", ctypes.c_int, ctypes.c_int)
    return mallopt is not None and mallopt(param, value) == 1


def fix_mmap_threshold(size: int) -> bool:
    """Serve every malloc of ``size`` bytes or more from a mapping of its own, from now on (glibc's
    ``mallopt(M_MMAP_THRESHOLD)``, which also stops the threshold's sliding). False where the C
    library has no ``mallopt`` or refuses the size."""
    return _mallopt(M_MMAP_THRESHOLD, size)


def cap_arenas(count: int) -> bool:
    """Let threads that start allocating from now on share at most ``count`` arenas (glibc's
    ``mallopt(M_ARENA_MAX)``; arenas already made stay). False where the C library has no ``mallopt``
    or refuses the count."""
    return _mallopt(M_ARENA_MAX, count)


class Trimmer:
    """Calls ``trim(0)`` (ctypes releases the GIL meanwhile) and keeps count of what it gave back."""

    def __init__(self, trim: Callable[[int], int], interval: float) -> None:
        self._trim = trim
        self.interval = interval
        """Seconds between two trims (> 0)."""
        self.trims = 0
        """Calls so far."""
        self.released_bytes = 0
        """Resident bytes the calls gave back in all (the RSS drop across each call, when it dropped)."""
        self.seconds = 0.0
        """Wall seconds spent in the calls in all."""

    def trim_once(self) -> int:
        """Trim now; the resident bytes this call gave back (0 when the RSS did not drop)."""
        before = resident_bytes()
        t0 = time.perf_counter()
        self._trim(0)
        self.seconds += time.perf_counter() - t0
        released = max(0, before - resident_bytes())
        self.trims += 1
        self.released_bytes += released
        return released

    def run(self) -> None:
        """Trim every :attr:`interval` seconds, for ever (a daemon thread's target)."""
        while True:
            time.sleep(self.interval)
            released = self.trim_once()
            log.debug("malloc_trim gave back %.1f MiB", released / 2**20)


class TrimmerCollector(Collector):
    """The trimmer's counters as Prometheus metrics."""

    def __init__(self, trimmer: Trimmer) -> None:
        self.trimmer = trimmer

    def collect(self) -> Iterator[CounterMetricFamily]:
        t = self.trimmer
        yield CounterMetricFamily("kvbus_malloc_trims", "calls of glibc's malloc_trim(0) (KVBUS_MALLOC_TRIM_INTERVAL)",
                                  value=t.trims)
        yield CounterMetricFamily("kvbus_malloc_trim_released_bytes",
                                  "resident bytes malloc_trim gave back to the system", value=t.released_bytes)
        yield CounterMetricFamily("kvbus_malloc_trim_seconds", "wall seconds spent in malloc_trim", value=t.seconds)


_running: Optional[Trimmer] = None
"""The process's trimmer once :func:`start` has started one."""


def start(interval: float, mmap_threshold: int = 0, arena_max: int = 0) -> Optional[Trimmer]:
    """Fix the mmap threshold at ``mmap_threshold`` bytes (0: leave glibc's sliding one), cap the arenas
    at ``arena_max`` (0: glibc's own limit, eight per core), and start trimming every ``interval``
    seconds on a daemon thread (0: never). The trimmer, or None when ``interval`` is 0, the C library
    has no ``malloc_trim``, or one already runs."""
    global _running
    if mmap_threshold and not fix_mmap_threshold(mmap_threshold):
        log.info("the C library refused mallopt(M_MMAP_THRESHOLD, %d): KVBUS_MALLOC_MMAP_THRESHOLD has no "
                 "effect here", mmap_threshold)
    if arena_max and not cap_arenas(arena_max):
        log.info("the C library refused mallopt(M_ARENA_MAX, %d): KVBUS_MALLOC_ARENA_MAX has no effect here",
                 arena_max)
    if not interval or _running is not None:
        return None
    trim = libc_trim()
    if trim is None:
        log.info("the C library has no malloc_trim: KVBUS_MALLOC_TRIM_INTERVAL has no effect here")
        return None
    _running = Trimmer(trim, interval)
    threading.Thread(target=_running.run, name="malloc-trim", daemon=True).start()
    return _running


def register(registry: CollectorRegistry) -> None:
    """Serve the process's metrics (``process_*``) and, once :func:`start` has started the trimmer,
    its counters (``kvbus_malloc_trim*``) in ``registry``."""
    ProcessCollector(registry=registry)
    if _running is not None:
        registry.register(TrimmerCollector(_running))
