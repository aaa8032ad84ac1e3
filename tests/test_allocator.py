"""The C allocator's trimmer: a trim gives back the pages of memory freed in the middle of the heap
(which glibc keeps otherwise), its counters are what it did, and it starts only once and never with
the interval 0. A running stage serving the counters: tests/test_probes.py."""
from __future__ import annotations

import ctypes
import threading

from prometheus_client import CollectorRegistry

from kvbus.schemas import allocator

CHUNK = 4096
"""Bytes per allocation: below glibc's mmap threshold, so they come from an arena."""


def fragmented_heap(mib: int) -> tuple[list[int], int]:
    """Allocate ``mib`` MiB in small chunks on a thread of its own (so in an arena of its own, as
    librdkafka's threads allocate) and free all but every 64th: the freed pages lie between live
    chunks, where glibc keeps them. The surviving chunks' addresses, and the libc to free them with."""
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    kept: list[int] = []

    def churn() -> None:
        chunks = [libc.malloc(CHUNK) for _ in range(mib * 2**20 // CHUNK)]
        for c in chunks:
            ctypes.memset(c, 1, CHUNK)  # touch it: resident
        for i, c in enumerate(chunks):
            if i % 64:
                libc.free(c)
            else:
                kept.append(c)
    t = threading.Thread(target=churn)
    t.start()
    t.join()
    return kept, libc


def test_a_trim_gives_back_the_pages_freed_between_live_chunks():
    trim = allocator.libc_trim()
    assert trim is not None, "this test runs on glibc"
    kept, libc = fragmented_heap(64)
    try:
        trimmer = allocator.Trimmer(trim, interval=60)
        released = trimmer.trim_once()
        assert released > 32 * 2**20, f"a trim after freeing ~63 MiB between live chunks gave back {released} bytes"
        assert (trimmer.trims, trimmer.released_bytes) == (1, released) and trimmer.seconds > 0
        again = trimmer.trim_once()
        assert again < 4 * 2**20, f"a second trim right after gave back {again} bytes more"
        assert trimmer.trims == 2 and trimmer.released_bytes == released + again
    finally:
        for c in kept:
            libc.free(c)


def test_the_counters_are_served_as_metrics():
    trimmer = allocator.Trimmer(lambda pad: 0, interval=60)
    trimmer.trim_once()
    registry = CollectorRegistry()
    registry.register(allocator.TrimmerCollector(trimmer))
    assert registry.get_sample_value("kvbus_malloc_trims_total") == 1
    assert registry.get_sample_value("kvbus_malloc_trim_released_bytes_total") == trimmer.released_bytes
    assert registry.get_sample_value("kvbus_malloc_trim_seconds_total") == trimmer.seconds


def test_an_interval_of_zero_starts_no_trimmer():
    assert allocator.start(0) is None
