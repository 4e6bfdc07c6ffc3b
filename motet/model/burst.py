"""Several sampled decode steps in one compiled call: a burst.

A one-row step of the MoE Q4_K_M file computes in about 4 ms on two cores; its dispatch
(a microsecond for each of its few hundred arguments, and XLA's set-up) and the
engine's hand-off to the device thread cost the dispatching thread about a millisecond
more, which on two cores the kernels wait for (docs/performance.md). A burst runs
`steps` sampled steps in a loop inside one call: every step after the first feeds the
token the step before it sampled, at the next position (the chained rows of
forward.decode_sampled, through the same carry), stores its own K and V rows, and
leaves its packed output in row `i` of the result. Its tokens are the single steps'
bit for bit (tests/test_burst.py).

Bursts are for rows that sample plainly (no penalty, bias or grammar: those need the
host between tokens) and for one-row steps only (BURST_ROWS): each batch size a burst
serves is another compiled step, and at many rows the dispatch is a small part of a
step. Single steps keep forward.decode_sampled's executable: the loop run once, carrying
the logits a penalized row's second sampling needs, was about 7% slower (a throwaway
A/B), and a burst's loop keeps none.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from .forward import empty_carry, greedy_sampling, sampled_step
from .generate import chained_rows, unpack_decode
from .kv import KVGeometry
from .kv_writes import writes_in_step
from .model import Model
from .sampling import SAMPLED_WIDTH
from .sharding import mesh_of

BURST_ROWS = 1  # the padded batch bursts are compiled for


def bursts_run(weights, k_cache) -> bool:
    """Whether a burst can run over these weights and caches: the loop stores each
    step's rows with the native write, on one CPU device (kv_writes.writes_in_step)."""
    return mesh_of(weights) is None and writes_in_step(k_cache)


@partial(jax.jit, static_argnames=("cfg", "moe_impl", "most"), donate_argnums=(1, 2))
def _burst(weights, k_cache, v_cache, tokens, slots, positions, sampling, want_top, carry, chained, steps, *,
           cfg, moe_impl, most):
    width = SAMPLED_WIDTH + sum(cfg.moe_layers) * cfg.n_experts_per_tok
    packed = jnp.zeros((most, tokens.shape[0], width), jnp.int32)

    def step(i, state):
        k, v, carry, packed = state
        k, v, drawn, carry, _, _ = sampled_step(weights, k, v, tokens, slots, positions + i, sampling, want_top,
                                                 carry, chained | (i > 0), cfg=cfg, moe_impl=moe_impl, mesh=None,
                                                 write=True)
        return k, v, carry, packed.at[i].set(drawn)

    k, v, carry, packed = jax.lax.fori_loop(0, steps, step, (k_cache, v_cache, carry, packed))
    return k, v, packed, carry


def decode_burst(weights, k_cache, v_cache, tokens, slots, positions, sampling, want_top, carry, chained, steps: int,
                 *, most: int, cfg, moe_impl="auto"):
    """`steps` (1 to `most`) of forward.decode_sampled in one call, each row's token
    and key after the first step taken from the step before it on the device; the
    arguments are decode_sampled's for the first step. The caches are donated.
    Returns (the K caches, the V caches, [most, b, width] int32 whose first `steps`
    rows are each step's packed output as decode_sampled returns it, the carry)."""
    if not 1 <= steps <= most:
        raise ValueError(f"a burst takes 1 to {most} steps, got {steps}")
    return _burst(weights, k_cache, v_cache, tokens, slots, positions, sampling, want_top, carry, chained,
                  np.int32(steps), cfg=cfg, moe_impl=moe_impl, most=most)


def lower_decode_burst(weights, k_cache, v_cache, batch: int, *, most: int, cfg, moe_impl="auto"):
    """decode_burst for a padded batch of `batch` rows, traced and lowered (as
    forward.lower_decode_sampled)."""
    rows = jax.device_put(np.zeros(batch, np.int32))
    return _burst.trace(weights, k_cache, v_cache, rows, rows, rows, greedy_sampling(batch), np.bool_(False),
                        empty_carry(k_cache[0].shape[0]), np.zeros(batch, np.bool_), np.int32(1), cfg=cfg,
                        moe_impl=moe_impl, most=most).lower()


def dispatch_burst(model: Model, kv, geo: KVGeometry, tokens: Sequence[int], slots: Sequence[int],
                   positions: Sequence[int], sampling, want_top: bool, carry, chained: Sequence[bool], steps: int,
                   most: int):
    """generate.dispatch_decode for `steps` steps in one call (positions: each row's
    first). Returns (the packed outputs on the device, for read_burst; the kv; the carry)."""
    tok, slot, pos, link = chained_rows(geo, tokens, slots, positions, chained)
    k, v = kv
    k, v, packed, carry = decode_burst(model.weights, k, v, tok, slot, pos, sampling, np.bool_(want_top), carry, link,
                                       steps, most=most, cfg=model.config)
    return packed, (k, v), carry


def read_burst(model: Model, packed, rows: int, steps: int) -> list[tuple]:
    """A dispatched burst's output read back (waiting for it): per step, what
    generate.read_decode returns for a single step."""
    host = np.asarray(packed)
    return [unpack_decode(model.config, host[i], rows) for i in range(steps)]
