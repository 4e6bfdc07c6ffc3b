"""runtime/allocator.py: with malloc tuned, threads share two arenas where each would
have had its own; a setting the user made in the environment is left alone."""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

from motet.runtime.allocator import ARENAS, tune_malloc

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="tunes glibc's malloc")

# A fresh interpreter mallocs a block in each of 8 threads, each thread's first, and
# counts the arenas glibc's malloc_info reports.
PROBE = """
import ctypes, json, re, sys, tempfile, threading
from motet.runtime.allocator import tune_malloc
tuned = tune_malloc({}) if sys.argv[1] == "tuned" else False
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = libc.fopen.restype = ctypes.c_void_p
libc.free.argtypes = libc.fclose.argtypes = [ctypes.c_void_p]
libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
start = threading.Barrier(8)
def work():
    start.wait()
    libc.free(libc.malloc(2**20))
threads = [threading.Thread(target=work) for _ in range(8)]
for t in threads: t.start()
for t in threads: t.join()
with tempfile.NamedTemporaryFile() as report:
    out = libc.fopen(report.name.encode(), b"w")
    libc.malloc_info(0, out)
    libc.fclose(out)
    arenas = len(re.findall(r'<heap nr="', open(report.name).read()))
print(json.dumps({"tuned": tuned, "arenas": arenas}))
"""


def probe(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def test_threads_share_two_arenas_once_tuned():
    untuned, tuned = probe("untuned"), probe("tuned")
    assert tuned == {"tuned": True, "arenas": ARENAS}
    assert untuned["arenas"] > ARENAS  # what the tuning is for: an arena a thread


@pytest.mark.parametrize("name", ["MALLOC_ARENA_MAX", "GLIBC_TUNABLES"])
def test_the_users_own_malloc_settings_win(name):
    assert tune_malloc({name: "1"}) is False


# Many small blocks freed below one that stays: glibc keeps their pages until trimmed.
FREED = """
import ctypes, json, resource
from motet.runtime.allocator import give_back_free
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
def rss_mb():
    return int(open("/proc/self/statm").read().split()[1]) * resource.getpagesize() / 2**20
blocks = [libc.malloc(4000) for _ in range(40000)]
for b in blocks:
    ctypes.memset(b, 1, 4000)
pinned = libc.malloc(4000)
for b in blocks:
    libc.free(b)
freed = rss_mb()
given = give_back_free()
print(json.dumps({"given": given, "freed": freed, "trimmed": rss_mb()}))
"""


def test_free_pages_go_back_once_given():
    out = json.loads(subprocess.run([sys.executable, "-c", FREED], capture_output=True, text=True,
                                    check=True).stdout)
    assert out["given"] is True
    assert out["freed"] - out["trimmed"] > 100  # of the 160 MB the blocks held
