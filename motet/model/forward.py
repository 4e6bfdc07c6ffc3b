"""The forward pass as pure functions of (config, weights, inputs, KV cache).

KV cache: per layer, K [slots, kv_heads, head_dim, context] and V [slots, kv_heads,
context, head_dim]. Head-major avoids a per-step transpose; K stored transposed makes
q·K a plain matmul over contiguous rows, the fastest form measured on XLA:CPU. The step functions only *read* the
cache and return the new rows; separate donated functions write them. Reading and
writing the same donated array in one step makes XLA copy the whole cache.

Dimension letters: t tokens, b batch rows, h query heads, k KV heads, g query heads per
KV head, d head dim, l cached positions.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from .config import ModelConfig
from .moe import dense_ffn, moe_ffn

F32 = jnp.float32


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    x32 = x.astype(F32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps) * w).astype(
        x.dtype
    )


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotary embedding, half-split convention; x [t, heads, d], positions [t]."""
    half = x.shape[-1] // 2
    inv_freq = 1.0 / (theta ** (np.arange(0, 2 * half, 2, dtype=np.float32) / (2 * half)))
    angles = positions.astype(F32)[:, None] * inv_freq  # [t, d/2]
    cos, sin = jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]
    x1, x2 = x[..., :half].astype(F32), x[..., half:].astype(F32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def qkv(cfg: ModelConfig, layer: dict, x: jax.Array, positions: jax.Array):
    """Normed, rotated q [t, h, d], k [t, k, d] and v [t, k, d] for the tokens x [t, model]."""
    hd, nq, nk = cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
    proj = jnp.dot(x, layer["wqkv"])
    q, k, v = jnp.split(proj, [nq * hd, (nq + nk) * hd], axis=-1)
    if cfg.qk_norm == "full":
        q = rms_norm(q, layer["q_norm"], cfg.rms_eps)
        k = rms_norm(k, layer["k_norm"], cfg.rms_eps)
    q, k, v = (a.reshape(a.shape[0], -1, hd) for a in (q, k, v))
    if cfg.qk_norm == "head":
        q = rms_norm(q, layer["q_norm"], cfg.rms_eps)
        k = rms_norm(k, layer["k_norm"], cfg.rms_eps)
    return rope(q, positions, cfg.rope_theta), rope(k, positions, cfg.rope_theta), v


def _softmax_parts(*scores):
    """Softmax over the concatenation of score blocks, returned split the same way."""
    m = jnp.max(scores[0], axis=-1, keepdims=True)
    for s in scores[1:]:
        m = jnp.maximum(m, jnp.max(s, axis=-1, keepdims=True))
    exps = [jnp.exp(s - m) for s in scores]
    total = sum(jnp.sum(e, axis=-1, keepdims=True) for e in exps)
    return [e / total for e in exps]


def attend_chunk(cfg, q, k, v, hist_k, hist_v, offset):
    """Causal attention of a chunk of t tokens at `offset` over the slot's cached history
    (positions < offset of hist_k [k, d, l] and hist_v [k, l, d], or none) and over the
    chunk itself."""
    t = q.shape[0]
    scale = cfg.head_dim**-0.5
    q = q.reshape(t, cfg.n_kv_heads, cfg.group_size, cfg.head_dim).transpose(1, 2, 0, 3)
    k, v = k.transpose(1, 0, 2), v.transpose(1, 0, 2)  # [k, t, d]
    s_self = jnp.einsum("kgtd,ksd->kgts", q, k, preferred_element_type=F32) * scale
    s_self = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s_self, -jnp.inf)
    if hist_k is None:
        (p_self,) = _softmax_parts(s_self)
        out = jnp.einsum("kgts,ksd->kgtd", p_self.astype(v.dtype), v)
    else:
        s_hist = jnp.einsum("kgtd,kdl->kgtl", q, hist_k, preferred_element_type=F32) * scale
        s_hist = jnp.where(jnp.arange(hist_k.shape[2]) < offset, s_hist, -jnp.inf)
        p_hist, p_self = _softmax_parts(s_hist, s_self)
        out = jnp.einsum("kgtl,kld->kgtd", p_hist.astype(v.dtype), hist_v) + jnp.einsum(
            "kgts,ksd->kgtd", p_self.astype(v.dtype), v
        )
    return out.transpose(2, 0, 1, 3).reshape(t, -1)


def attend_rows(cfg, q, k, v, k_cache, v_cache, slots, positions, hist_len):
    """One new token per row b, at positions[b] of slot slots[b], over that slot's first
    hist_len cached positions (K [slots, k, d, l], V [slots, k, l, d]).

    A loop over rows, each slicing its own slot: a gather of all rows' histories at once
    ran 4x slower on XLA:CPU, which copies gathered operands before the matmul.
    """
    b = q.shape[0]
    nk, g, hd = cfg.n_kv_heads, cfg.group_size, cfg.head_dim
    q = q.reshape(b, nk, g, hd) * hd**-0.5
    s_self = jnp.einsum("bkgd,bkd->bkg", q, k, preferred_element_type=F32)[..., None]

    def row(i, out):
        hist_k = jax.lax.dynamic_slice(k_cache, (slots[i], 0, 0, 0), (1, nk, hd, hist_len))[0]
        hist_v = jax.lax.dynamic_slice(v_cache, (slots[i], 0, 0, 0), (1, nk, hist_len, hd))[0]
        s_hist = jnp.einsum("kgd,kdl->kgl", q[i], hist_k, preferred_element_type=F32)
        s_hist = jnp.where(jnp.arange(hist_len) < positions[i], s_hist, -jnp.inf)
        p_hist, p_self = _softmax_parts(s_hist, s_self[i])
        o = jnp.einsum("kgl,kld->kgd", p_hist.astype(v.dtype), hist_v)
        return out.at[i].set(o + p_self.astype(v.dtype) * v[i][:, None, :])

    out = jax.lax.fori_loop(0, b, row, jnp.zeros((b, nk, g, hd), v.dtype), unroll=2)
    return out.reshape(b, -1)


