"""The pages of the process's shared libraries that only starting and compiling touched,
handed back once an engine is warm.

jaxlib's main library is about 350 MB, most of it XLA's compiler (LLVM, MLIR). Importing
JAX and compiling leaves about 90 MB of its code and read-only data resident, and the
other libraries (Python's, numpy's, the tokenizer's, the grammar engine's) 25 MB more,
each page counted in the process's resident set for its life, while a warm engine runs
only its executables, JAX's dispatch and a little Python: about 7 MB of jaxlib's pages
came back over `benchmarks/peers.py`'s workload on the default model
(docs/performance.md). Dropping the clean pages from this process's mappings
(MADV_DONTNEED) takes a few ms; the kernel keeps them in its page cache, clean and
reclaimable, and a page touched again (a step's code, or a later compile) is mapped back
from there.

Only mappings that cannot have been written are dropped: read-only, not one private page
dirty, nothing anonymous (a library's relocated RELRO segment is dirty and stays).
"""

from __future__ import annotations

import ctypes
import mmap
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass

_SHARED_LIBRARY = re.compile(r"\.so(\.[0-9]+)*$")
_MAPPING = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) (\S{4}) ")


@dataclass(frozen=True)
class Mapping:
    start: int
    end: int
    resident_kb: int


def clean_library_pages(smaps: str) -> list[Mapping]:
    """The mappings of shared libraries in /proc/PID/smaps text that hold resident pages
    and were never written: read-only, no dirty or anonymous page."""
    found = []
    for start, end, perms, path, fields in _mappings(smaps):
        never_written = "w" not in perms and not any(
            fields.get(name, 0) for name in ("Private_Dirty", "Shared_Dirty", "Anonymous"))
        if never_written and _SHARED_LIBRARY.search(path) and fields.get("Rss", 0) > 0:
            found.append(Mapping(start, end, fields["Rss"]))
    return found


def _mappings(smaps: str) -> Iterator[tuple[int, int, str, str, dict[str, int]]]:
    """(start, end, permissions, path, its "kB" fields) of each mapping."""
    head: tuple[int, int, str, str] | None = None
    fields: dict[str, int] = {}
    for line in smaps.splitlines():
        mapping = _MAPPING.match(line)
        if mapping:
            if head is not None:
                yield *head, fields
            parts = line.split(maxsplit=5)
            path = parts[5] if len(parts) > 5 else ""
            head, fields = (int(mapping[1], 16), int(mapping[2], 16), mapping[3], path), {}
        elif line.endswith(" kB"):
            name, value = line.split(":", 1)
            fields[name] = int(value.split()[0])
    if head is not None:
        yield *head, fields


def give_back_code_pages() -> int:
    """Drop the resident pages of shared libraries that were never written from this
    process's mappings. Returns the bytes dropped (0 off Linux)."""
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_DONTNEED"):
        return 0
    try:
        with open("/proc/self/smaps") as source:
            mappings = clean_library_pages(source.read())
    except OSError:
        return 0
    libc = ctypes.CDLL(None, use_errno=True)  # the process's own symbols, the C library's among them
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    dropped = 0
    for m in mappings:
        if libc.madvise(m.start, m.end - m.start, mmap.MADV_DONTNEED) == 0:
            dropped += m.resident_kb * 1024
    return dropped
