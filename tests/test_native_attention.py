"""The native decode-attention kernel (kernels/attend_body.inc) computes what XLA's loops
compute (forward._attend_rows_xla), on every instruction set this CPU has, for the head
layouts motet's models use."""

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from motet.model import native
from motet.model.forward import ATTN_BLOCK, attend_rows

pytestmark = pytest.mark.skipif(not native.available(), reason="the native kernels were not built")


def case(kv_heads: int, group: int, head_dim: int, capacity: int, slots: int, positions: list[int], seed=0):
    rng = np.random.default_rng(seed)
    b = len(positions)
    cfg = SimpleNamespace(n_kv_heads=kv_heads, group_size=group, head_dim=head_dim)
    arrays = (rng.standard_normal((b, kv_heads * group, head_dim)),  # q
              rng.standard_normal((b, kv_heads, head_dim)),  # the rows' new K
              rng.standard_normal((b, kv_heads, head_dim)),  # and V
              rng.standard_normal((slots, kv_heads, head_dim, capacity)),  # K cache, transposed
              rng.standard_normal((slots, kv_heads, capacity, head_dim)))  # V cache
    rows = np.arange(b, dtype=np.int32) % slots
    return cfg, (*(a.astype(np.float32) for a in arrays), rows, np.asarray(positions, np.int32))


def both(cfg, args):
    kernel = jax.jit(lambda *a: attend_rows(cfg, *a, use_native=True))(*args)
    xla = jax.jit(lambda *a: attend_rows(cfg, *a, use_native=False))(*args)
    return np.asarray(kernel), np.asarray(xla)


# (KV heads, query heads per KV head, head dim): the default model's, the tiny golden
# models', a head dim that is no multiple of a vector, and one query head per KV head
SHAPES = [(3, 3, 64), (2, 2, 16), (1, 4, 24), (4, 1, 32)]


@pytest.mark.parametrize("isa", native.INSTRUCTION_SETS)
@pytest.mark.parametrize("shape", SHAPES)
def test_the_kernel_equals_the_xla_loops(isa, shape):
    best = native.instruction_set()
    if not native.select_instruction_set(isa):
        pytest.skip(f"this CPU has no {isa}")
    try:
        capacity = 600 + ATTN_BLOCK
        # no history, one position, a block and a bit, positions not a multiple of any vector
        cfg, args = case(*shape, capacity=capacity, slots=5, positions=[0, 1, 7, 257, 300, 599])
        kernel, xla = both(cfg, args)
        assert kernel.shape == xla.shape == (6, shape[0] * shape[1] * shape[2])
        np.testing.assert_allclose(kernel, xla, atol=2e-6, rtol=1e-5)
    finally:
        native.select_instruction_set(best)


def test_a_row_without_history_attends_to_its_own_value_alone():
    cfg, args = case(2, 2, 16, capacity=ATTN_BLOCK, slots=2, positions=[0])
    kernel, _ = both(cfg, args)
    v_new = args[2]  # [1, kv heads, d]; each query head of a group gets its KV head's value
    np.testing.assert_allclose(kernel.reshape(1, 2, 2, 16), np.repeat(v_new[:, :, None], 2, axis=2), rtol=1e-6)


def test_only_the_rows_own_slot_and_positions_are_read():
    """Changing another slot, or this slot's positions at and past the row's position,
    changes nothing."""
    cfg, args = case(3, 3, 64, capacity=2 * ATTN_BLOCK, slots=3, positions=[100])
    before, _ = both(cfg, args)
    q, k, v, k_cache, v_cache, slots, positions = args
    k_cache, v_cache = k_cache.copy(), v_cache.copy()
    k_cache[1:], v_cache[1:] = 1e3, 1e3  # the other slots
    k_cache[0, :, :, 100:], v_cache[0, :, 100:] = 1e3, 1e3  # not yet this row's history
    after, _ = both(cfg, (q, k, v, k_cache, v_cache, slots, positions))
    np.testing.assert_array_equal(after, before)


def test_a_cache_that_is_not_float32_takes_the_xla_path():
    cfg, args = case(2, 2, 16, capacity=ATTN_BLOCK, slots=2, positions=[3])
    args = tuple(jnp.asarray(a, jnp.bfloat16) if a.dtype == np.float32 else a for a in args)
    lowered = jax.jit(lambda *a: attend_rows(cfg, *a)).lower(*args).as_text()
    assert native.ATTEND_ROWS not in lowered
    f32 = tuple(jnp.asarray(a, jnp.float32) if a.dtype == jnp.bfloat16 else a for a in args)
    assert native.ATTEND_ROWS in jax.jit(lambda *a: attend_rows(cfg, *a)).lower(*f32).as_text()