def ffn(cfg: ModelConfig, layer: dict, x: jax.Array, moe_impl: str):
    """(output, chosen expert ids [t, k] or None for a dense layer)."""
    if "router" in layer:
        return moe_ffn(cfg, layer, x, moe_impl)
    return dense_ffn(layer, x), None


def lm_head(cfg: ModelConfig, weights: dict, x: jax.Array) -> jax.Array:
    x = rms_norm(x, weights["final_norm"], cfg.rms_eps)
    return jnp.dot(x, weights["lm_head"], preferred_element_type=F32)


def embed(weights: dict, tokens: jax.Array) -> jax.Array:
    if "embed" in weights:
        return weights["embed"][tokens]
    return weights["lm_head"][:, tokens].T  # tied: a column per token


def _layers(cfg, weights, x, positions, attend, moe_impl):
    """Run every layer; attend(i, q, k, v) is the attention for layer i. Returns the final
    hidden states, each layer's new K and V rows, and each MoE layer's expert ids."""
    new_k, new_v, routing = [], [], []
    for i, layer in enumerate(weights["layers"]):
        q, k, v = qkv(cfg, layer, rms_norm(x, layer["attn_norm"], cfg.rms_eps), positions)
        new_k.append(k)
        new_v.append(v)
        x = x + jnp.dot(attend(i, q, k, v), layer["wo"])
        y, ids = ffn(cfg, layer, rms_norm(x, layer["ffn_norm"], cfg.rms_eps), moe_impl)
        x = x + y
        if ids is not None:
            routing.append(ids)
    return x, new_k, new_v, routing


@partial(jax.jit, static_argnames=("cfg", "hist_len", "all_logits", "moe_impl"))
def prefill(
    weights, k_cache, v_cache, tokens, slot, offset, n_valid, *, cfg, hist_len,
    all_logits=False, moe_impl="auto",
):
    """Prefill a chunk of tokens [t] (the first n_valid real, the rest padding) into `slot`
    at position `offset`, attending to the slot's first `offset` cached positions
    (hist_len ≥ offset, static; 0 for a fresh slot).

    Returns (logits [t, vocab] if all_logits else [vocab] of the last real token,
    new K per layer [k, d, t], new V per layer [k, t, d], expert ids per MoE layer [t, k]).
    """
    positions = offset + jnp.arange(tokens.shape[0])
    x = embed(weights, tokens)

    def attend(i, q, k, v):
        if hist_len == 0:
            return attend_chunk(cfg, q, k, v, None, None, offset)
        nk, hd = cfg.n_kv_heads, cfg.head_dim
        hist_k = jax.lax.dynamic_slice(k_cache[i], (slot, 0, 0, 0), (1, nk, hd, hist_len))[0]
        hist_v = jax.lax.dynamic_slice(v_cache[i], (slot, 0, 0, 0), (1, nk, hist_len, hd))[0]
        return attend_chunk(cfg, q, k, v, hist_k, hist_v, offset)

    x, new_k, new_v, routing = _layers(cfg, weights, x, positions, attend, moe_impl)
    if not all_logits:
        x = jax.lax.dynamic_slice_in_dim(x, n_valid - 1, 1)
    logits = lm_head(cfg, weights, x)
    new_k = [k.transpose(1, 2, 0) for k in new_k]
    new_v = [v.transpose(1, 0, 2) for v in new_v]
    return (logits if all_logits else logits[0]), new_k, new_v, routing


@partial(jax.jit, static_argnames=("cfg", "hist_len", "moe_impl"))
def decode(weights, k_cache, v_cache, tokens, slots, positions, *, cfg, hist_len, moe_impl="auto"):
    """One decode step for rows b: token tokens[b] at positions[b] in slot slots[b],
    attending to that slot's cached positions < positions[b] (hist_len > every position).

    Returns (logits [b, vocab], new K rows per layer [b, k, d], new V rows per layer,
    expert ids per MoE layer [b, k]).
    """
    x = embed(weights, tokens)

    def attend(i, q, k, v):
        return attend_rows(cfg, q, k, v, k_cache[i], v_cache[i], slots, positions, hist_len)

    x, new_k, new_v, routing = _layers(cfg, weights, x, positions, attend, moe_impl)
    return lm_head(cfg, weights, x), new_k, new_v, routing


@partial(jax.jit, donate_argnums=(0, 1))
def write_chunk(k_cache, v_cache, new_k, new_v, slot, offset):
    """Store a prefilled chunk (K [k, d, t], V [k, t, d]) at `offset` in `slot` (in place)."""

    def put(cache, rows, start):
        return jax.lax.dynamic_update_slice(cache, rows[None].astype(cache.dtype), start)

    return (
        [put(c, r, (slot, 0, 0, offset)) for c, r in zip(k_cache, new_k)],
        [put(c, r, (slot, 0, offset, 0)) for c, r in zip(v_cache, new_v)],
    )


@partial(jax.jit, donate_argnums=(0, 1))
def write_rows(k_cache, v_cache, new_k, new_v, slots, positions):
    """Store each decode row's K/V [b, k, d] at (slots[b], positions[b]) (in place)."""

    return (
        [c.at[slots, :, :, positions].set(r.astype(c.dtype)) for c, r in zip(k_cache, new_k)],
        [c.at[slots, :, positions].set(r.astype(c.dtype)) for c, r in zip(v_cache, new_v)],
    )
