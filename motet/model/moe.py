"""Mixture-of-experts FFN: route each token to its top-k experts and run only those.

Dimension letters: t tokens, k experts per token, d model width, f expert width,
e experts, n blocks of sorted assignments, b rows in a block.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .config import ModelConfig


def route(cfg: ModelConfig, router: jax.Array, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(weights [t, k], expert ids [t, k]): softmax over all experts, top-k, optionally renormalised."""
    logits = jnp.dot(x.astype(jnp.float32), router)  # [t, e]
    probs = jax.nn.softmax(logits, axis=-1)
    top_p, top_i = jax.lax.top_k(probs, cfg.n_experts_per_tok)
    if cfg.norm_topk_prob:
        top_p = top_p / jnp.sum(top_p, axis=-1, keepdims=True)
    return top_p, top_i


def swiglu(h: jax.Array) -> jax.Array:
    gate, up = jnp.split(h, 2, axis=-1)
    return jax.nn.silu(gate) * up


def experts_gathered(x, weights, ids, gate_up, down):
    """Few assignments (decode): gather each assignment's expert matrices and multiply.

    Reads only the chosen experts' weights; best while t·k is below the expert count.
    """
    h = jnp.einsum("td,tkdf->tkf", x, jnp.take(gate_up, ids, axis=0))
    y = jnp.einsum("tkf,tkfd->tkd", swiglu(h), jnp.take(down, ids, axis=0))
    return jnp.einsum("tkd,tk->td", y, weights.astype(y.dtype))


def _sorted_assignments(ids: jax.Array, n_experts: int):
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sorted_experts = flat[order]
    group_sizes = jnp.bincount(flat, length=n_experts)
    return order, sorted_experts, group_sizes


def experts_blocked(x, weights, ids, gate_up, down, block: int):
    """Many assignments (prefill): sort them by expert, pad each expert's group to whole
    blocks of `block` rows, and run one batched matmul over the blocks, each block with
    its own expert's weights. Pads at most `block - 1` rows per expert, drops nothing.
    """
    t, k = ids.shape
    n_experts = gate_up.shape[0]
    order, sorted_experts, sizes = _sorted_assignments(ids, n_experts)
    padded = (sizes + block - 1) // block * block
    padded_start = jnp.cumsum(padded) - padded
    start = jnp.cumsum(sizes) - sizes
    rank = jnp.arange(t * k) - start[sorted_experts]
    dest = padded_start[sorted_experts] + rank  # row of each sorted assignment in the blocks
    n_blocks = -(-(t * k + n_experts * (block - 1)) // block)
    token = order // k
    rows = jnp.zeros((n_blocks * block, x.shape[1]), x.dtype).at[dest].set(x[token])
    block_expert = jnp.searchsorted(
        jnp.cumsum(padded), jnp.arange(n_blocks) * block, side="right"
    )
    block_expert = jnp.minimum(block_expert, n_experts - 1)
    rows = rows.reshape(n_blocks, block, -1)
    h = jnp.einsum("nbd,ndf->nbf", rows, jnp.take(gate_up, block_expert, axis=0))
    y = jnp.einsum("nbf,nfd->nbd", swiglu(h), jnp.take(down, block_expert, axis=0))
    y = y.reshape(n_blocks * block, -1)[dest]
    w = weights.reshape(-1)[order].astype(y.dtype)
    return jnp.zeros_like(x).at[token].add(y * w[:, None])


def experts_ragged(x, weights, ids, gate_up, down):
    """Grouped matmul with `lax.ragged_dot`: the fast path on GPUs and TPUs."""
    t, k = ids.shape
    order, _, sizes = _sorted_assignments(ids, gate_up.shape[0])
    token = order // k
    xs = x[token]
    h = jax.lax.ragged_dot(xs, gate_up, sizes)
    y = jax.lax.ragged_dot(swiglu(h), down, sizes)
    w = weights.reshape(-1)[order].astype(y.dtype)
    return jnp.zeros_like(x).at[token].add(y * w[:, None])


def moe_ffn(cfg: ModelConfig, layer: dict, x: jax.Array, impl: str = "auto") -> jax.Array:
    weights, ids = route(cfg, layer["router"], x)
    gate_up, down = layer["experts_gate_up"], layer["experts_down"]
    t, k = ids.shape
    if impl == "auto":
        if t * k <= cfg.n_experts:
            impl = "gather"
        else:
            impl = "blocked" if jax.default_backend() == "cpu" else "ragged"
    if impl == "gather":
        return experts_gathered(x, weights, ids, gate_up, down)
    if impl == "ragged":
        return experts_ragged(x, weights, ids, gate_up, down)
    # Blocks about the size of an expert's average share, so padding stays small.
    block = max(8, min(128, 1 << max(0, (t * k // cfg.n_experts).bit_length() - 1)))
    return experts_blocked(x, weights, ids, gate_up, down, block)


def dense_ffn(layer: dict, x: jax.Array) -> jax.Array:
    return jnp.dot(swiglu(jnp.dot(x, layer["w_gate_up"])), layer["w_down"])
