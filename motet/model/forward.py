"""The forward pass as pure functions of (config, weights, inputs, KV cache).

KV cache: per layer, K [slots, kv_heads, context / KEY_BLOCK, head_dim, KEY_BLOCK]
(kv_layout.py: blocks of positions, each block transposed) and V [slots, kv_heads,
context, head_dim]. Head-major avoids a per-step transpose; K transposed makes q·K a
sum of vectors of positions, the fastest form measured on XLA:CPU and natively. The step
functions only *read* the cache and return the new rows; kv_writes.py stores them (the
sampled decode step calls its native write last, in the same compiled call).

Dimension letters: t tokens, b batch rows, h query heads, k KV heads, g query heads per
KV head, d head dim, l cached positions (one block), s positions in the chunk.

On a device mesh (weights placed by sharding.py) prefill and decode run as one
shard_map over it: the layer code below sees this device's heads, experts and widths
(`cfg` then counts the local heads) and adds the explicit psums; see sharding.py.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from .attention import attend_chunk, attend_rows
from .config import ModelConfig
from .heads import qkv_heads
from .kv_writes import write_rows, write_rows_traced, writes_in_step
from .moe import dense_ffn, moe_ffn
from .norm import add_rms_norm, rms_norm
from .quant import QTensor, matmul, take_rows, with_x_bits
from .sampling import CARRY_WIDTH, native_unless_on, pack_sampled, sample
from .sharding import KV_SPEC, TP, axis_size, local_config, mesh_of, weight_specs

F32 = jnp.float32


def qkv(cfg: ModelConfig, layer: dict, x: jax.Array, positions: jax.Array, mesh: Mesh | None = None):
    """Normed, rotated q [t, h, d], k [t, k, d] and v [t, k, d] for the tokens x [t, model]."""
    return qkv_heads(cfg, matmul(x, layer["wqkv"]), positions, layer.get("q_norm"), layer.get("k_norm"),
                     split_over_tp=axis_size(mesh, TP) > 1)


def ffn(cfg: ModelConfig, layer: dict, x: jax.Array, moe_impl: str, mesh: Mesh | None = None):
    """(output, chosen expert ids [t, k] or None for a dense layer)."""
    if "router" in layer:
        return moe_ffn(cfg, layer, x, moe_impl, mesh)
    return dense_ffn(layer, x, mesh), None


def lm_head(cfg: ModelConfig, weights: dict, x: jax.Array) -> jax.Array:
    x = rms_norm(x, weights["final_norm"], cfg.rms_eps)
    head = with_x_bits(weights["lm_head"], cfg.x_bits)
    if isinstance(head, QTensor):
        return matmul(x.astype(F32), head)
    return jnp.dot(x, head, preferred_element_type=F32)


def embed(weights: dict, tokens: jax.Array) -> jax.Array:
    if "embed" in weights:
        return take_rows(weights["embed"], tokens)
    head = weights["lm_head"]
    if isinstance(head, QTensor):
        return take_rows(head, tokens)  # tied and quantized: [V, d] rows
    return head[:, tokens].T  # tied: a column per token


def _layer(cfg, layer, x, positions, attend, moe_impl, mesh):
    """One layer; attend(q, k, v) is its attention. Returns (x, its new K and V rows, its
    expert ids or None). mesh: inside shard_map over it (cfg counts this shard's heads)."""
    layer = with_x_bits(layer, cfg.x_bits)
    q, k, v = qkv(cfg, layer, rms_norm(x, layer["attn_norm"], cfg.rms_eps), positions, mesh)
    out = matmul(attend(q, k, v), layer["wo"])  # row-parallel over tp: partial sums
    x, normed = add_rms_norm(x, jax.lax.psum(out, TP) if axis_size(mesh, TP) > 1 else out, layer["ffn_norm"],
                             cfg.rms_eps)
    y, ids = ffn(cfg, layer, normed, moe_impl, mesh)
    return x + y, k, v, ids


# Each layer is a jitted function of its own, called once per layer inside the step: the
# step then traces and lowers a layer once, not once per layer (the slow part of starting
# an engine whose compiled steps come from the cache), and XLA inlines the calls back.


@partial(jax.jit, static_argnames=("cfg", "moe_impl", "mesh"))
def _rows_layer(layer, x, k_cache, v_cache, slots, positions, *, cfg, moe_impl, mesh):
    """A layer of a decode step (attend_rows)."""
    def attend(q, k, v):
        return attend_rows(cfg, q, k, v, k_cache, v_cache, slots, positions)

    return _layer(cfg, layer, x, positions, attend, moe_impl, mesh)


@partial(jax.jit, static_argnames=("cfg", "moe_impl", "mesh"))
def _chunk_layer(layer, x, k_cache, v_cache, slot, offset, *, cfg, moe_impl, mesh):
    """A layer of a prefill chunk (attend_chunk; no history when the caches are None)."""
    def attend(q, k, v):
        return attend_chunk(cfg, q, k, v, k_cache, v_cache, slot, offset)

    return _layer(cfg, layer, x, offset + jnp.arange(x.shape[0]), attend, moe_impl, mesh)


def _layers(weights, x, run_layer):
    """run_layer(i, layer, x) for every layer: the final hidden states, each layer's new K
    and V rows, and each MoE layer's expert ids."""
    new_k, new_v, routing = [], [], []
    for i, layer in enumerate(weights["layers"]):
        x, k, v, ids = run_layer(i, layer, x)
        new_k.append(k)
        new_v.append(v)
        if ids is not None:
            routing.append(ids)
    return x, new_k, new_v, routing


def _on_mesh(body, mesh, cfg, weights, caches, args, out_kv: tuple[P, P], n_moe: int):
    """body(weights, *caches, *args) as a shard_map over the mesh: weights split as
    sharding.py says, caches along their KV heads, args replicated; logits and routing
    come back replicated, the new K and V rows split along their KV-head axis."""
    n_layers = len(weights["layers"])
    kv_in = [[KV_SPEC] * len(c) for c in caches]
    out_specs = (P(), [out_kv[0]] * n_layers, [out_kv[1]] * n_layers, [P()] * n_moe)
    return jax.shard_map(
        body, mesh=mesh, in_specs=(weight_specs(cfg, weights), *kv_in, *[P()] * len(args)),
        out_specs=out_specs, check_vma=False,
    )(weights, *caches, *args)


def prefill(weights, k_cache, v_cache, tokens, slot, offset, n_valid, *, cfg, with_history=True,
            all_logits=False, moe_impl="auto"):
    """Prefill a chunk of tokens [t] (the first n_valid real, the rest padding) into `slot`
    at position `offset`, attending to the slot's first `offset` cached positions
    (with_history=False: a fresh sequence, and the caches may be empty lists).

    Returns (logits [t, vocab] if all_logits else [vocab] of the last real token,
    new K per layer [k, d, t], new V per layer [k, t, d], expert ids per MoE layer [t, k]).
    Weights placed on a mesh (sharding.py) run sharded over it.
    """
    return _prefill(weights, k_cache, v_cache, tokens, slot, offset, n_valid, cfg=cfg,
                    with_history=with_history, all_logits=all_logits, moe_impl=moe_impl,
                    mesh=mesh_of(weights))


@partial(jax.jit, static_argnames=("cfg", "with_history", "all_logits", "moe_impl", "mesh"))
def _prefill(weights, k_cache, v_cache, tokens, slot, offset, n_valid, *, cfg, with_history,
             all_logits, moe_impl, mesh):
    body = partial(_prefill_body, with_history=with_history, all_logits=all_logits, moe_impl=moe_impl)
    if mesh is None:
        return body(weights, k_cache, v_cache, tokens, slot, offset, n_valid, cfg=cfg)
    split = P(TP, None, None)  # new K [k, d, t], V [k, t, d]
    return _on_mesh(partial(body, cfg=local_config(cfg, mesh), mesh=mesh), mesh, cfg, weights,
                    (k_cache, v_cache), (tokens, slot, offset, n_valid), (split, split), sum(cfg.moe_layers))


def lower_prefill(weights, k_cache, v_cache, tokens: int, *, cfg, moe_impl="auto"):
    """The prefill an engine runs for a chunk of `tokens` (padded) tokens, traced and
    lowered but not compiled: compiling it ahead of the first call (several at once, in
    threads) fills the cache that call then hits."""
    padded = jax.device_put(np.zeros(tokens, np.int32))
    return _prefill.trace(weights, k_cache, v_cache, padded, 0, 0, 1, cfg=cfg, with_history=True,
                          all_logits=False, moe_impl=moe_impl, mesh=mesh_of(weights)).lower()


def _prefill_body(weights, k_cache, v_cache, tokens, slot, offset, n_valid, *, cfg, with_history,
                  all_logits, moe_impl, mesh=None):
    x = embed(weights, tokens)

    def run_layer(i, layer, x):
        caches = (k_cache[i], v_cache[i]) if with_history else (None, None)
        return _chunk_layer(layer, x, *caches, slot, offset, cfg=cfg, moe_impl=moe_impl, mesh=mesh)

    x, new_k, new_v, routing = _layers(weights, x, run_layer)
    if not all_logits:
        x = jax.lax.dynamic_slice_in_dim(x, n_valid - 1, 1)
    logits = lm_head(cfg, weights, x)
    new_k = [k.transpose(1, 2, 0) for k in new_k]
    new_v = [v.transpose(1, 0, 2) for v in new_v]
    return (logits if all_logits else logits[0]), new_k, new_v, routing


def decode(weights, k_cache, v_cache, tokens, slots, positions, *, cfg, moe_impl="auto"):
    """One decode step for rows b: token tokens[b] at positions[b] in slot slots[b],
    attending to that slot's cached positions < positions[b].

    Returns (logits [b, vocab], new K rows per layer [b, k, d], new V rows per layer,
    expert ids per MoE layer [b, k]). Weights placed on a mesh run sharded over it.
    """
    return _decode(weights, k_cache, v_cache, tokens, slots, positions, cfg=cfg, moe_impl=moe_impl,
                   mesh=mesh_of(weights))


@partial(jax.jit, static_argnames=("cfg", "moe_impl", "mesh"))
def _decode(weights, k_cache, v_cache, tokens, slots, positions, *, cfg, moe_impl, mesh):
    body = partial(_decode_body, moe_impl=moe_impl)
    if mesh is None:
        return body(weights, k_cache, v_cache, tokens, slots, positions, cfg=cfg)
    split = P(None, TP, None)  # new K and V rows [b, k, d]
    return _on_mesh(partial(body, cfg=local_config(cfg, mesh), mesh=mesh), mesh, cfg, weights,
                    (k_cache, v_cache), (tokens, slots, positions), (split, split), sum(cfg.moe_layers))


def decode_sampled(weights, k_cache, v_cache, tokens, slots, positions, sampling, want_top, carry, chained, *,
                   cfg, moe_impl="auto"):
    """decode, and each row's next token drawn from its logits by sampling.sample in the
    same compiled call: one dispatch and one read-back a step instead of several (0.5 ms
    of a 5 ms MoE step, measured). sampling: sample's (temperature, top_p, top_k, min_p,
    keys) for every row; want_top: a bool array. The step samples plainly: penalties
    and grammar masks are a second call over its logits (logit_history.resample), only
    for the batches that carry them, since any conditional over the logits here slowed
    every 16-row step by a tenth (docs/performance.md).

    carry [slots + 1, 4] int32: per KV slot, what the last step that fed it sampled
    (pack_sampled's first four columns: token, logprob, key). A row with chained[i]
    set feeds the token and uses the key its slot's carry holds, in place of tokens[i]
    and keys[i]: a step can be dispatched before the host has read the one before it.

    The caches are donated: where the native write takes them (kv_writes.writes_in_step)
    the step stores its rows itself, else a second call does (kv_writes.write_rows). A
    call's arguments and results cost the dispatching thread about a microsecond each,
    and on two cores that thread's time is the step's (docs/performance.md): the second
    call passed every layer's cache and rows again.

    Returns (the K caches and the V caches with the rows stored, [b, SAMPLED_WIDTH + MoE
    layers · k] int32: sampling.pack_sampled's columns, then the expert ids of each MoE
    layer in turn, the carry with the rows' slots updated, the logits [b, vocab], and
    what each row fed [b, 3] int32: its token and its key's two words (resample's
    `fed`))."""
    mesh = mesh_of(weights)
    if mesh is None and writes_in_step(k_cache):
        return _decode_sampled_written(weights, k_cache, v_cache, tokens, slots, positions, sampling, want_top,
                                       carry, chained, cfg=cfg, moe_impl=moe_impl)
    new_k, new_v, *rest = _decode_sampled(weights, k_cache, v_cache, tokens, slots, positions, sampling, want_top,
                                          carry, chained, cfg=cfg, moe_impl=moe_impl, mesh=mesh)
    return (*write_rows(k_cache, v_cache, new_k, new_v, slots, positions), *rest)


def sampled_step(weights, k_cache, v_cache, tokens, slots, positions, sampling, want_top, carry, chained, *,
                  cfg, moe_impl, mesh, write: bool):
    """decode_sampled's step, traced (decode_sampled's jitted forms and a burst's loop
    run it); write: it stores its rows (returning the caches), else it returns them (new
    K rows per layer, new V rows per layer, in the caches' place)."""
    temperature, top_p, top_k, min_p, keys = sampling
    held = carry[slots]
    tokens = jnp.where(chained, held[:, 0], tokens)
    keys = jnp.where(chained[:, None], jax.lax.bitcast_convert_type(held[:, 2:4], jnp.uint32), keys)
    logits, new_k, new_v, routing = _decode(weights, k_cache, v_cache, tokens, slots, positions, cfg=cfg,
                                            moe_impl=moe_impl, mesh=mesh)
    drawn = pack_sampled(sample(logits, temperature, top_p, top_k, min_p, keys, want_top,
                                use_native=native_unless_on(mesh)))
    carry = carry.at[slots].set(drawn[:, :CARRY_WIDTH])
    if mesh is not None:  # as empty_carry placed it: one signature for every step
        carry = jax.lax.with_sharding_constraint(carry, NamedSharding(mesh, P()))
    packed = jnp.concatenate([drawn] + [ids.astype(jnp.int32) for ids in routing], axis=1)
    fed = jnp.concatenate([tokens[:, None], jax.lax.bitcast_convert_type(keys, jnp.int32)], axis=1)
    if write:
        new_k, new_v = write_rows_traced(k_cache, v_cache, new_k, new_v, slots, positions, after=drawn)
    return new_k, new_v, packed, carry, logits, fed


_decode_sampled = jax.jit(partial(sampled_step, write=False), static_argnames=("cfg", "moe_impl", "mesh"))
_decode_sampled_written = jax.jit(partial(sampled_step, mesh=None, write=True), static_argnames=("cfg", "moe_impl"),
                                  donate_argnums=(1, 2))


def empty_carry(slots: int, mesh: Mesh | None = None) -> jax.Array:
    """decode_sampled's carry for a cache of `slots` slots (the scratch slot included),
    before any step: an array placed as the steps return it (a host array, or one on
    another placement, would make jit compile the step again for the second call).
    mesh: the weights' mesh, where the carry is held whole on every device."""
    carry = jnp.zeros((slots, CARRY_WIDTH), jnp.int32)
    return carry if mesh is None else jax.device_put(carry, NamedSharding(mesh, P()))


def greedy_sampling(batch: int):
    """decode_sampled's sampling for `batch` greedy rows, host arrays."""
    zeros = np.zeros(batch, np.float32)
    return zeros, np.ones(batch, np.float32), np.zeros(batch, np.int32), zeros, np.zeros((batch, 2), np.uint32)


def lower_decode_sampled(weights, k_cache, v_cache, batch: int, *, cfg, moe_impl="auto"):
    """decode_sampled's step for a padded batch of `batch` rows, traced and lowered (as
    lower_prefill)."""
    rows = jax.device_put(np.zeros(batch, np.int32))
    slots, mesh = k_cache[0].shape[0], mesh_of(weights)
    args = (weights, k_cache, v_cache, rows, rows, rows, greedy_sampling(batch), np.bool_(False),
            empty_carry(slots, mesh), np.zeros(batch, np.bool_))
    if mesh is None and writes_in_step(k_cache):
        return _decode_sampled_written.trace(*args, cfg=cfg, moe_impl=moe_impl).lower()
    return _decode_sampled.trace(*args, cfg=cfg, moe_impl=moe_impl, mesh=mesh).lower()


def lower_decode(weights, k_cache, v_cache, batch: int, *, cfg, moe_impl="auto"):
    """The decode step for a padded batch of `batch` rows, traced and lowered (as
    lower_prefill)."""
    rows = jax.device_put(np.zeros(batch, np.int32))
    return _decode.trace(weights, k_cache, v_cache, rows, rows, rows, cfg=cfg, moe_impl=moe_impl,
                         mesh=mesh_of(weights)).lower()


def _decode_body(weights, k_cache, v_cache, tokens, slots, positions, *, cfg, moe_impl, mesh=None):
    x = embed(weights, tokens)

    def run_layer(i, layer, x):
        return _rows_layer(layer, x, k_cache[i], v_cache[i], slots, positions, cfg=cfg, moe_impl=moe_impl,
                           mesh=mesh)

    x, new_k, new_v, routing = _layers(weights, x, run_layer)
    return lm_head(cfg, weights, x), new_k, new_v, routing
