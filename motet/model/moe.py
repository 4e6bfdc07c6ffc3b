"""Mixture-of-experts FFN: route each token to its top-k experts and run only those.

Dimension letters: t tokens, k experts per token, d model width, f expert width,
e experts, a assignments (t·k token-expert pairs).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .config import ModelConfig

MOE_IMPLS = ("auto", "grouped", "ragged")


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


def _by_expert(ids: jax.Array, n_experts: int):
    """Assignments sorted by expert: (order [a], group sizes [e])."""
    flat = ids.reshape(-1)
    return jnp.argsort(flat, stable=True), jnp.bincount(flat, length=n_experts)


def experts_grouped(x, weights, ids, gate_up, down, block: int):
    """Sort the assignments by expert, pad each expert's group to whole blocks of `block`
    rows, and loop over the blocks in use: each slices its expert's matrices once and
    multiplies its rows. Each chosen expert's weights are read once per block, unchosen
    experts never; nothing is dropped.

    A loop whose body slices the weights is the fast form on XLA:CPU: a gather of all the
    chosen matrices at once is copied first, several times slower.
    """
    t, k = ids.shape
    n_experts, d, f2 = gate_up.shape
    a = t * k
    order, sizes = _by_expert(ids, n_experts)
    padded = (sizes + block - 1) // block * block
    padded_end = jnp.cumsum(padded)
    start, padded_start = jnp.cumsum(sizes) - sizes, padded_end - padded
    sorted_experts = ids.reshape(-1)[order]
    dest = padded_start[sorted_experts] + jnp.arange(a) - start[sorted_experts]
    capacity = -(-(a + min(a, n_experts) * (block - 1)) // block) * block
    token = order // k
    rows = jnp.zeros((capacity, d), x.dtype).at[dest].set(x[token])
    used_blocks = padded_end[-1] // block
    block_expert = jnp.searchsorted(padded_end, jnp.arange(capacity // block) * block, side="right")

    def one(n, out):
        e = block_expert[n]
        w_gate_up = jax.lax.dynamic_slice(gate_up, (e, 0, 0), (1, d, f2))[0]
        w_down = jax.lax.dynamic_slice(down, (e, 0, 0), (1, f2 // 2, d))[0]
        xs = jax.lax.dynamic_slice(rows, (n * block, 0), (block, d))
        ys = jnp.dot(swiglu(jnp.dot(xs, w_gate_up)), w_down)
        return jax.lax.dynamic_update_slice(out, ys, (n * block, 0))

    ys = jax.lax.fori_loop(0, used_blocks, one, jnp.zeros_like(rows))[dest]
    w = weights.reshape(-1)[order].astype(ys.dtype)
    return jnp.zeros_like(x).at[token].add(ys * w[:, None])


def experts_ragged(x, weights, ids, gate_up, down):
    """Grouped matmul with `lax.ragged_dot`: the fast path on GPUs and TPUs."""
    t, k = ids.shape
    order, sizes = _by_expert(ids, gate_up.shape[0])
    token = order // k
    h = jax.lax.ragged_dot(x[token], gate_up, sizes)
    ys = jax.lax.ragged_dot(swiglu(h), down, sizes)
    w = weights.reshape(-1)[order].astype(ys.dtype)
    return jnp.zeros_like(x).at[token].add(ys * w[:, None])


def group_block(assignments: int, n_experts: int) -> int:
    """Rows per block: about one expert's average share, so padding stays small."""
    share = max(1, assignments // n_experts)
    return min(64, 1 << (share.bit_length() - 1))


def moe_ffn(cfg: ModelConfig, layer: dict, x: jax.Array, impl: str = "auto"):
    """(output [t, d], the chosen expert ids [t, k])."""
    weights, ids = route(cfg, layer["router"], x)
    gate_up, down = layer["experts_gate_up"], layer["experts_down"]
    # A tiered layer holds a pool of expert slots and an expert → slot table (-1: not on
    # the device, read as slot 0: a step that needed such an expert is thrown away).
    slots = jnp.maximum(layer["expert_slots"][ids], 0) if "expert_slots" in layer else ids
    if impl == "auto":
        impl = "grouped" if jax.default_backend() == "cpu" else "ragged"
    if impl == "ragged":
        return experts_ragged(x, weights, slots, gate_up, down), ids
    if impl != "grouped":
        raise ValueError(f"unknown MoE implementation {impl!r}; choose from {MOE_IMPLS}")
    block = group_block(ids.size, cfg.n_experts)
    return experts_grouped(x, weights, slots, gate_up, down, block), ids


def dense_ffn(layer: dict, x: jax.Array) -> jax.Array:
    return jnp.dot(swiglu(jnp.dot(x, layer["w_gate_up"])), layer["w_down"])
