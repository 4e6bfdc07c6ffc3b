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
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from .attention import attend_chunk, attend_rows
from .forward import embed, lm_head, qkv
from .moe import dense_ffn, local_experts, route, routed_experts
from .norm import add_rms_norm, rms_norm
from .quant import matmul, with_x_bits
from .sharding import EP, KV_SPEC, LEAF_SPECS, TP, leaf_spec, local_config

EXPERT_KEYS = ("experts_gate_up", "experts_down")


def shared_weight_bytes(weights: dict) -> int:
    """Bytes of the weights that are not experts (always on the device)."""
    top = sum(leaf.nbytes for key, leaf in weights.items() if key != "layers")
    return top + sum(leaf.nbytes for layer in weights["layers"] for key, leaf in layer.items()
                     if key not in EXPERT_KEYS)


def shared_weights(layer: dict) -> dict:
    """A layer's weights without its experts: what the attention/router piece reads."""
    return {k: v for k, v in layer.items() if k not in EXPERT_KEYS}


def shared_model_weights(weights: dict) -> dict:
    """The weights without the experts (a tiered model's pool holds those)."""
    return {**weights, "layers": [shared_weights(layer) for layer in weights["layers"]]}


def _guess(cfg, x, nxt):
    """The next MoE layer's router applied to this layer's hidden state: [t, k] ids (or
    None). Its top-k is a cheap, often right guess of the experts that layer will pick."""
    if nxt is None:
        return None
    h = rms_norm(x, nxt["ffn_norm"], cfg.rms_eps)
    return jax.lax.top_k(jnp.dot(h.astype(jnp.float32), nxt["router"]), cfg.n_experts_per_tok)[1]


def _after_attention(cfg, layer, x, out, nxt, mesh):
    """Residual add, then for a MoE layer its routing (and the guess for the next one),
    for a dense layer its FFN. mesh: inside shard_map with tp > 1 (out and wo hold this
    shard's heads: partial sums)."""
    out = matmul(out, layer["wo"])
    x, h = add_rms_norm(x, jax.lax.psum(out, TP) if mesh is not None else out, layer["ffn_norm"], cfg.rms_eps)
    if "router" not in layer:
        return x + dense_ffn(layer, h, mesh), None, None, None, None
    w, ids = route(cfg, layer["router"], h)
    return x, h, w, ids, _guess(cfg, x, nxt)


@partial(jax.jit, static_argnames=("cfg", "mesh"))
def layer_rows(cfg, layer, nxt, x, k_cache, v_cache, slots, positions, mesh: Mesh | None = None):
    """One layer's attention (decode rows, as forward.decode) and its routing, or the
    whole layer when it is dense. Returns (x, h, weights, ids, guess, new K [b, k, d],
    new V [b, k, d]); h, weights, ids and guess are None for a dense layer. mesh: the
    weights' (the attention runs per tp shard of its heads where tp > 1)."""

    def body(cfg, mesh, layer, nxt, x, k_cache, v_cache, slots, positions):
        layer = with_x_bits(layer, cfg.x_bits)
        q, k, v = qkv(cfg, layer, rms_norm(x, layer["attn_norm"], cfg.rms_eps), positions, mesh)
        out = attend_rows(cfg, q, k, v, k_cache, v_cache, slots, positions)
        return (*_after_attention(cfg, layer, x, out, nxt, mesh), k, v)

    return _per_shard(body, cfg, mesh, layer, nxt, (x, k_cache, v_cache, slots, positions), P(None, TP))


