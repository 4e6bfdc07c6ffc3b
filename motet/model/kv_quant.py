"""A KV cache in 8 bits: int8, or fp8 (e4m3) as vLLM's `fp8` cache, with one float32
scale per position and KV head (the largest magnitude of its head_dim values over the
type's largest value).

A layer's cache is then a QuantizedCache in place of an array: the steps pass it through
unchanged (a pytree), attention widens a block of it as it reads (attention.py), and the
writes quantize the step's new float32 rows (kv_writes.py). A scale per position costs
4 bytes over head_dim values, and follows each position's own range, where a scale per
block of positions would be set by its largest one.

An fp8 cache is held as its bit patterns (uint8), converted only where a block is read
or new rows are written: XLA:CPU widens every fp8 operand of a scatter to a wider float,
so a step's write of a few rows converted the whole cache, twice (170 ms a step of the
default model at 2,000 positions, against 10 with int8).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from ..runtime.kv_format import SCALE_BYTES, SCALED_KV

F32 = jnp.float32
# the stored type and its largest magnitude, the scale's unit
_SCALED = {"int8": (jnp.int8, 127.0), "fp8": (jnp.uint8, 448.0)}
assert tuple(_SCALED) == SCALED_KV


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class QuantizedCache:
    """One layer's K or V: values K [slots, kv_heads, blocks, head_dim, KEY_BLOCK]
    (kv_layout.py) or V [slots, kv_heads, length, head_dim] (as the float caches; int8, or fp8's bit patterns as
    uint8), scales [slots, kv_heads, length]."""

    values: jax.Array | np.ndarray  # host arrays on their way to the device too
    scales: jax.Array | np.ndarray

    @property
    def shape(self) -> tuple[int, ...]:
        return self.values.shape

    @property
    def kind(self) -> str:
        return "int8" if self.values.dtype == jnp.int8 else "fp8"


def quantized(cache) -> bool:
    return isinstance(cache, QuantizedCache)


def zeros(kind: str, shape: tuple[int, ...], scale_shape: tuple[int, ...], fill) -> QuantizedCache:
    """A zeroed cache of `kind`; fill(shape, dtype) makes each of its arrays."""
    return QuantizedCache(fill(shape, _SCALED[kind][0]), fill(scale_shape, F32))


def quantize(x: jax.Array, kind: str, axis: int) -> tuple[jax.Array, jax.Array]:
    """float rows → (values, scales): one scale per vector along `axis` (head_dim),
    which the scales do not have."""
    dtype, top = _SCALED[kind]
    x = x.astype(F32)
    amax = jnp.max(jnp.abs(x), axis=axis, keepdims=True)
    scaled = x * jnp.where(amax > 0, top / jnp.where(amax > 0, amax, 1.0), 0.0)
    if kind == "int8":
        values = jnp.clip(jnp.round(scaled), -top, top).astype(dtype)
    else:
        values = jax.lax.bitcast_convert_type(scaled.astype(jnp.float8_e4m3fn), dtype)
    # times the reciprocal, as XLA's simplifier turns a division by a constant
    return values, jnp.squeeze(amax * np.float32(1 / top), axis)


def dequantize(values: jax.Array, scales: jax.Array, axis: int) -> jax.Array:
    """(values, scales) → float32; `axis` is head_dim's in `values`."""
    if values.dtype == jnp.uint8:
        values = jax.lax.bitcast_convert_type(values, jnp.float8_e4m3fn)
    return values.astype(F32) * jnp.expand_dims(scales, axis)


def rounded(x: jax.Array, kind: str, axis: int) -> jax.Array:
    """x as the cache gives it back: quantized and widened again, in x's dtype. The
    barrier keeps XLA:GPU from folding float32 → fp8 → float32 back into x (it drops such
    round trips where excess precision is allowed, its default; measured on an H200)."""
    values, scales = jax.lax.optimization_barrier(quantize(x, kind, axis))
    return dequantize(values, scales, axis % x.ndim).astype(x.dtype)


# ---- off the device (runtime/kv_format.py: a row is the values, then the scale) ---------


def pack_rows(values: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """values [t, k, d] (int8 or fp8), scales [t, k] float32 → uint8 rows [t, k, d + 4]."""
    scale_bytes = np.ascontiguousarray(scales, "<f4")[..., None].view(np.uint8)
    return np.concatenate([values.view(np.uint8), scale_bytes], axis=-1)


def unpack_rows(rows: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray]:
    """pack_rows undone: (values [t, k, d] as the device holds them, scales [t, k] float32)."""
    values = np.ascontiguousarray(rows[..., :-SCALE_BYTES]).view(np.dtype(_SCALED[kind][0]))
    scales = np.ascontiguousarray(rows[..., -SCALE_BYTES:]).view("<f4")[..., 0]
    return values, scales
