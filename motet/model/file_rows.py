"""An embedding read from the model file's own bytes.

A step reads a few rows of the embedding, never the whole of it, so a GGUF file's
quantized embedding is not repacked (gguf_quants.py) into memory of its own: it stays the
file's blocks, a device array over the file's read-only mapping (XLA:CPU takes an aligned
numpy array without copying it), and only the pages of the rows read count in the
process's resident set, as they do for llama.cpp, which maps the file. The MoE Q8_0
benchmark file's embedding is 26.7 MB; a Qwen3-30B-A3B Q4_K_M file's is about 175 MB.

A lookup gathers the rows' bytes and unpacks them in the jitted step, to the floats the
repacked form gives bit for bit: the same small integers times the same float32 scales,
plus the same mins (quant.dequantize's arithmetic).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from .ggml_blocks import QK, QK_K, k_nibbles, k_scales, q5_values, q6_values

F32 = jnp.float32


# XLA:CPU shares an array's memory only from a 64-byte boundary; a GGUF file aligns its
# tensors to 32 bytes, so a tensor's bytes are held from the boundary at or before it.
ALIGN = 64


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class FileRows:
    data: jax.Array | np.ndarray  # uint8 [skip + rows · row_bytes]: the file's blocks, flat
    source: str = field(metadata=dict(static=True))  # the file's type: "Q8_0", "Q4_K", ...
    rows: int = field(metadata=dict(static=True))
    columns: int = field(metadata=dict(static=True))
    skip: int = field(default=0, metadata=dict(static=True))  # bytes before the first row

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.columns)

    @property
    def dtype(self):
        return np.dtype(np.float32)

    @property
    def row_bytes(self) -> int:
        return (self.data.shape[0] - self.skip) // self.rows

    @property
    def nbytes(self) -> int:
        return self.rows * self.row_bytes


def over(mapping: np.ndarray, tensor_bytes: np.ndarray, source: str, columns: int) -> FileRows:
    """FileRows of a tensor whose bytes [rows, row_bytes] lie in `mapping` (uint8, flat),
    held from the ALIGN boundary at or before them."""
    start = tensor_bytes.ctypes.data - mapping.ctypes.data
    skip = min(tensor_bytes.ctypes.data % ALIGN, start)
    return FileRows(mapping[start - skip:start + tensor_bytes.nbytes], source, tensor_bytes.shape[0], columns, skip)


def _halves(pair: jax.Array) -> jax.Array:
    """Two bytes [..., 2] → the f16 they hold, as float32 (exact)."""
    return jax.lax.bitcast_convert_type(pair, jnp.float16).astype(F32)


def _blocks(raw: jax.Array, size: int) -> jax.Array:
    return raw.reshape(raw.shape[0], -1, size)


def _nibbles(packed: jax.Array) -> jax.Array:
    """16 bytes → 32 values: the low nibbles, then the high ones."""
    return jnp.concatenate([packed & 15, packed >> 4], axis=-1)


def _q4_0(raw):
    b = _blocks(raw, 2 + QK // 2)
    d = _halves(b[..., 0:2])
    return _nibbles(b[..., 2:]).astype(F32) * d[..., None] + (-8 * d)[..., None]


def _q4_1(raw):
    b = _blocks(raw, 4 + QK // 2)
    return _nibbles(b[..., 4:]).astype(F32) * _halves(b[..., 0:2])[..., None] + _halves(b[..., 2:4])[..., None]


def _q8_0(raw):
    b = _blocks(raw, 2 + QK)
    return jax.lax.bitcast_convert_type(b[..., 2:], jnp.int8).astype(F32) * _halves(b[..., 0:2])[..., None]


def _k_values(q, sc, d, mn, dmin):
    """q [..., 8, 32] · (sc · d) + mn · -dmin, per run of 32, as quant.dequantize computes it."""
    scale = sc.astype(F32) * d[..., None]
    mins = mn.astype(F32) * -dmin[..., None]
    return q.astype(F32) * scale[..., None] + mins[..., None]


def _q4_k(raw):
    b = _blocks(raw, 4 + 12 + QK_K // 2)
    sc, mn = k_scales(b[..., 4:16], jnp)
    return _k_values(k_nibbles(b[..., 16:], jnp), sc, _halves(b[..., 0:2]), mn, _halves(b[..., 2:4]))


def _q5_k(raw):
    b = _blocks(raw, 4 + 12 + QK_K // 8 + QK_K // 2)
    sc, mn = k_scales(b[..., 4:16], jnp)
    q = q5_values(b[..., 16:48], b[..., 48:], jnp)
    return _k_values(q, sc, _halves(b[..., 0:2]), mn, _halves(b[..., 2:4]))


def _q6_k(raw):
    b = _blocks(raw, QK_K // 2 + QK_K // 4 + QK_K // 16 + 2)
    sc = jax.lax.bitcast_convert_type(b[..., 192:208], jnp.int8).astype(F32)  # a scale per 16 values
    d = _halves(b[..., 208:210])
    q = q6_values(b[..., 0:128], b[..., 128:192], jnp).reshape(*b.shape[:-1], 16, 16)
    return q.astype(F32) * (sc * d[..., None])[..., None]


UNPACK = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q8_0": _q8_0, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}


def take(w: FileRows, rows: jax.Array) -> jax.Array:
    """Rows `rows` of the matrix as float32 [len(rows), columns], inside jitted code."""
    rows = jnp.asarray(rows, jnp.int32).reshape(-1)
    at = w.skip + rows[:, None] * w.row_bytes + jnp.arange(w.row_bytes, dtype=jnp.int32)
    raw = jnp.asarray(w.data)[at]
    return UNPACK[w.source](raw).reshape(rows.shape[0], w.columns)
