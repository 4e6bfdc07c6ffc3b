"""The forward pass in per-layer pieces, for tiered experts: the host maps each MoE
layer's routed experts to slots of a device pool between the pieces.

The one-jit step (forward.py) cannot do that: the experts a layer needs are known only
once its router has run, and loading a missing one is host work. So a step here is a
loop on the host over jitted pieces that reuse forward.py's and moe.py's own functions
(the same numerics; only the order of a few float additions differs):

  embed → per layer: [attention + router (+ the next MoE layer's router applied to the
  same hidden state: a guess at its experts, for prefetch)] → host: experts → pool slots
  → [MoE over the pool] ... → head.

A dense layer runs whole in one piece. Every piece's shapes depend only on the config,
the batch/chunk bucket and the pool size, so one compile serves every layer.

Dimension letters as in forward.py; c pool slots.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from .forward import attend_chunk, attend_rows, embed, lm_head, qkv, rms_norm
from .moe import dense_ffn, experts_grouped, experts_ragged, group_block, route

EXPERT_KEYS = ("experts_gate_up", "experts_down")


def shared_weight_bytes(weights: dict) -> int:
    """Bytes of the weights that are not experts (always on the device)."""
    top = sum(leaf.nbytes for key, leaf in weights.items() if key != "layers")
    return top + sum(leaf.nbytes for layer in weights["layers"] for key, leaf in layer.items()
                     if key not in EXPERT_KEYS)


def shared_weights(layer: dict) -> dict:
    """A layer's weights without its experts: what the attention/router piece reads."""
    return {k: v for k, v in layer.items() if k not in EXPERT_KEYS}


def _guess(cfg, x, nxt):
    """The next MoE layer's router applied to this layer's hidden state: [t, k] ids (or
    None). Its top-k is a cheap, often right guess of the experts that layer will pick."""
    if nxt is None:
        return None
    h = rms_norm(x, nxt["ffn_norm"], cfg.rms_eps)
    return jax.lax.top_k(jnp.dot(h.astype(jnp.float32), nxt["router"]), cfg.n_experts_per_tok)[1]


def _after_attention(cfg, layer, x, out, nxt):
    """Residual add, then for a MoE layer its routing (and the guess for the next one),
    for a dense layer its FFN."""
    x = x + jnp.dot(out, layer["wo"])
    h = rms_norm(x, layer["ffn_norm"], cfg.rms_eps)
    if "router" not in layer:
        return x + dense_ffn(layer, h), None, None, None, None
    w, ids = route(cfg, layer["router"], h)
    return x, h, w, ids, _guess(cfg, x, nxt)


@partial(jax.jit, static_argnames=("cfg",))
def layer_rows(cfg, layer, nxt, x, k_cache, v_cache, slots, positions):
    """One layer's attention (decode rows, as forward.decode) and its routing, or the
    whole layer when it is dense. Returns (x, h, weights, ids, guess, new K [b, k, d],
    new V [b, k, d]); h, weights, ids and guess are None for a dense layer."""
    q, k, v = qkv(cfg, layer, rms_norm(x, layer["attn_norm"], cfg.rms_eps), positions)
    out = attend_rows(cfg, q, k, v, k_cache, v_cache, slots, positions)
    return (*_after_attention(cfg, layer, x, out, nxt), k, v)


@partial(jax.jit, static_argnames=("cfg", "with_history"))
def layer_chunk(cfg, layer, nxt, x, k_cache, v_cache, slot, offset, *, with_history):
    """The same for a prefill chunk (as forward.prefill); new K [k, d, t], V [k, t, d]."""
    positions = offset + jnp.arange(x.shape[0])
    q, k, v = qkv(cfg, layer, rms_norm(x, layer["attn_norm"], cfg.rms_eps), positions)
    if with_history:
        out = attend_chunk(cfg, q, k, v, k_cache, v_cache, slot, offset)
    else:
        out = attend_chunk(cfg, q, k, v, None, None, slot, offset)
    return (*_after_attention(cfg, layer, x, out, nxt), k.transpose(1, 2, 0), v.transpose(1, 0, 2))


@partial(jax.jit, static_argnames=("impl",))
def moe_over_pool(x, h, w, mask, slot_ids, pool_gate_up, pool_down, *, impl):
    """x + the MoE output, the experts read from the pool by slot ids [t, k]. Only the
    assignments where mask [t, k] is 1 count: padding rows, and in a layer run in several
    passes the experts of the other passes, are masked out."""
    w = w * mask
    if impl == "ragged":
        return x + experts_ragged(h, w, slot_ids, pool_gate_up, pool_down)
    block = group_block(slot_ids.size, pool_gate_up.shape[0])
    return x + experts_grouped(h, w, slot_ids, pool_gate_up, pool_down, block)


@partial(jax.jit, donate_argnums=(0, 1))
def put_experts(pool_gate_up, pool_down, slots, gate_up, down):
    """Write experts gate_up [n, d, 2f], down [n, f, d] into pool slots [n] (in place).
    A loop of dynamic_update_slice: a scatter would copy the pool on XLA:CPU."""

    def one(i, pools):
        gu, dn = pools
        gu = jax.lax.dynamic_update_slice(gu, gate_up[i][None], (slots[i], 0, 0))
        dn = jax.lax.dynamic_update_slice(dn, down[i][None], (slots[i], 0, 0))
        return gu, dn

    return jax.lax.fori_loop(0, slots.shape[0], one, (pool_gate_up, pool_down))


@jax.jit
def take_experts(pool_gate_up, pool_down, slots):
    """Copies of the experts in pool slots [n] (an eviction back to host RAM), sliced
    one by one: a gather would copy the whole pool first on XLA:CPU."""
    n, (_, d, f2) = slots.shape[0], pool_gate_up.shape

    def one(i, out):
        gu, dn = out
        gu = gu.at[i].set(jax.lax.dynamic_slice(pool_gate_up, (slots[i], 0, 0), (1, d, f2))[0])
        dn = dn.at[i].set(jax.lax.dynamic_slice(pool_down, (slots[i], 0, 0), (1, f2 // 2, d))[0])
        return gu, dn

    init = (jnp.zeros((n, d, f2), pool_gate_up.dtype), jnp.zeros((n, f2 // 2, d), pool_down.dtype))
    return jax.lax.fori_loop(0, n, one, init)


@jax.jit
def embed_tokens(weights, tokens):
    return embed(weights, tokens)


@partial(jax.jit, static_argnames=("cfg",))
def head(cfg, weights, x):
    return lm_head(cfg, weights, x)


def top_weights(weights: dict) -> dict:
    """The non-layer weights (embedding, final norm, LM head): what embed and head read."""
    return {k: v for k, v in weights.items() if k != "layers"}
