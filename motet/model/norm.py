"""Root-mean-square norms, alone or after the residual add before them.

On the CPU they are one native call each (kernels/norm.cc) where the kernels were built:
XLA:CPU runs a norm as four kernels and the add as a fifth, and each kernel is a thunk
every step runs and memory every compiled step holds (docs/performance.md). Elsewhere,
and for other dtypes, XLA computes them.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from . import native
from .sharding import TP

F32 = jnp.float32


def _xla_rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    x32 = x.astype(F32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps) * w).astype(x.dtype)


def _native_call(x: jax.Array, residual: jax.Array | None, w: jax.Array, eps: float):
    """(x + residual, or an empty array without one; the normed rows)."""
    summed = jax.ShapeDtypeStruct(x.shape if residual is not None else (0,), F32)
    call = jax.ffi.ffi_call(native.RMS_NORM, (summed, jax.ShapeDtypeStruct(x.shape, F32)))
    return call(x, jnp.zeros((0,), F32) if residual is None else residual, w, eps=np.float32(eps))


def _use_native(use_native: bool | None, *arrays) -> bool:
    return native.use_kernel(use_native, all(a.dtype == F32 for a in arrays), "rms norm")


def rms_norm(x: jax.Array, w: jax.Array, eps: float, use_native: bool | None = None) -> jax.Array:
    """x [..., d] over its last axis, times w [d]. use_native as qmatmul's."""
    xla = partial(_xla_rms_norm, eps=eps)
    if not _use_native(use_native, x, w):
        return xla(x, w)
    return jax.lax.platform_dependent(x, w, cpu=lambda x, w: _native_call(x, None, w, eps)[1], default=xla)


def add_rms_norm(x: jax.Array, y: jax.Array, w: jax.Array, eps: float,
                 use_native: bool | None = None) -> tuple[jax.Array, jax.Array]:
    """(x + y, its rms_norm): a residual add and the norm after it, in one call."""

    def xla(x, y, w):
        total = x + y
        return total, _xla_rms_norm(total, w, eps)

    if not _use_native(use_native, x, y, w):
        return xla(x, y, w)
    return jax.lax.platform_dependent(x, y, w, cpu=lambda x, y, w: _native_call(x, y, w, eps), default=xla)


def rms_norm_tp(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """rms_norm over a vector split along tp (this shard holds x's share of the channels):
    the shards' sums of squares are added (inside shard_map, in XLA)."""
    x32 = x.astype(F32)
    total = x.shape[-1] * jax.lax.psum(1, TP)
    ms = jax.lax.psum(jnp.sum(x32 * x32, axis=-1, keepdims=True), TP) / total
    return (x32 * jax.lax.rsqrt(ms + eps) * w).astype(x.dtype)