@partial(jax.jit, static_argnames=("cfg", "mesh"))
def layer_chunk(cfg, layer, nxt, x, k_cache, v_cache, slot, offset, mesh: Mesh | None = None):
    """The same for a prefill chunk (as forward.prefill, attending to the slot's history,
    none at offset 0); new K [k, d, t], V [k, t, d]."""

    def body(cfg, mesh, layer, nxt, x, k_cache, v_cache, slot, offset):
        layer = with_x_bits(layer, cfg.x_bits)
        positions = offset + jnp.arange(x.shape[0])
        q, k, v = qkv(cfg, layer, rms_norm(x, layer["attn_norm"], cfg.rms_eps), positions, mesh)
        out = attend_chunk(cfg, q, k, v, k_cache, v_cache, slot, offset)
        return (*_after_attention(cfg, layer, x, out, nxt, mesh), k.transpose(1, 2, 0), v.transpose(1, 0, 2))

    return _per_shard(body, cfg, mesh, layer, nxt, (x, k_cache, v_cache, slot, offset), P(TP))


def _per_shard(body, cfg, mesh: Mesh | None, layer, nxt, args, new_kv: P):
    """body(cfg, mesh, layer, nxt, *args) as it is, or with tp > 1 as a shard_map over the
    mesh: the layer's weights split as sharding.py says, the caches along their KV
    heads, the rest replicated; cfg as one shard sees it. new_kv: the new K and V rows'
    spec (split along their KV heads)."""
    if mesh is None or mesh.shape[TP] == 1:
        return body(cfg, None, layer, nxt, *args)
    specs = {name: leaf_spec(cfg, name) for name in layer}
    return jax.shard_map(
        partial(body, local_config(cfg, mesh), mesh), mesh=mesh,
        in_specs=(specs, P(), P(), KV_SPEC, KV_SPEC, P(), P()),
        out_specs=(P(), P(), P(), P(), P(), new_kv, new_kv), check_vma=False,
    )(layer, nxt, *args)


# A pool on an ep mesh: slots split along ep in equal ranges (device group g holds slots
# [g·c/ep, (g+1)·c/ep), for its own experts only), each expert's width along tp.
POOL_SPECS = (LEAF_SPECS["experts_gate_up"], LEAF_SPECS["experts_down"])


@partial(jax.jit, static_argnames=("impl", "mesh", "x_bits"))
def moe_over_pool(x, h, w, mask, slot_ids, pool_gate_up, pool_down, *, impl, mesh: Mesh | None = None,
                  x_bits: int = 16):
    """x + the MoE output, the experts read from the pool by slot ids [t, k]. Only the
    assignments where mask [t, k] is 1 count: padding rows, and in a layer run in several
    passes the experts of the other passes, are masked out. mesh: the pool is split over
    it (POOL_SPECS); each device runs the assignments whose slot is its own, a psum adds
    the shares (as moe.moe_ffn on a mesh). x_bits: the model config's."""
    pool_gate_up, pool_down = with_x_bits((pool_gate_up, pool_down), x_bits)
    if mesh is None:
        return x + routed_experts(h, w * mask, slot_ids, pool_gate_up, pool_down, impl)

    def body(x, h, w, mask, slot_ids, gate_up, down):
        local_w, local_ids = local_experts(w * mask, slot_ids, gate_up.shape[0])
        y = routed_experts(h, local_w, local_ids, gate_up, down, impl, elsewhere=True)
        return x + jax.lax.psum(y, (EP, TP))

    return jax.shard_map(body, mesh=mesh, in_specs=(P(),) * 5 + POOL_SPECS, out_specs=P(),
                         check_vma=False)(x, h, w, mask, slot_ids, pool_gate_up, pool_down)


@partial(jax.jit, static_argnames=("mesh",), donate_argnums=(0, 1))
def put_experts(pool_gate_up, pool_down, slots, gate_up, down, *, mesh: Mesh | None = None):
    """Write experts gate_up [n, d, 2f], down [n, f, d] (or QTensor stacks) into pool
    slots [n] (in place).
    A loop of dynamic_update_slice: a scatter would copy the pool on XLA:CPU. mesh: the
    pool is split over it (POOL_SPECS); each device writes the slots of its own range."""
    if mesh is None:
        return _put(pool_gate_up, pool_down, slots, gate_up, down)

    def body(pool_gate_up, pool_down, slots, gate_up, down):
        local = slots - jax.lax.axis_index(EP) * pool_gate_up.shape[0]
        return _put(pool_gate_up, pool_down, local, gate_up, down)

    specs = (*POOL_SPECS, P(), P(None, None, TP), P(None, TP, None))
    return jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=POOL_SPECS, check_vma=False)(
        pool_gate_up, pool_down, slots, gate_up, down)


