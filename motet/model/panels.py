"""Q6_K, Q5_K, Q4_K, Q4_1 and Q4_0 matrices held as the integer kernels' panels
(panel_layout.py's p8 and p4), which AVX2's and AVX-512 VNNI's kernels read, and Q8_0
ones, which AVX-512 VNNI's read.

The integer pairs read a matrix 16 rows at a time, four values of each row a dword
(kernels/pairs_bytes_avx2.inc). Built from row-major bytes on every call, those panels
took a fifth of the Q6_K head's 16-row product, and the one-row dots widen every byte
to int16; held that way from the load, one `vpmaddubsw` takes 32 of the file's values
as they lie, at one row of x as at many (kernels/panels_avx2.inc): x in int8 a byte a
value, x on 16 bits as two planes of bytes; AVX-512 VNNI's vpdpbusd takes 64 of them
(kernels/panels_vnni.inc). So every matrix of those types is held so where the kernels
are AVX2's or AVX-512 VNNI's: all but the embedding of a Q4_K_M file, all but the tied
head of the default model. The values, scales and mins are the file's, reordered, and
the bytes held do not change. No other kernel reads panels; the XLA path puts the rows
back in order.
"""

from __future__ import annotations

import jax
import numpy as np

from . import native
from .panel_layout import PANEL_ROWS, PANELS, as_panels, rows_of_panels
from .quant import QTensor


def kernels_read_panels() -> bool:
    """Whether this process's products go to kernels that read panels: AVX2's or AVX-512
    VNNI's, on the CPU."""
    return jax.default_backend() == "cpu" and native.instruction_set() in native.READ_PANELS


def takes_panels(w, isa: str | None = None) -> bool:
    """Whether w can be held in panels for the kernels of `isa` (None: this process's): a
    matrix, or a stack of experts' matrices, in whole panels of Q6_K blocks (p8: int8
    scales per 16 values, a float per 256), Q5_K ones (p8: byte scales and mins per 32, a
    float each per 256), Q4_K ones (p4, likewise), Q4_1 and Q4_0 ones (p4: half-float
    scales and mins per 32), or, for AVX-512 VNNI's, Q8_0 ones (p8: half-float scales per
    32; AVX2's vpmaddubsw would saturate on its bytes)."""
    if not isinstance(w, QTensor) or w.values.shape[-2] % PANEL_ROWS:
        return False
    if w.layout == "q8" and w.source == "Q8_0":
        eight_bits = (native.instruction_set() if isa is None else isa) == "avx512vnni"
        return eight_bits and w.block == 32 and w.min is None and np.dtype(w.scale.dtype) == np.dtype(np.float16)
    if w.layout == "q4" and w.source in ("Q4_0", "Q4_1"):  # p4 with half-float scales and mins
        return w.min is not None and {np.dtype(w.scale.dtype), np.dtype(w.min.dtype)} == {np.dtype(np.float16)}
    if w.super_scale is None:
        return False
    if w.layout == "q8" and w.source == "Q6_K":
        return w.block == 16 and w.group == 16 and w.min is None
    return (w.layout, w.source) in (("q8", "Q5_K"), ("q4", "Q4_K")) and w.group == 8 and w.super_min is not None


def as_read_here(tree):
    """The QTensors of a pytree (a QTensor, a QRows' pieces) as this process's products
    read them: matrices of the types takes_panels names in panels where the kernels read
    panels (not the embedding, whose lookups take rows: the caller leaves it out)."""
    panels = kernels_read_panels()
    return jax.tree.map(lambda w: as_panels(w) if panels and takes_panels(w) else w, tree,
                        is_leaf=lambda t: isinstance(t, QTensor))


def in_rows(tree):
    """The QTensors of a pytree with every panel put back in row order, on the device: as
    the kernels of other instruction sets read them (a test that picks one, a benchmark
    against rows)."""
    def rows(w):
        if isinstance(w, QTensor) and w.layout in PANELS:
            return jax.device_put(jax.tree.map(np.asarray, rows_of_panels(w)))
        return w

    return jax.tree.map(rows, tree, is_leaf=lambda t: isinstance(t, QTensor))
