"""glibc's malloc set for an engine's process: fewer arenas and a fixed mmap threshold,
so the memory that compiles and first runs free goes back to the system instead of
staying in the process's resident set.

By default glibc gives each thread that contends for the heap an arena of its own (up to
8 per core), and it raises its mmap threshold to the size of each large block freed (up
to 32 MB), after which blocks of that size come from an arena and stay there once freed.
An engine's warm-up compiles in several threads and runs each step once, and both
allocate and free large blocks. With two arenas and a threshold fixed at 4 MB the MoE
Q4_K_M engine of `benchmarks/peers.py` (16 slots of 768) was ready at 946–954 MB against
1004–1040 (docs/performance.md), its steps no slower: a decode step's buffers are below
the threshold, and a prefill's above it are a few page faults against a chunk's
hundreds of milliseconds.

The `motet` command sets this as it starts, before JAX starts its threads. A program that
embeds the Engine can call tune_malloc itself, first thing, or set the same through
glibc's environment variables (MALLOC_ARENA_MAX, MALLOC_MMAP_THRESHOLD_).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform
from collections.abc import Mapping

# mallopt's parameters (glibc's malloc.h)
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8

ARENAS = 2
MMAP_THRESHOLD = 4 * 2**20

# a setting the user made through the environment wins over ours
_USER_SETTINGS = ("MALLOC_ARENA_MAX", "MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES")


def tune_malloc(environ: Mapping[str, str]) -> bool:
    """Two arenas and a 4 MB mmap threshold, where the C library is glibc and `environ`
    sets neither (nor any glibc tunable). Returns whether malloc was changed."""
    if platform.libc_ver()[0] != "glibc" or any(name in environ for name in _USER_SETTINGS):
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    # mallopt returns 1 on success
    return bool(libc.mallopt(M_ARENA_MAX, ARENAS)) and bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD))
