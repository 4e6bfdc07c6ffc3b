"""Attention over the KV cache: a decode step's rows (one new token each) and a prefill
chunk, as XLA computations and as the native CPU kernels (kernels/attend_body.inc) that
replace them where they were built.

KV cache layout: per layer, K [slots, kv_heads, context / KEY_BLOCK, head_dim, KEY_BLOCK]
(kv_layout.py) and V [slots, kv_heads, context, head_dim]. Dimension letters as in
forward.py.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from . import kv_quant, native
from .kv_layout import KEY_BLOCK, keys_in_order

F32 = jnp.float32
# What the native kernels read a cache in: float32, or 16-bit floats widened as read, or
# an 8-bit cache (kv_quant.py) widened and scaled as read.
NATIVE_CACHE_DTYPES = (jnp.float32, jnp.float16, jnp.bfloat16)


# Cached history is read in blocks of this many positions, as many as a row needs: the
# loop's trip count is data, so one compiled step serves every context length.
ATTN_BLOCK = 256


def _native_cache(k_cache) -> bool:
    return kv_quant.quantized(k_cache) or any(k_cache.dtype == t for t in NATIVE_CACHE_DTYPES)


def _as_cached(k, v, k_cache):
    """The new rows (K and V [rows, kv_heads, head_dim]) as an 8-bit cache will hold them:
    every position is then read with the same values whether it is the step's own or
    history, so an answer does not depend on where chunks, prefix copies or sessions
    cut the prompt. The native kernels round them themselves: in XLA these few ops a
    layer made each compiled step hold several MB more."""
    if k_cache is None or not kv_quant.quantized(k_cache):
        return k, v
    kind = k_cache.kind
    return kv_quant.rounded(k, kind, axis=-1), kv_quant.rounded(v, kind, axis=-1)


def _cache_operands(k_cache, v_cache) -> tuple:
    """The native kernels' K, V and their scales (one float each under a float cache,
    which the kernels do not read)."""
    if kv_quant.quantized(k_cache):
        return k_cache.values, v_cache.values, k_cache.scales, v_cache.scales
    unread = jnp.zeros((1,), F32)
    return k_cache, v_cache, unread, unread


def _history_block(k_cache, v_cache, slot, j):
    """Block j of a slot's cache: K [k, d, ATTN_BLOCK], V [k, ATTN_BLOCK, d] (an 8-bit
    cache's widened to float32)."""
    _, nk, _, hd, _ = k_cache.shape
    start = j * ATTN_BLOCK

    def block(cache, at, size):
        return jax.lax.dynamic_slice(cache, (slot, *at), (1, *size))[0]

    def keys(cache):
        return keys_in_order(block(cache, (0, start // KEY_BLOCK, 0, 0), (nk, ATTN_BLOCK // KEY_BLOCK, hd, KEY_BLOCK)))

    if not kv_quant.quantized(k_cache):
        return start, keys(k_cache), block(v_cache, (0, start, 0), (nk, ATTN_BLOCK, hd))
    kb = kv_quant.dequantize(keys(k_cache.values),
                             block(k_cache.scales, (0, start), (nk, ATTN_BLOCK)), axis=1)
    vb = kv_quant.dequantize(block(v_cache.values, (0, start, 0), (nk, ATTN_BLOCK, hd)),
                             block(v_cache.scales, (0, start), (nk, ATTN_BLOCK)), axis=2)
    return start, kb, vb


def _whole_history(k_cache, v_cache, slots):
    """Every cached position of each slot in `slots`, K in order: K [b, k, d, l], V [b,
    k, l, d] (an 8-bit cache's widened to float32)."""
    if not kv_quant.quantized(k_cache):
        return keys_in_order(k_cache[slots]), v_cache[slots]
    return (kv_quant.dequantize(keys_in_order(k_cache.values[slots]), k_cache.scales[slots], axis=2),
            kv_quant.dequantize(v_cache.values[slots], v_cache.scales[slots], axis=3))


def _online_update(carry, s, vb, spec, dtype):
    """Fold one block of scores s [..., l] and values into a running softmax
    (max m, normaliser l, weighted sum acc), flash-attention style. The weights meet the
    values in the queries' dtype (a 16-bit cache under float32 queries is widened)."""
    m, l, acc = carry
    m_new = jnp.maximum(m, s.max(-1))
    p = jnp.exp(s - m_new[..., None])
    corr = jnp.exp(m - m_new)
    acc = acc * corr[..., None] + jnp.einsum(spec, p.astype(dtype), vb.astype(dtype), preferred_element_type=F32)
    return m_new, l * corr + p.sum(-1), acc


def attend_chunk(cfg, q, k, v, k_cache, v_cache, slot, offset, use_native: bool | None = None):
    """Causal attention of a chunk of t tokens at `offset`: over the slot's cached
    positions < offset (none when k_cache is None) and over the chunk itself.

    On the CPU, float32 operands go to the native kernel where it was built (XLA's dots,
    mask, softmax and copies here took a third of a prefill); use_native as attend_rows.
    """
    floats = q.dtype == F32 and (k_cache is None or _native_cache(k_cache))
    use_native = native.use_kernel(use_native, floats, "attention")
    history = k_cache is not None
    whole = partial(_attend_chunk_xla, cfg, whole=True)
    if not use_native:
        cpu = partial(_attend_chunk_xla, cfg, whole=False)
        return jax.lax.platform_dependent(q, k, v, k_cache, v_cache, slot, offset, cpu=cpu, default=whole)
    if not history:  # the kernel reads no cache; these stand in for it
        k_cache, v_cache = jnp.zeros((1,) * 5, F32), jnp.zeros((1,) * 4, F32)
    args = (q, k, v, k_cache, v_cache, slot, offset)
    return jax.lax.platform_dependent(
        *args, cpu=partial(_attend_chunk_native, cfg, history),
        default=lambda *a: whole(*a[:3], *(a[3:5] if history else (None, None)), *a[5:]))


def _attend_chunk_native(cfg, history: bool, q, k, v, k_cache, v_cache, slot, offset):
    t, nk, g, hd = q.shape[0], cfg.n_kv_heads, cfg.group_size, cfg.head_dim
    call = jax.ffi.ffi_call(native.ATTEND_CHUNK, jax.ShapeDtypeStruct((t, nk, g, hd), F32))
    scalar = partial(jnp.reshape, shape=(1,))
    out = call(q.reshape(t, nk, g, hd), k.transpose(1, 2, 0), v.transpose(1, 0, 2), *_cache_operands(k_cache, v_cache),
               scalar(jnp.asarray(slot, jnp.int32)), scalar(jnp.asarray(offset, jnp.int32)),
               scale=np.float32(hd**-0.5), has_history=np.int64(history))
    return out.reshape(t, -1)


def _attend_chunk_xla(cfg, q, k, v, k_cache, v_cache, slot, offset, whole: bool = False):
    """whole: the slot's whole cache at once, under a mask (off the CPU, see
    _attend_rows_whole); else block by block, as many blocks as the offset needs."""
    k, v = _as_cached(k, v, k_cache)
    t = q.shape[0]
    nk, g, hd = cfg.n_kv_heads, cfg.group_size, cfg.head_dim
    q = q.reshape(t, nk, g, hd).transpose(1, 2, 0, 3) * hd**-0.5  # [k, g, t, d]
    k, v = k.transpose(1, 0, 2), v.transpose(1, 0, 2)  # [k, t, d]
    s_self = jnp.einsum("kgtd,ksd->kgts", q, k, preferred_element_type=F32)
    s_self = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s_self, -jnp.inf)
    m = s_self.max(-1)
    p = jnp.exp(s_self - m[..., None])
    carry = (m, p.sum(-1), jnp.einsum("kgts,ksd->kgtd", p.astype(v.dtype), v, preferred_element_type=F32))
    if k_cache is not None and whole:
        kc, vc = (c[0] for c in _whole_history(k_cache, v_cache, jnp.reshape(slot, (1,))))
        s = jnp.einsum("kgtd,kdl->kgtl", q, kc, preferred_element_type=F32)
        s = jnp.where(jnp.arange(kc.shape[-1]) < offset, s, -jnp.inf)
        carry = _online_update(carry, s, vc, "kgtl,kld->kgtd", v.dtype)
    elif k_cache is not None:

        def block(j, carry):
            start, kb, vb = _history_block(k_cache, v_cache, slot, j)
            s = jnp.einsum("kgtd,kdl->kgtl", q, kb, preferred_element_type=F32)
            s = jnp.where(start + jnp.arange(ATTN_BLOCK) < offset, s, -jnp.inf)
            return _online_update(carry, s, vb, "kgtl,kld->kgtd", v.dtype)

        carry = jax.lax.fori_loop(0, (offset + ATTN_BLOCK - 1) // ATTN_BLOCK, block, carry)
    _, l, acc = carry
    out = (acc / l[..., None]).astype(v.dtype)
    return out.transpose(2, 0, 1, 3).reshape(t, -1)


def attend_rows(cfg, q, k, v, k_cache, v_cache, slots, positions, use_native: bool | None = None):
    """One new token per row b, at positions[b] of slot slots[b], over that slot's cached
    positions < positions[b].

    On the CPU, float32 queries over a float32 or 16-bit cache go to the native kernel
    (kernels/attend_body.inc) where it was built: XLA's loops below cost a third of a
    decode step there. use_native: None picks it where it applies; False forces the XLA
    loops (tests). Elsewhere each row reads its slot's whole cache (_attend_rows_whole).
    """
    use_native = native.use_kernel(use_native, _native_cache(k_cache) and q.dtype == F32, "attention")
    args = (q, k, v, k_cache, v_cache, slots, positions)
    cpu = partial(_attend_rows_native if use_native else _attend_rows_xla, cfg)
    return jax.lax.platform_dependent(*args, cpu=cpu, default=partial(_attend_rows_whole, cfg))


def _attend_rows_native(cfg, q, k, v, k_cache, v_cache, slots, positions):
    b, nk, g, hd = q.shape[0], cfg.n_kv_heads, cfg.group_size, cfg.head_dim
    call = jax.ffi.ffi_call(native.ATTEND_ROWS, jax.ShapeDtypeStruct((b, nk, g, hd), F32))
    out = call(q.reshape(b, nk, g, hd), k, v, *_cache_operands(k_cache, v_cache), slots.astype(jnp.int32),
               positions.astype(jnp.int32), scale=np.float32(hd**-0.5))
    return out.reshape(b, -1)


def _attend_rows_xla(cfg, q, k, v, k_cache, v_cache, slots, positions):
    """attend_rows as XLA loops over rows, each slicing its own slot block by block: a
    gather of all rows' histories at once ran 4x slower on XLA:CPU, which copies gathered
    operands first."""
    k, v = _as_cached(k, v, k_cache)
    b = q.shape[0]
    nk, g, hd = cfg.n_kv_heads, cfg.group_size, cfg.head_dim
    q = q.reshape(b, nk, g, hd) * hd**-0.5
    s_self = jnp.einsum("bkgd,bkd->bkg", q, k, preferred_element_type=F32)

    def row(i, out):
        def block(j, carry):
            start, kb, vb = _history_block(k_cache, v_cache, slots[i], j)
            s = jnp.einsum("kgd,kdl->kgl", q[i], kb, preferred_element_type=F32)
            s = jnp.where(start + jnp.arange(ATTN_BLOCK) < positions[i], s, -jnp.inf)
            return _online_update(carry, s, vb, "kgl,kld->kgd", v.dtype)

        own = (s_self[i], jnp.ones((nk, g), F32), jnp.broadcast_to(v[i][:, None, :], (nk, g, hd)).astype(F32))
        n_blocks = (positions[i] + ATTN_BLOCK - 1) // ATTN_BLOCK
        _, l, acc = jax.lax.fori_loop(0, n_blocks, block, own)
        return out.at[i].set((acc / l[..., None]).astype(v.dtype))

    out = jax.lax.fori_loop(0, b, row, jnp.zeros((b, nk, g, hd), v.dtype), unroll=2)
    return out.reshape(b, -1)


def _attend_rows_whole(cfg, q, k, v, k_cache, v_cache, slots, positions):
    """attend_rows off the CPU: each row reads its slot's whole cache at once, the
    positions past its own masked. The CPU's loops have data-dependent trip counts, which
    cost a device-to-host sync a trip on a GPU (measured on an H200: ~270 µs a layer, 3.2 of
    a 12-layer step's 3.8 ms)."""
    k, v = _as_cached(k, v, k_cache)
    b = q.shape[0]
    nk, g, hd = cfg.n_kv_heads, cfg.group_size, cfg.head_dim
    q = q.reshape(b, nk, g, hd) * hd**-0.5
    kc, vc = _whole_history(k_cache, v_cache, slots)
    s = jnp.einsum("bkgd,bkdl->bkgl", q, kc, preferred_element_type=F32)
    s = jnp.where(jnp.arange(kc.shape[-1]) < positions[:, None, None, None], s, -jnp.inf)
    s_self = jnp.einsum("bkgd,bkd->bkg", q, k, preferred_element_type=F32)
    m = jnp.maximum(s.max(-1), s_self)
    p, p_self = jnp.exp(s - m[..., None]), jnp.exp(s_self - m)
    acc = jnp.einsum("bkgl,bkld->bkgd", p.astype(v.dtype), vc.astype(v.dtype), preferred_element_type=F32)
    acc = acc + p_self[..., None] * v[:, :, None, :].astype(F32)
    out = acc / (p.sum(-1) + p_self)[..., None]
    return out.astype(v.dtype).reshape(b, -1)
