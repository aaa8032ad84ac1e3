"""The C allocator's trimmer: a trim gives back the pages of memory freed in the middle of the heap
(which glibc keeps otherwise), its counters are what it did, and it starts only once and never with
the interval 0. A fixed mmap threshold gives a freed large block back at once. A running stage
serving the counters: tests/test_probes.py."""
from __future__ import annotations

import ctypes
import subprocess
import sys
import threading

from prometheus_client import CollectorRegistry

from kvbus.runtime import allocator
from kvbus.runtime.settings import DEFAULT_MALLOC_MMAP_THRESHOLD

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


BLOCK_MIB = 4
"""Size of the large block of :data:`REUSE_A_LARGE_BLOCK`: above the fixed threshold, below the 32 MiB
up to which glibc's own threshold slides."""

REUSE_A_LARGE_BLOCK = f"""
import ctypes, sys
from kvbus.runtime import allocator
if sys.argv[1] == "fixed":
    assert allocator.fix_mmap_threshold({DEFAULT_MALLOC_MMAP_THRESHOLD}), "mallopt refused"
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
size = {BLOCK_MIB} * 2**20
before = allocator.resident_bytes()
for _ in range(2):  # a fetch buffer, freed; then the next one of the same size, freed
    block = libc.malloc(size)
    ctypes.memset(block, 1, size)
    libc.free(block)
print(allocator.resident_bytes() - before)
"""
"""Allocates, touches and frees a large block twice in a fresh process (argument ``fixed``: with the
threshold fixed first; else glibc's sliding one); prints the resident bytes it kept."""


def run_fresh(script: str, argument: str) -> subprocess.CompletedProcess:
    """``script`` run with ``argument`` in a fresh Python process (the allocator's state of a new
    process), which must succeed; its captured output."""
    done = subprocess.run([sys.executable, "-c", script, argument], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done


def resident_after_reusing_a_large_block(threshold: str) -> int:
    """Resident bytes a fresh process kept after :data:`REUSE_A_LARGE_BLOCK`."""
    return int(run_fresh(REUSE_A_LARGE_BLOCK, threshold).stdout)


def test_a_fixed_mmap_threshold_gives_a_freed_large_block_back_at_once():
    """glibc's sliding threshold rises to the first large block freed, so the second one comes from the
    heap and stays resident when freed; with the threshold fixed, each is unmapped when freed."""
    sliding = resident_after_reusing_a_large_block("sliding")
    fixed = resident_after_reusing_a_large_block("fixed")
    assert sliding > (BLOCK_MIB - 1) * 2**20, f"glibc's own threshold kept {sliding} bytes of a freed block"
    assert fixed < 2**20, f"with the threshold fixed, {fixed} bytes of a freed {BLOCK_MIB} MiB block stayed resident"


ARENAS_OF_FOUR_THREADS = """
import ctypes, sys, threading
from kvbus.runtime import allocator
if sys.argv[1] != "0":
    assert allocator.cap_arenas(int(sys.argv[1])), "mallopt refused"
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
held = []
together = threading.Barrier(4)
def allocate():
    together.wait()
    held.append(libc.malloc(1000))
threads = [threading.Thread(target=allocate) for _ in range(4)]
for t in threads:
    t.start()
for t in threads:
    t.join()
libc.malloc_stats()
"""
"""Four threads of a fresh process allocate at once (argument: the arena cap, 0 for none); glibc's
``malloc_stats`` then prints one ``Arena <n>:`` section per arena on stderr."""


def arenas_of_four_threads(cap: int) -> int:
    """Arenas a fresh process had after :data:`ARENAS_OF_FOUR_THREADS` with ``cap``."""
    stats = run_fresh(ARENAS_OF_FOUR_THREADS, str(cap)).stderr
    return sum(1 for line in stats.splitlines() if line.startswith("Arena "))


def test_capped_arenas_are_shared_by_the_threads():
    assert arenas_of_four_threads(0) == 5, "glibc's own limit: the main arena and one per thread"
    assert arenas_of_four_threads(2) == 2
    assert arenas_of_four_threads(1) == 1
