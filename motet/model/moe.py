"""Mixture-of-experts FFN: route each token to its top-k experts and run only those.

Dimension letters: t tokens, k experts per token, d model width, f expert width,
e experts, a assignments (t·k token-expert pairs).

On a device mesh (sharding.py) this runs inside shard_map: each device holds e/ep
experts (f/tp of each one's width), sees every token, computes only the assignments
routed to its own experts and skips the rest; a psum over (ep, tp) adds the shares.
"""

from __future__ import annotations

from functools import partial
from typing import Literal, get_args

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from . import native
from .config import ModelConfig
from .quant import QTensor, as_float_stack, ffi_operands, matmul, matmul_gathered, matmul_stacked
from .sharding import EP, TP

MoeImpl = Literal["auto", "grouped", "ragged", "gather"]
MOE_IMPLS = get_args(MoeImpl)
# Off the CPU, "auto" picks by token-expert pairs, as measured on an H200 (a 12-layer
# Qwen3-30B-A3B-shaped step, docs/performance.md): gathering each pair's matrices won at
# 1 row of top-8 in every format and at 16 rows for quantized experts, which ragged_dot
# dequantizes whole; ragged_dot won for float experts at 16 rows; the grouped loop won a
# 512-token prefill in every format. The limits sit at the measured points.
GATHER_MAX_PAIRS = {"float": 8, "quantized": 128}
RAGGED_MAX_PAIRS = 128
# When an ep mesh dispatches a MoE layer's tokens to their experts' ranks rather than
# replicating them and adding the shares (experts_dispatched): from this many tokens a
# batch, on this ep or more, per backend. Measured on 4 virtual CPU devices
# (benchmarks/ep_dispatch.py, docs/scaling.md, three runs): at ep=4 dispatch took
# 1.00-1.03 of psum's time at 16 tokens, 0.93-0.95 at 32 and 0.60-0.89 from 64; at ep=2
# 0.79-1.13, no consistent gain.
# Not measured on GPUs, where its padded all_to_all sends several times psum's bytes: off.
# DISPATCH_CAPACITY: the slots each pair of ranks keeps, as a multiple of an even split.
DISPATCH_MIN_TOKENS = {"cpu": 32}
DISPATCH_MIN_EP = 4
DISPATCH_CAPACITY = 2.0


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


def experts_grouped(x, weights, ids, gate_up, down, block: int, elsewhere: bool = False,
                    use_native: bool | None = None):
    """A layer's routed experts. On the CPU, quantized stacks go to the native kernel
    (kernels/moe.cc) where it was built; otherwise, and with `elsewhere`, to the XLA loop
    (_experts_grouped_xla). use_native: None picks; False forces the XLA loop (tests)."""
    quantized = isinstance(gate_up, QTensor) and isinstance(down, QTensor)
    use_native = native.use_kernel(use_native, quantized and not elsewhere, "MoE experts")
    xla = partial(_experts_grouped_xla, block=block, elsewhere=elsewhere)
    if not use_native:
        return xla(x, weights, ids, gate_up, down)
    return jax.lax.platform_dependent(x, weights, ids, gate_up, down, cpu=_experts_native, default=xla)


def _experts_native(x, weights, ids, gate_up: QTensor, down: QTensor):
    call = jax.ffi.ffi_call(native.MOE_EXPERTS, jax.ShapeDtypeStruct(x.shape, jnp.float32))
    (gu_buffers, gu_attributes), (down_buffers, down_attributes) = ffi_operands(gate_up), ffi_operands(down)
    out = call(x.astype(jnp.float32), ids.astype(jnp.int32), weights.astype(jnp.float32), *gu_buffers, *down_buffers,
               **{f"gu_{k}": v for k, v in gu_attributes.items()},
               **{f"down_{k}": v for k, v in down_attributes.items()})
    return out.astype(x.dtype)


