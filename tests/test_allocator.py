"""runtime/allocator.py: with malloc tuned, a large block freed goes back to the system
even after one of its size was freed before (glibc's moving threshold would keep it);
a setting the user made in the environment is left alone."""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

from motet.runtime.allocator import tune_malloc

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="tunes glibc's malloc")

# A fresh interpreter allocates, touches and frees a 24 MB block twice, and reports how
# much of the second stayed resident after its free.
PROBE = """
import ctypes, json, os, sys
from motet.runtime.allocator import tune_malloc
tuned = tune_malloc({}) if sys.argv[1] == "tuned" else False
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
page = os.sysconf("SC_PAGE_SIZE")
def resident():
    return int(open("/proc/self/statm").read().split()[1]) * page
size = 24 * 2**20
for _ in range(2):
    before = resident()
    block = libc.malloc(size)
    libc.memset(block, 1, size)
    libc.free(block)
print(json.dumps({"tuned": tuned, "kept_mb": (resident() - before) / 2**20}))
"""


def probe(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def test_a_freed_large_block_goes_back_to_the_system_once_tuned():
    untuned, tuned = probe("untuned"), probe("tuned")
    assert tuned["tuned"] is True
    assert tuned["kept_mb"] < 4
    # what the tuning is for: glibc's own threshold rose to the first block's size, so
    # the second came from the heap and stayed there
    assert untuned["kept_mb"] > 20


@pytest.mark.parametrize("name", ["MALLOC_ARENA_MAX", "MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES"])
def test_the_users_own_malloc_settings_win(name):
    assert tune_malloc({name: "1"}) is False
