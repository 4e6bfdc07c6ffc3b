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

from .quant import QTensor

QK = 32  # values per block of the simple types
QK_K = 256  # values per super-block of the K types


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


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 six-bit (scale, min) pairs of a Q4_K / Q5_K super-block's 12 bytes, uint8."""
    p = packed.astype(np.uint8)
    low, high = p[..., 0:4], p[..., 4:8]
    scales = np.concatenate([low & 63, (p[..., 8:12] & 15) | ((low >> 6) << 4)], axis=-1)
    mins = np.concatenate([high & 63, (p[..., 8:12] >> 4) | ((high >> 6) << 4)], axis=-1)
    return scales, mins


def _two_level(values, sc, d, mn, dmin, layout: str, block: int, source: str) -> QTensor:
    """A K type's values with its per-block integers [rows, supers, group] and per-super
    floats [rows, supers] (a min's negated: a weight is q · d · sc - dmin · mn)."""
    rows, supers, group = sc.shape
    return QTensor(values.reshape(rows, -1), np.ascontiguousarray(sc).reshape(rows, -1),
                   None if mn is None else np.ascontiguousarray(mn).reshape(rows, -1), layout, block, source,
                   d, None if dmin is None else -dmin, group)


def _k_nibbles(qs: np.ndarray) -> np.ndarray:
    """128 bytes → 256 values: each 32 bytes give 32 values (low nibbles), then 32 more
    (high nibbles)."""
    q = qs.reshape(*qs.shape[:-1], 4, 32)
    return np.stack([q & 15, q >> 4], axis=-2).reshape(*qs.shape[:-1], QK_K)


def q4_k(raw: np.ndarray) -> QTensor:
    b = _blocks(raw, 4 + 12 + QK_K // 2)
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    sc, mn = _k_scales(b[..., 4:16])
    values = _k_nibbles(b[..., 16:]).reshape(*b.shape[:-1], 8, QK)
    return _two_level(_nibble_pairs(values), sc, d, mn, dmin, "q4", QK, "Q4_K")


def q5_k(raw: np.ndarray) -> QTensor:
    b = _blocks(raw, 4 + 12 + QK_K // 8 + QK_K // 2)
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    sc, mn = _k_scales(b[..., 4:16])
    qh = b[..., 16:48]
    # sub-block j takes bit j of each of the 32 high-bit bytes
    high = np.stack([(qh >> j) & 1 for j in range(8)], axis=-2)  # [..., 8, 32]
    values = _k_nibbles(b[..., 48:]).reshape(*b.shape[:-1], 8, QK) + (high << 4)
    return _two_level(values.astype(np.int8), sc, d, mn, dmin, "q8", QK, "Q5_K")


def q6_k(raw: np.ndarray) -> QTensor:
    b = _blocks(raw, QK_K // 2 + QK_K // 4 + QK_K // 16 + 2)
    ql, qh = b[..., 0:128].reshape(*b.shape[:-1], 2, 64), b[..., 128:192].reshape(*b.shape[:-1], 2, 32)
    sc = np.ascontiguousarray(b[..., 192:208]).view(np.int8)
    d = _f16(b[..., 208:210])
    # each half of 128 values: four runs of 32, from the low or high nibbles of ql's two
    # halves and two bits of qh each
    runs = [(ql[..., :32] & 15) | ((qh & 3) << 4),
            (ql[..., 32:] & 15) | (((qh >> 2) & 3) << 4),
            (ql[..., :32] >> 4) | (((qh >> 4) & 3) << 4),
            (ql[..., 32:] >> 4) | (((qh >> 6) & 3) << 4)]
    values = np.stack(runs, axis=-2).astype(np.int16) - 32  # [..., 2, 4, 32]
    return _two_level(values.astype(np.int8), sc, d, None, None, "q8", 16, "Q6_K")


REPACK = {"Q4_0": q4_0, "Q4_1": q4_1, "Q8_0": q8_0, "Q4_K": q4_k, "Q5_K": q5_k, "Q6_K": q6_k}