def _experts_grouped_xla(x, weights, ids, gate_up, down, block: int, elsewhere: bool = False):
    """Sort the assignments by expert, pad each expert's group to whole blocks of `block`
    rows, and loop over the blocks in use: each slices its expert's matrices once and
    multiplies its rows. Each chosen expert's weights are read once per block, unchosen
    experts never; nothing is dropped.

    elsewhere: ids == e marks an assignment whose expert is on another device; those sort
    last, after every block in use, and are never computed (their output is zero).

    A loop whose body slices the weights is the fast form on XLA:CPU: a gather of all the
    chosen matrices at once is copied first, several times slower. Quantized experts
    (QTensor stacks) are read in place by the kernel, which takes the stack and the index.
    """
    t, k = ids.shape
    n_experts, d = gate_up.shape[0], x.shape[-1]
    groups = n_experts + elsewhere
    a = t * k
    order, sizes = _by_expert(ids, groups)
    padded = (sizes + block - 1) // block * block
    padded_end = jnp.cumsum(padded)
    start, padded_start = jnp.cumsum(sizes) - sizes, padded_end - padded
    sorted_experts = ids.reshape(-1)[order]
    dest = padded_start[sorted_experts] + jnp.arange(a) - start[sorted_experts]
    capacity = -(-(a + min(a, groups) * (block - 1)) // block) * block
    token = order // k
    rows = jnp.zeros((capacity, d), x.dtype).at[dest].set(x[token])
    used_blocks = padded_end[n_experts - 1] // block
    block_expert = jnp.searchsorted(padded_end, jnp.arange(capacity // block) * block, side="right")

    def one(n, out):
        e = block_expert[n]
        xs = jax.lax.dynamic_slice(rows, (n * block, 0), (block, d))
        ys = matmul_stacked(swiglu(matmul_stacked(xs, gate_up, e)), down, e)
        return jax.lax.dynamic_update_slice(out, ys, (n * block, 0))

    ys = jax.lax.fori_loop(0, used_blocks, one, jnp.zeros_like(rows))[dest]
    w = weights.reshape(-1)[order].astype(ys.dtype)
    return jnp.zeros_like(x).at[token].add(ys * w[:, None])


def experts_ragged(x, weights, ids, gate_up, down, elsewhere: bool = False):
    """Grouped matmul with `lax.ragged_dot`: the fast path on GPUs and TPUs. elsewhere: as
    experts_grouped (the rows past the last local group come out zero). Quantized experts
    are dequantized inside the step first: ragged_dot takes float operands only."""
    t, k = ids.shape
    n_experts = gate_up.shape[0]
    gate_up, down = as_float_stack(gate_up).astype(x.dtype), as_float_stack(down).astype(x.dtype)
    order, sizes = _by_expert(ids, n_experts + elsewhere)
    sizes = sizes[:n_experts]
    token = order // k
    h = jax.lax.ragged_dot(x[token], gate_up, sizes)
    ys = jax.lax.ragged_dot(swiglu(h), down, sizes)
    w = weights.reshape(-1)[order].astype(ys.dtype)
    return jnp.zeros_like(x).at[token].add(ys * w[:, None])


def experts_gathered(x, weights, ids, gate_up, down):
    """Each token-expert pair's matrices gathered from the stack, then one batch of
    matrix-vector products: reads the chosen experts only (once per pair), where
    ragged_dot on a GPU may go through every expert; for small decode batches. An
    `elsewhere` id (== the stack's size) reads the last expert at weight 0."""
    t, k = ids.shape
    flat = jnp.minimum(ids.reshape(-1), gate_up.shape[0] - 1)
    h = matmul_gathered(jnp.repeat(x, k, axis=0), gate_up, flat)
    ys = matmul_gathered(swiglu(h), down, flat).reshape(t, k, -1)
    return jnp.einsum("tkd,tk->td", ys, weights.astype(ys.dtype))


def pick_impl(impl: str, pairs: int, quantized: bool, backend: str) -> str:
    """The expert path "auto" stands for: the grouped loop on the CPU (native kernels);
    elsewhere by the batch's token-expert pairs (GATHER_MAX_PAIRS)."""
    if impl != "auto":
        return impl
    if backend == "cpu":
        return "grouped"
    if pairs <= GATHER_MAX_PAIRS["quantized" if quantized else "float"]:
        return "gather"
    return "ragged" if pairs <= RAGGED_MAX_PAIRS and not quantized else "grouped"


def routed_experts(x, weights, ids, gate_up, down, impl: str = "auto", elsewhere: bool = False):
    """Each token's routed experts [t, d] by the path `impl` names (MOE_IMPLS)."""
    impl = pick_impl(impl, ids.size, isinstance(gate_up, QTensor), jax.default_backend())
    if impl == "ragged":
        return experts_ragged(x, weights, ids, gate_up, down, elsewhere=elsewhere)
    if impl == "gather":
        return experts_gathered(x, weights, ids, gate_up, down)
    if impl == "grouped":
        block = group_block(ids.size, gate_up.shape[0])
        return experts_grouped(x, weights, ids, gate_up, down, block, elsewhere=elsewhere)
    raise ValueError(f"unknown MoE implementation {impl!r}; choose from {MOE_IMPLS}")


def group_block(assignments: int, n_experts: int) -> int:
    """Rows per block: about one expert's average share, so padding stays small."""
    share = max(1, assignments // n_experts)
    return min(64, 1 << (share.bit_length() - 1))


def local_experts(weights: jax.Array, ids: jax.Array, n_local: int):
    """Inside shard_map: this ep shard's view of the routing. Its experts keep their
    local index; the others become n_local (elsewhere) with weight 0."""
    local = ids - jax.lax.axis_index(EP) * n_local
    here = (local >= 0) & (local < n_local)
    return jnp.where(here, weights, 0), jnp.where(here, local, n_local)


def moe_ffn(cfg: ModelConfig, layer: dict, x: jax.Array, impl: str = "auto", mesh: Mesh | None = None):
    """(output [t, d], the chosen expert ids [t, k]). mesh: running inside shard_map over
    it, with this device's share of the experts (see the module docstring)."""
    weights, ids = route(cfg, layer["router"], x)
    gate_up, down = layer["experts_gate_up"], layer["experts_down"]
    # A tiered layer holds a pool of expert slots and an expert → slot table (-1: not on
    # the device, read as slot 0: a step that needed such an expert is thrown away).
    slots = jnp.maximum(layer["expert_slots"][ids], 0) if "expert_slots" in layer else ids
    ep = 1 if mesh is None else mesh.shape[EP]
    sharded = ep > 1
    if "expert_slots" not in layer and dispatches(ep, x.shape[0], jax.default_backend()):
        return experts_dispatched(x, weights, ids, gate_up, down, impl), ids
    if sharded:
        weights, slots = local_experts(weights, slots, gate_up.shape[0])
    y = routed_experts(x, weights, slots, gate_up, down, impl, elsewhere=sharded)
    if mesh is not None and mesh.size > 1:
        y = jax.lax.psum(y, (EP, TP))
    return y, ids


def dispatches(ep: int, tokens: int, backend: str) -> bool:
    """Whether a batch of `tokens` on an ep mesh goes to its experts by dispatch
    (DISPATCH_MIN_TOKENS) rather than replicate-and-psum."""
    min_tokens = DISPATCH_MIN_TOKENS.get(backend)
    return ep >= DISPATCH_MIN_EP and min_tokens is not None and tokens >= min_tokens


def experts_dispatched(x, weights, ids, gate_up, down, impl: str = "auto"):
    """Inside shard_map over a mesh with ep > 1: token dispatch instead of replicate and
    psum. Each ep rank takes its 1/ep of the tokens and sends each token-expert pair to
    the rank that holds the expert (all_to_all, DISPATCH_CAPACITY times the even share of
    slots per pair of ranks), runs the pairs it receives, sends the results back, and
    the ranks gather each other's tokens. Where any pair of ranks would overflow its
    slots, every rank takes the replicate-and-psum path instead (a cond on a pmax), so no
    pair is dropped and the answer does not depend on the routing's balance."""
    ep, rank = jax.lax.axis_size(EP), jax.lax.axis_index(EP)
    (t, k), d, n_local = ids.shape, x.shape[-1], gate_up.shape[0]
    share = -(-t // ep)
    pad = ((0, share * ep - t), (0, 0))

    def mine(a):  # this rank's tokens (padding rows: weight 0, expert 0)
        return jax.lax.dynamic_slice_in_dim(jnp.pad(a, pad), rank * share, share)

    xs, ws, dest_ids = mine(x), mine(weights), mine(ids).reshape(-1)
    dest = dest_ids // n_local
    capacity = max(1, int(DISPATCH_CAPACITY * share * k / ep))
    order = jnp.cumsum(dest[:, None] == jnp.arange(ep), axis=0)[jnp.arange(dest.size), dest] - 1
    overflow = jax.lax.pmax(jnp.max(order) >= capacity, EP)
    place = dest * capacity + order  # the pair's slot in [ep * capacity]

    def dispatch():
        rows = jnp.zeros((ep * capacity, d), x.dtype).at[place].set(xs[jnp.arange(dest.size) // k])
        local = jnp.full((ep * capacity,), n_local, jnp.int32).at[place].set(dest_ids - dest * n_local)
        rows = jax.lax.all_to_all(rows.reshape(ep, capacity, d), EP, 0, 0).reshape(-1, d)
        local = jax.lax.all_to_all(local.reshape(ep, capacity), EP, 0, 0).reshape(-1, 1)
        ys = routed_experts(rows, (local < n_local).astype(x.dtype), local, gate_up, down, impl, elsewhere=True)
        ys = jax.lax.psum(ys, TP)  # the experts' width is split over tp
        ys = jax.lax.all_to_all(ys.reshape(ep, capacity, d), EP, 0, 0).reshape(-1, d)
        mine_out = jnp.einsum("tkd,tk->td", ys[place].reshape(share, k, d), ws.astype(ys.dtype))
        return jax.lax.all_gather(mine_out, EP, axis=0, tiled=True)[:t]

    def replicate():
        local_w, local_ids = local_experts(weights, ids, n_local)
        return jax.lax.psum(routed_experts(x, local_w, local_ids, gate_up, down, impl, elsewhere=True), (EP, TP))

    return jax.lax.cond(overflow, replicate, dispatch)


def dense_ffn(layer: dict, x: jax.Array, mesh: Mesh | None = None) -> jax.Array:
    """mesh: inside shard_map, gate_up column- and down row-parallel over tp, then a psum."""
    y = matmul(swiglu(matmul(x, layer["w_gate_up"])), layer["w_down"])
    return jax.lax.psum(y, TP) if mesh is not None and mesh.shape[TP] > 1 else y
