"""glibc's malloc set for an engine's process: two arenas, so that what the warm-up's
compiles and the steps' first runs free is reused rather than kept apart per thread.

By default glibc gives every thread that mallocs an arena of its own (up to 8 per core),
and a large block freed in one stays there for that thread. An engine's warm-up compiles
in several threads, and its steps run on the XLA pool's and the runner's. With two arenas,
`benchmarks/peers.py`'s MoE Q4_K_M engine peaked at 976-986 MB against 1061-1094, its
speeds the same (docs/performance.md). Fixing glibc's mmap threshold as well (4 or 32 MB)
saved 40 MB more but slowed a 512-token prefill by a tenth (likely because a fixed
threshold also stops glibc raising its trim threshold, so the steps' freed buffers go
back to the system and fault in again: not measured apart).

The `motet` command sets this as it starts, before JAX starts its threads. A program that
embeds the Engine can call tune_malloc itself, first thing, or set glibc's
MALLOC_ARENA_MAX.

give_back_free() returns what malloc holds free to the system, once, where a large
amount was just freed (the end of the warm-up): what is not given back counts in the
resident set until something reuses it. give_back_after_prefill() does it after each
long prefill chunk.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import platform
from collections.abc import Mapping

M_ARENA_MAX = -8  # mallopt's parameter (glibc's malloc.h)
ARENAS = 2

# A prefill chunk of at least this many tokens is followed by a trim (4-7 ms on the
# default model's engine, against 200 ms or more for the chunk): what the chunks before
# it freed (their new K and V, their temporaries) otherwise stays resident, and peers.py's
# peak on the default model was 20-30 MB higher (docs/performance.md, "Pages given back").
TRIM_AFTER_TOKENS = 128

# a setting the user made through the environment wins over ours
_USER_SETTINGS = ("MALLOC_ARENA_MAX", "GLIBC_TUNABLES")


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """The C library where it is glibc, found once: libc_ver reads the interpreter's
    binary and find_library runs ldconfig (2 ms a call), and a trim follows every long
    prefill chunk."""
    if platform.libc_ver()[0] != "glibc":
        return None
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")


def tune_malloc(environ: Mapping[str, str]) -> bool:
    """Two malloc arenas, where the C library is glibc and `environ` sets no arena count
    (nor any glibc tunable). Returns whether malloc was changed."""
    libc = _glibc()
    if libc is None or any(name in environ for name in _USER_SETTINGS):
        return False
    return libc.mallopt(M_ARENA_MAX, ARENAS) == 1  # 1: done


def give_back_free() -> bool:
    """malloc_trim(0): every free page of the heap and arenas back to the system, where
    the C library is glibc. Returns whether any was."""
    libc = _glibc()
    return libc is not None and libc.malloc_trim(0) == 1


def give_back_after_prefill(tokens: int) -> bool:
    """give_back_free() after a prefill chunk of `tokens` tokens, if that is at least
    TRIM_AFTER_TOKENS. Returns whether any was given back."""
    return tokens >= TRIM_AFTER_TOKENS and give_back_free()
