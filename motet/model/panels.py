"""The LM head held as the AVX2 kernels' panels (quant.py's p8 layout), where x is
rounded to int8.

The integer pairs read a matrix 16 rows at a time, four values of each row a dword
(kernels/pairs_bytes_avx2.inc). Built from row-major bytes on every call, those panels
took a fifth of the Q6_K head's 16-row product; held that way from the load, one
`vpmaddubsw` takes 32 of the file's values as they lie, at one row of x as at many
(kernels/panels_avx2.inc). The values and scales are the file's, reordered, so the
bytes held do not change. Only the head: it is the largest matrix a token reads whole,
and a matrix held in panels is read by no other kernel (the XLA path reorders it back).
"""

from __future__ import annotations

from dataclasses import replace

import jax
import numpy as np

from . import native
from .quant import PANEL_ROWS, QTensor, rows_of_panels


def kernels_read_panels() -> bool:
    """Whether this process's products go to kernels that read p8: AVX2's, on the CPU."""
    return jax.default_backend() == "cpu" and native.instruction_set() == "avx2"


def takes_panels(w) -> bool:
    """Whether w can be held as p8: one matrix of Q6_K blocks (int8 scales per 16 values,
    a float per 256) of whole panels."""
    return (isinstance(w, QTensor) and w.layout == "q8" and w.source == "Q6_K" and w.block == 16
            and w.group == 16 and w.min is None and w.super_scale is not None and w.values.ndim == 2
            and w.values.shape[0] % PANEL_ROWS == 0)


def as_panels(w: QTensor) -> QTensor:
    """w (takes_panels) on the host as p8: panel p is rows 16p to 16p + 15, its values
    [K/4][16] dwords of four values plus 32 (unsigned), its scales [K/16][16] and super
    entries [K/256][16], each array keeping w's shape."""
    values = np.asarray(w.values)
    n, k = values.shape

    def panels(a):
        a = np.asarray(a)
        entries = a.shape[-1]
        return np.ascontiguousarray(a.reshape(n // PANEL_ROWS, PANEL_ROWS, entries).transpose(0, 2, 1)).reshape(n, entries)

    lifted = np.ascontiguousarray(
        values.view(np.uint8).reshape(n // PANEL_ROWS, PANEL_ROWS, k // 4, 4).transpose(0, 2, 1, 3)).reshape(n, k)
    lifted += np.uint8(32)  # six-bit values [-32, 31] as bytes [0, 63]
    return replace(w, values=lifted, scale=panels(w.scale), super_scale=panels(w.super_scale), layout="p8", x_bits=8)


def head_for(head, x_bits: int, tied: bool):
    """The LM head as products with x in `x_bits` read it fastest here: p8 where x is
    int8, the kernels read panels and the head is not also the embedding (whose lookups
    take rows); the row-major q8 otherwise. Host arrays in, host arrays out."""
    if x_bits == 8 and not tied and kernels_read_panels() and takes_panels(head):
        return as_panels(head)
    if x_bits != 8 and isinstance(head, QTensor) and head.layout == "p8":
        return replace(jax.tree.map(np.asarray, rows_of_panels(head)), x_bits=16)
    return head


def arranged(weights: dict, x_bits: int, tied: bool) -> dict:
    """weights with the head as head_for says, the other entries shared."""
    head = weights.get("lm_head")
    wanted = head_for(head, x_bits, tied)
    if wanted is head:
        return weights
    return {**weights, "lm_head": jax.device_put(wanted)}
