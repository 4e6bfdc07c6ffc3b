"""GGUF's quantized blocks, repacked into quant.py's two layouts without changing a value.

Each function takes a tensor's raw bytes as uint8 [rows, bytes per row] and returns a
host QTensor [rows, columns]. The block formats are ggml's (see its `block_q4_K` and
friends): every scale is an f16, or an f16 times a small integer, so float32 holds it
exactly, and every value is a small integer, so int8 or a nibble holds it exactly.
Scales stay as the file keeps them: the simple types' f16s, and the K types' small
integers with their super-block's f16 (as float32) beside them; their products, in
float32, are what the kernels and the XLA path compute from them.
"""

from __future__ import annotations

import numpy as np

from .ggml_blocks import QK, QK_K, k_nibbles, k_scales, q5_values, q6_values
from .quant import QTensor


def _f16(raw: np.ndarray) -> np.ndarray:
    """Two bytes per row → float32 [n]."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _halves(raw: np.ndarray) -> np.ndarray:
    """Two bytes per row → the f16 they hold [n]."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0]


def _blocks(raw: np.ndarray, size: int) -> np.ndarray:
    rows, row_bytes = raw.shape
    return raw.reshape(rows, row_bytes // size, size)


def _nibble_pairs(values: np.ndarray) -> np.ndarray:
    """Values 0..15 [..., 32] → 16 bytes: value i low, value i + 16 high."""
    return (values[..., :16] | (values[..., 16:] << 4)).astype(np.uint8)


def q4_0(raw: np.ndarray) -> QTensor:
    b = _blocks(raw, 2 + QK // 2)
    d = _halves(b[..., 0:2])
    with np.errstate(over="ignore"):
        mins = -8 * d  # exact in f16 (a power of two), unless it overflows
    if not np.isfinite(mins[np.isfinite(d)]).all():
        d = d.astype(np.float32)
        mins = -8 * d
    return QTensor(np.ascontiguousarray(b[..., 2:]).reshape(len(raw), -1), d, mins, "q4", QK, "Q4_0")


def q4_1(raw: np.ndarray) -> QTensor:
    b = _blocks(raw, 4 + QK // 2)
    return QTensor(np.ascontiguousarray(b[..., 4:]).reshape(len(raw), -1), _halves(b[..., 0:2]),
                   _halves(b[..., 2:4]), "q4", QK, "Q4_1")


def q8_0(raw: np.ndarray) -> QTensor:
    b = _blocks(raw, 2 + QK)
    values = np.ascontiguousarray(b[..., 2:]).view(np.int8).reshape(len(raw), -1)
    return QTensor(values, _halves(b[..., 0:2]), None, "q8", QK, "Q8_0")


def _two_level(values, sc, d, mn, dmin, layout: str, block: int, source: str) -> QTensor:
    """A K type's values with its per-block integers [rows, supers, group] and per-super
    floats [rows, supers] (a min's negated: a weight is q · d · sc - dmin · mn)."""
    rows, supers, group = sc.shape
    return QTensor(values.reshape(rows, -1), np.ascontiguousarray(sc).reshape(rows, -1),
                   None if mn is None else np.ascontiguousarray(mn).reshape(rows, -1), layout, block, source,
                   d, None if dmin is None else -dmin, group)


def q4_k(raw: np.ndarray) -> QTensor:
    b = _blocks(raw, 4 + 12 + QK_K // 2)
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    sc, mn = k_scales(b[..., 4:16], np)
    return _two_level(_nibble_pairs(k_nibbles(b[..., 16:], np)), sc, d, mn, dmin, "q4", QK, "Q4_K")


def q5_k(raw: np.ndarray) -> QTensor:
    b = _blocks(raw, 4 + 12 + QK_K // 8 + QK_K // 2)
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    sc, mn = k_scales(b[..., 4:16], np)
    values = q5_values(b[..., 16:48], b[..., 48:], np)
    return _two_level(values.astype(np.int8), sc, d, mn, dmin, "q8", QK, "Q5_K")


def q6_k(raw: np.ndarray) -> QTensor:
    b = _blocks(raw, QK_K // 2 + QK_K // 4 + QK_K // 16 + 2)
    sc = np.ascontiguousarray(b[..., 192:208]).view(np.int8)
    d = _f16(b[..., 208:210])
    values = q6_values(b[..., 0:128], b[..., 128:192], np)  # [..., 2, 4, 32]
    return _two_level(values.astype(np.int8), sc, d, None, None, "q8", 16, "Q6_K")


REPACK = {"Q4_0": q4_0, "Q4_1": q4_1, "Q8_0": q8_0, "Q4_K": q4_k, "Q5_K": q5_k, "Q6_K": q6_k}
