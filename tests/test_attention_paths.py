"""The attention forms for GPUs (each row, or a chunk, reading its slot's whole cache
under a mask) compute what the CPU's block loops compute, over every cache type. On a
CPU they are not what runs, so they are called here directly."""

from functools import partial

import jax
import numpy as np
import pytest
from test_native_attention import ATTN_BLOCK, blocked, case, chunk_case, held, narrow

from motet.model import attention


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "int8", "fp8"])
@pytest.mark.parametrize("shape", [(3, 3, 64), (2, 8, 32)])
def test_whole_cache_rows_equal_the_block_loops(shape, dtype):
    # no history, one position, a block and a bit, the last position (a cache holds
    # whole blocks: KVGeometry.length)
    cfg, args = case(*shape, capacity=3 * ATTN_BLOCK, slots=5, positions=[0, 1, 7, 257, 300, 3 * ATTN_BLOCK - 1])
    args = args if dtype == "float32" else narrow(args, getattr(jax.numpy, dtype, dtype))
    whole = jax.jit(partial(attention._attend_rows_whole, cfg))(*held(args))
    loops = jax.jit(partial(attention._attend_rows_xla, cfg))(*held(args))
    np.testing.assert_allclose(np.asarray(whole), np.asarray(loops), atol=2e-6, rtol=1e-5)


def test_whole_cache_rows_read_only_their_slot_and_positions():
    cfg, args = case(3, 3, 64, capacity=2 * ATTN_BLOCK, slots=3, positions=[100])
    run = jax.jit(partial(attention._attend_rows_whole, cfg))
    before = np.asarray(run(*held(args)))
    q, k, v, k_cache, v_cache, slots, positions = args
    k_cache, v_cache = k_cache.copy(), v_cache.copy()
    k_cache[1:], v_cache[1:] = 1e3, 1e3
    k_cache[0, :, :, 100:], v_cache[0, :, 100:] = 1e3, 1e3
    np.testing.assert_array_equal(np.asarray(run(q, k, v, blocked(k_cache), v_cache, slots, positions)), before)


@pytest.mark.parametrize("dtype", ["float32", "int8", "fp8"])
def test_a_whole_cache_chunk_equals_the_block_loop(dtype):
    for tokens, history, offset in ((16, False, 0), (37, True, 0), (64, True, 300), (5, True, 599)):
        cfg, q, k, v, caches = chunk_case(3, 3, 64, tokens, history, seed=tokens)
        if history and dtype != "float32":
            caches = narrow((None, None, None, *caches), dtype)[3:]
        runs = [jax.jit(partial(attention._attend_chunk_xla, cfg, whole=whole))(q, k, v, blocked(caches[0]), caches[1], 2, offset)
                for whole in (True, False)]
        np.testing.assert_allclose(np.asarray(runs[0]), np.asarray(runs[1]), atol=2e-6, rtol=1e-5)
