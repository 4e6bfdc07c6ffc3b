"""The native MoE kernel (kernels/moe.cc) computes a layer's routed experts as XLA's
grouped loop does (moe._experts_grouped_xla), for stacks in every layout pair a GGUF
file gives gate_up and down."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_quant import random_blocks

from motet.model import native
from motet.model.gguf_quants import REPACK
from motet.model.moe import experts_grouped
from motet.model.panel_layout import as_panels
from motet.model.quant import stack

pytestmark = pytest.mark.skipif(not native.available(), reason="the native kernels were not built")

EXPERTS, TOP_K = 6, 2


def stacks(gate_up_kind: str, down_kind: str, d: int, f: int):
    gate_up = stack([REPACK[gate_up_kind](random_blocks(gate_up_kind, 2 * f, d, seed=e)) for e in range(EXPERTS)])
    down = stack([REPACK[down_kind](random_blocks(down_kind, d, f, seed=10 + e)) for e in range(EXPERTS)])
    return jax.device_put(gate_up), jax.device_put(down)


def routing(tokens: int, d: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((tokens, d)).astype(np.float32)
    ids = np.stack([rng.permutation(EXPERTS)[:TOP_K] for _ in range(tokens)]).astype(np.int32)
    return x, rng.random((tokens, TOP_K)).astype(np.float32), ids


def both(x, weights, ids, gate_up, down):
    def run(native_):
        return jax.jit(lambda *a: experts_grouped(*a, block=1, use_native=native_))(x, weights, ids, gate_up, down)

    return np.asarray(run(True)), np.asarray(run(False))


# (gate_up, down, d, f): a Q4_1 file's pair, a Q4_K_M file's, and one of each layout the other way
PAIRS = [("Q4_1", "Q4_1", 128, 96), ("Q4_K", "Q6_K", 256, 256), ("Q8_0", "Q4_0", 128, 64), ("Q5_K", "Q8_0", 256, 256)]


@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: f"{p[0]}-{p[1]}")
def test_the_kernel_equals_the_xla_loop(pair):
    gate_up, down = stacks(*pair)
    for tokens in (1, 3, 16, 40):  # decode, batched decode, prefill (several rows an expert)
        kernel, xla = both(*routing(tokens, pair[2], seed=tokens), gate_up, down)
        assert kernel.shape == xla.shape == (tokens, pair[2])
        # one row a product runs with x in int16 (1e-4), more rows in float32
        assert np.abs(kernel - xla).max() / np.abs(xla).max() < 1e-4, tokens


@pytest.mark.parametrize("held", ["rows", "panels"])
def test_a_tokens_output_has_the_same_bits_wherever_it_lies_in_the_batch(panel_isa, held):
    """Each expert's product takes a row the same way at any place among its rows (rows:
    the integer pairs; panels: widened into them past 16 rows), and each token's
    weighted sum adds its experts in one order however the tokens are shared out over
    the threads (80 tokens: three units of kernels/moe.cc's sum)."""
    gate_up, down = stacks("Q4_K", "Q6_K", 256, 256)
    if held == "panels":
        gate_up, down = (jax.device_put(as_panels(jax.device_get(s))) for s in (gate_up, down))
    x, weights, ids = routing(80, 256, seed=7)
    run = jax.jit(lambda *a: experts_grouped(*a, block=1, use_native=True))
    forward = np.asarray(run(x, weights, ids, gate_up, down))
    backward = np.asarray(run(x[::-1], weights[::-1], ids[::-1], gate_up, down))
    np.testing.assert_array_equal(forward, backward[::-1])


def test_balanced_and_lopsided_routing_both_equal_the_xla_loop():
    """Many rows an expert, spread evenly (the experts then run side by side, one a
    thread) and gathered on one expert (its products are shared out instead)."""
    gate_up, down = stacks("Q4_K", "Q6_K", 256, 256)
    tokens = 60
    x, weights, _ = routing(tokens, 256, seed=5)
    balanced = np.stack([[t % EXPERTS, (t + 1) % EXPERTS] for t in range(tokens)]).astype(np.int32)
    lopsided = np.stack([[0, 1 + t % (EXPERTS - 1)] for t in range(tokens)]).astype(np.int32)
    for ids in (balanced, lopsided):
        kernel, xla = both(x, weights, ids, gate_up, down)
        assert np.abs(kernel - xla).max() / np.abs(xla).max() < 1e-4


def test_the_activation_holds_in_both_tails_in_every_instruction_set(isa):
    """silu's gate far below zero (where e^-g passes float32's range) and far above: the
    vector exponential of each instruction set, clamped, gives what XLA's silu gives."""
    gate_up, down = stacks("Q8_0", "Q8_0", 128, 64)
    for tokens in (1, 40):  # experts on threads of their own, and shared out
        x, weights, ids = routing(tokens, 128, seed=tokens)
        kernel, xla = both(x * 40, weights, ids, gate_up, down)
        assert np.isfinite(kernel).all()
        assert np.abs(kernel - xla).max() / np.abs(xla).max() < 1e-4, (isa, tokens)


def test_a_zero_weight_adds_nothing_and_an_expert_out_of_range_is_clamped():
    """A weight of 0 (a padding row, another pass's expert) adds nothing; an id past the
    stack (which routing never gives) reads its last expert, not memory past it."""
    gate_up, down = stacks("Q4_1", "Q8_0", 128, 64)
    x, weights, ids = routing(5, 128, seed=3)
    weights[0] = 0.0  # a padding row
    kernel, xla = both(x, weights, ids, gate_up, down)
    assert not kernel[0].any() and not xla[0].any()
    assert np.abs(kernel - xla).max() / np.abs(xla).max() < 1e-4
    past, last = ids.copy(), ids.copy()
    past[1, 0], last[1, 0] = EXPERTS + 4, EXPERTS - 1
    np.testing.assert_array_equal(both(x, weights, past, gate_up, down)[0], both(x, weights, last, gate_up, down)[0])


def test_float_stacks_and_sharded_layers_take_the_xla_loop():
    gate_up, down = stacks("Q4_1", "Q8_0", 128, 64)
    x, weights, ids = routing(2, 128)

    def lowered(gate_up, down, elsewhere=False):
        return jax.jit(lambda *a: experts_grouped(*a, block=1, elsewhere=elsewhere)).lower(
            x, weights, ids, gate_up, down).as_text()

    assert native.MOE_EXPERTS in lowered(gate_up, down)
    assert native.MOE_EXPERTS not in lowered(gate_up, down, elsewhere=True)
    floats = jnp.zeros((EXPERTS, 128, 128), jnp.float32), jnp.zeros((EXPERTS, 64, 128), jnp.float32)
    assert native.MOE_EXPERTS not in lowered(*floats)