def _put(pool_gate_up, pool_down, slots, gate_up, down):
    """slots: local indices; one outside [0, c) is another device's (left as it is).
    Every leaf of the pools (a QTensor's values, scales and mins) moves alike."""
    c = _slot_count(pool_gate_up)

    def write(pool, new, s):
        at = jnp.clip(s, 0, c - 1)
        start = (at,) + (0,) * (pool.ndim - 1)
        old = jax.lax.dynamic_slice(pool, start, (1, *pool.shape[1:]))
        here = (s >= 0) & (s < c)
        return jax.lax.dynamic_update_slice(pool, jnp.where(here, new[None], old), start)

    def one(i, pools):
        return jax.tree.map(lambda pool, new: write(pool, new[i], slots[i]), pools, (gate_up, down))

    return jax.lax.fori_loop(0, slots.shape[0], one, (pool_gate_up, pool_down))


def _slot_count(pool) -> int:
    return jax.tree.leaves(pool)[0].shape[0]


@partial(jax.jit, static_argnames=("mesh",))
def take_experts(pool_gate_up, pool_down, slots, *, mesh: Mesh | None = None):
    """Copies of the experts in pool slots [n] (an eviction back to host RAM), sliced
    one by one: a gather would copy the whole pool first on XLA:CPU. mesh: each device
    copies the slots of its own range (zeros for the others), a psum over ep adds them
    and the tp shards are gathered, so every device (every process of a group, which
    can read only its own) holds the whole copies."""
    if mesh is None:
        return _take(pool_gate_up, pool_down, slots)

    def body(pool_gate_up, pool_down, slots):
        local = slots - jax.lax.axis_index(EP) * pool_gate_up.shape[0]
        gate_up, down = (jax.lax.psum(a, EP) for a in _take(pool_gate_up, pool_down, local))
        return (jax.lax.all_gather(gate_up, TP, axis=2, tiled=True),
                jax.lax.all_gather(down, TP, axis=1, tiled=True))

    return jax.shard_map(body, mesh=mesh, in_specs=(*POOL_SPECS, P()), out_specs=(P(), P()), check_vma=False)(
        pool_gate_up, pool_down, slots)


def _take(pool_gate_up, pool_down, slots):
    """slots: local indices; one outside [0, c) is another device's (copied as zeros)."""
    n, c, pools = slots.shape[0], _slot_count(pool_gate_up), (pool_gate_up, pool_down)

    def one(i, out):
        at, here = jnp.clip(slots[i], 0, c - 1), (slots[i] >= 0) & (slots[i] < c)
        return jax.tree.map(
            lambda o, pool: o.at[i].set(jnp.where(here, jax.lax.dynamic_index_in_dim(pool, at, 0, False), 0)),
            out, pools)

    init = jax.tree.map(lambda pool: jnp.zeros((n, *pool.shape[1:]), pool.dtype), pools)
    return jax.lax.fori_loop(0, n, one, init)


@jax.jit
def embed_tokens(weights, tokens):
    return embed(weights, tokens)


@partial(jax.jit, static_argnames=("cfg",))
def head(cfg, weights, x):
    return lm_head(cfg, weights, x)


@partial(jax.jit, static_argnames=("cfg",))
def head_row(cfg, weights, x, row):
    """The logits [vocab] of one row of x (a chunk's last real token). The row is traced:
    one compile per chunk size, not per prompt length."""
    return lm_head(cfg, weights, jax.lax.dynamic_slice_in_dim(x, row, 1))[0]


def top_weights(weights: dict) -> dict:
    """The non-layer weights (embedding, final norm, LM head): what embed and head read."""
    return {k: v for k, v in weights.items() if k != "layers"}
