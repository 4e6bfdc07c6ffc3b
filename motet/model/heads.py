"""A layer's QKV projection made heads: split into queries, keys and values, q and k
normed where the model norms them (per head, or over all heads at once), then turned by
their positions (rotary embeddings, the half-split convention: in each head, value i
turns with value i + d/2).

On the CPU this is one native call (kernels/norm_rope.cc) where the kernels were built:
XLA:CPU runs the split and the rotation as four kernels, and each norm as four more,
every kernel a thunk each step runs and memory each compiled step holds
(docs/performance.md). Elsewhere, for other dtypes, and for norms over heads split
across a tp mesh (their sums added across it), XLA computes them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from . import native
from .config import ModelConfig
from .norm import rms_norm, rms_norm_tp

F32 = jnp.float32
# cfg.qk_norm as the kernel's attribute
HEAD_NORMS = {"none": 0, "head": 1, "full": 2}


def inverse_frequencies(head_dim: int, theta: float) -> np.ndarray:
    """The angle per position of each pair of a head's values, float32 [head_dim / 2]."""
    return 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """x [t, heads, d] turned by positions [t], in XLA."""
    half = x.shape[-1] // 2
    angles = positions.astype(F32)[:, None] * inverse_frequencies(2 * half, theta)  # [t, d/2]
    cos, sin = jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]
    x1, x2 = x[..., :half].astype(F32), x[..., half:].astype(F32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def _xla_heads(cfg: ModelConfig, proj, positions, q_norm, k_norm, split_over_tp: bool):
    hd, nq, nk = cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
    q, k, v = jnp.split(proj, [nq * hd, (nq + nk) * hd], axis=-1)
    if cfg.qk_norm == "full":
        norm = rms_norm_tp if split_over_tp else rms_norm
        q, k = norm(q, q_norm, cfg.rms_eps), norm(k, k_norm, cfg.rms_eps)
    q, k, v = (a.reshape(a.shape[0], -1, hd) for a in (q, k, v))
    if cfg.qk_norm == "head":
        q, k = rms_norm(q, q_norm, cfg.rms_eps), rms_norm(k, k_norm, cfg.rms_eps)
    return rope(q, positions, cfg.rope_theta), rope(k, positions, cfg.rope_theta), v


def qkv_heads(cfg: ModelConfig, proj: jax.Array, positions: jax.Array, q_norm=None, k_norm=None,
              split_over_tp: bool = False, use_native: bool | None = None):
    """proj [t, (heads + 2 · KV heads) · head_dim] → q [t, heads, d], k and v [t, KV
    heads, d], for the heads cfg counts (on a tp mesh, this shard's). q_norm, k_norm:
    the norms' weights where cfg.qk_norm asks for them. use_native as qmatmul's."""
    hd, nq, nk = cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
    norms = () if cfg.qk_norm == "none" else (q_norm, k_norm)
    applies = all(a.dtype == F32 for a in (proj, *norms)) and not (cfg.qk_norm == "full" and split_over_tp)

    def xla(proj, positions, *norms):
        return _xla_heads(cfg, proj, positions, *(norms or (None, None)), split_over_tp)

    def kernel(proj, positions, *norms):
        t = proj.shape[0]
        shapes = [jax.ShapeDtypeStruct((t, n, hd), F32) for n in (nq, nk, nk)]
        empty = jnp.zeros((0,), F32)
        return tuple(jax.ffi.ffi_call(native.QKV_HEADS, shapes)(
            proj, positions.astype(jnp.int32), jnp.asarray(inverse_frequencies(hd, cfg.rope_theta)),
            *(norms or (empty, empty)), q_heads=np.int64(nq), kv_heads=np.int64(nk),
            norm=np.int64(HEAD_NORMS[cfg.qk_norm]), eps=np.float32(cfg.rms_eps)))

    if not native.use_kernel(use_native, applies, "QKV heads"):
        return xla(proj, positions, *norms)
    return jax.lax.platform_dependent(proj, positions, *norms, cpu=kernel, default=xla)
