"""Pages of a memory-mapped model file, handed back once the weights are built from them.

Loading reads every byte of the file through its mapping, and the mapping stays alive
after: float32 tensors become device arrays that share the file's memory (XLA:CPU takes
an aligned numpy array without copying it). Every page read stays counted in the
process's resident set, on top of the repacked weights: the file twice, in effect.
Dropping the pages from this process's mapping (the kernel keeps them in its page
cache) costs nothing now, and a page read again later is simply read from the file."""

from __future__ import annotations

import mmap

import numpy as np


def release_pages(mapping: np.memmap | None) -> None:
    """Drop a read-only mapping's resident pages (MADV_DONTNEED); its contents stay the
    file's, read back on the next touch."""
    handle = getattr(mapping, "_mmap", None)
    if handle is not None and hasattr(mmap, "MADV_DONTNEED"):
        handle.madvise(mmap.MADV_DONTNEED)
