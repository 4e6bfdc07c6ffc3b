"""The native attention kernels (kernels/attend_body.inc) compute what XLA computes
(attention._attend_rows_xla for decode, attention._attend_chunk_xla for prefill), on every
instruction set this CPU has, for the head layouts motet's models use."""

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from motet.model import kv_quant, native
from motet.model.attention import ATTN_BLOCK, attend_chunk, attend_rows
from motet.model.kv_layout import keys_in_blocks

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


def blocked(k_cache):
    """A K cache these cases build and change in order ([slots, kv_heads, head_dim,
    capacity]) as the engine holds it, in blocks (kv_layout.py)."""
    if k_cache is None:
        return None
    if kv_quant.quantized(k_cache):
        return kv_quant.QuantizedCache(keys_in_blocks(k_cache.values), k_cache.scales)
    return keys_in_blocks(k_cache)


def held(args):
    """A case's arguments with its K cache (argument 3) as the engine holds it."""
    return (*args[:3], blocked(args[3]), *args[4:])


def both(cfg, args):
    kernel = jax.jit(lambda *a: attend_rows(cfg, *a, use_native=True))(*held(args))
    xla = jax.jit(lambda *a: attend_rows(cfg, *a, use_native=False))(*held(args))
    return np.asarray(kernel), np.asarray(xla)


# (KV heads, query heads per KV head, head dim): the default model's, the tiny golden
# models', a head dim that is no multiple of a vector, one query head per KV head, and
# more query heads than the kernel keeps in registers at once (Qwen3-MoE's 32 over 4)
SHAPES = [(3, 3, 64), (2, 2, 16), (1, 4, 24), (4, 1, 32), (2, 8, 32)]


@pytest.mark.parametrize("shape", SHAPES)
def test_the_kernel_equals_the_xla_loops(isa, shape):
    capacity = 3 * ATTN_BLOCK
    # no history, one position, a block and a bit, positions not a multiple of any vector
    cfg, args = case(*shape, capacity=capacity, slots=5, positions=[0, 1, 7, 257, 300, 599])
    kernel, xla = both(cfg, args)
    assert kernel.shape == xla.shape == (6, shape[0] * shape[1] * shape[2])
    np.testing.assert_allclose(kernel, xla, atol=2e-6, rtol=1e-5)


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


def sixteen_bit(args, dtype):
    """The caches (arguments 3 and 4) in a 16-bit type, the rest as they are."""
    return tuple(jnp.asarray(a, dtype) if i in (3, 4) else a for i, a in enumerate(args))


def eight_bit(args, kind):
    """The caches (arguments 3 and 4) quantized to an 8-bit cache, the rest as they are."""
    k, v = args[3], args[4]
    k_cache = kv_quant.QuantizedCache(*kv_quant.quantize(jnp.asarray(k), kind, axis=2))
    v_cache = kv_quant.QuantizedCache(*kv_quant.quantize(jnp.asarray(v), kind, axis=3))
    return (*args[:3], k_cache, v_cache, *args[5:])


def narrow(args, dtype):
    """The caches (arguments 3 and 4) as a 16-bit or an 8-bit cache, the rest as they are."""
    if dtype in ("int8", "fp8"):
        return eight_bit(args, dtype)
    return sixteen_bit(args, dtype)


# the default model's heads, and a head dim that is no multiple of a vector (the
# one-at-a-time widening); an 8-bit cache is widened and scaled as read
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, "int8", "fp8"],
                         ids=["float16", "bfloat16", "int8", "fp8"])
@pytest.mark.parametrize("shape", [(3, 3, 64), (1, 4, 24)])
def test_a_narrow_cache_is_read_as_xla_reads_it(isa, shape, dtype):
    """Decode, and prefill over a history, by both paths alike."""
    cfg, args = case(*shape, capacity=3 * ATTN_BLOCK, slots=5, positions=[0, 1, 7, 257, 300, 599])
    args = narrow(args, dtype)
    assert native.ATTEND_ROWS in jax.jit(lambda *a: attend_rows(cfg, *a)).lower(*held(args)).as_text()
    kernel, xla = both(cfg, args)
    np.testing.assert_allclose(kernel, xla, atol=2e-6, rtol=1e-5)
    for tokens, offset in ((37, 0), (5, 599)):
        _, q, k, v, caches = chunk_case(*shape, tokens, True, seed=tokens)
        _, _, _, k_cache, v_cache = narrow((None, None, None, *caches), dtype)
        kernel, xla = chunk_both(cfg, q, k, v, (k_cache, v_cache), 2, offset)
        np.testing.assert_allclose(kernel, xla, atol=2e-6, rtol=1e-5)


def test_a_16_bit_cache_loses_only_its_rounding():
    """Against the float32 cache the 16-bit one was rounded from: float16's 11 bits keep
    attention's output within about 1e-3; bfloat16's 8 within about 1e-2."""
    cfg, args = case(3, 3, 64, capacity=3 * ATTN_BLOCK, slots=5, positions=[7, 300, 599])
    exact, _ = both(cfg, args)
    for dtype, tolerance in ((jnp.float16, 2e-3), (jnp.bfloat16, 2e-2)):
        rounded, _ = both(cfg, sixteen_bit(args, dtype))
        error = np.abs(rounded - exact).max() / np.abs(exact).max()
        assert 0 < error < tolerance, (dtype, error)


def test_queries_that_are_not_float32_take_the_xla_path():
    """A bfloat16 model's queries (and its bfloat16 cache) stay on XLA: the kernel takes
    float32 queries only."""
    cfg, args = case(2, 2, 16, capacity=ATTN_BLOCK, slots=2, positions=[3])
    args = tuple(jnp.asarray(a, jnp.bfloat16) if a.dtype == np.float32 else a for a in args)
    lowered = jax.jit(lambda *a: attend_rows(cfg, *a)).lower(*held(args)).as_text()
    assert native.ATTEND_ROWS not in lowered
    f32 = tuple(jnp.asarray(a, jnp.float32) if a.dtype == jnp.bfloat16 else a for a in args)
    assert native.ATTEND_ROWS in jax.jit(lambda *a: attend_rows(cfg, *a)).lower(*held(f32)).as_text()
    # prefill likewise
    def chunk(*a):
        return jax.jit(lambda *a: attend_chunk(cfg, *a)).lower(*held(a)).as_text()

    assert native.ATTEND_CHUNK not in chunk(*args[:5], 1, 3)
    assert native.ATTEND_CHUNK in chunk(*f32[:5], 1, 3)


def chunk_case(kv_heads, group, head_dim, tokens, history: bool, seed=0):
    rng = np.random.default_rng(seed)
    cfg = SimpleNamespace(n_kv_heads=kv_heads, group_size=group, head_dim=head_dim)
    capacity = 3 * ATTN_BLOCK
    q = rng.standard_normal((tokens, kv_heads * group, head_dim)).astype(np.float32)
    k, v = (rng.standard_normal((tokens, kv_heads, head_dim)).astype(np.float32) for _ in range(2))
    caches = (rng.standard_normal((3, kv_heads, head_dim, capacity)).astype(np.float32),
              rng.standard_normal((3, kv_heads, capacity, head_dim)).astype(np.float32)) if history else (None, None)
    return cfg, q, k, v, caches


def chunk_both(cfg, q, k, v, caches, slot, offset):
    def run(native_):
        def attend(q, k, v, k_cache, v_cache, slot, offset):
            return attend_chunk(cfg, q, k, v, k_cache, v_cache, slot, offset, use_native=native_)

        return np.asarray(jax.jit(attend)(q, k, v, blocked(caches[0]), caches[1], slot, offset))

    return run(True), run(False)


@pytest.mark.parametrize("shape", SHAPES)
def test_the_prefill_kernel_equals_xla(isa, shape):
    # a fresh prompt; a chunk after a history shorter and longer than an attention
    # block; a short chunk at the end of the context; chunks whose own keys the kernel
    # blocks as the cache does, over three blocks and into a part of one
    cases = ((16, False, 0), (37, True, 0), (64, True, 300), (5, True, 599), (150, False, 0), (100, True, 250))
    for tokens, history, offset in cases:
        cfg, q, k, v, caches = chunk_case(*shape, tokens, history, seed=tokens)
        kernel, xla = chunk_both(cfg, q, k, v, caches, 2, offset)
        assert kernel.shape == xla.shape == (tokens, shape[0] * shape[1] * shape[2])
        np.testing.assert_allclose(kernel, xla, atol=2e-6, rtol=1e-5)


def test_a_chunk_reads_only_its_slots_history_and_its_own_earlier_tokens():
    cfg, q, k, v, (k_cache, v_cache) = chunk_case(3, 3, 64, 20, True)
    before, _ = chunk_both(cfg, q, k, v, (k_cache, v_cache), 1, 100)
    k_cache, v_cache = k_cache.copy(), v_cache.copy()
    k_cache[[0, 2]], v_cache[[0, 2]] = 1e3, 1e3  # the other slots
    k_cache[1, :, :, 100:], v_cache[1, :, 100:] = 1e3, 1e3  # past the history
    after, _ = chunk_both(cfg, q, k, v, (k_cache, v_cache), 1, 100)
    np.testing.assert_array_equal(after, before)
    k2, v2 = k.copy(), v.copy()
    k2[10:], v2[10:] = 1e3, 1e3  # later tokens of the chunk: the first ten do not see them
    changed, _ = chunk_both(cfg, q, k2, v2, (k_cache, v_cache), 1, 100)
    np.testing.assert_array_equal(changed[:10], before[:10])


def test_an_8_bit_cache_loses_only_its_rounding():
    """Against the float32 cache it was quantized from (and the rows' own K and V rounded
    as the cache holds them): int8's 255 steps a vector keep attention's output within
    1e-2 of its largest value (measured 6e-3); fp8's 3 mantissa bits within 1e-1
    (measured 5e-2)."""
    cfg, args = case(3, 3, 64, capacity=3 * ATTN_BLOCK, slots=5, positions=[7, 300, 599])
    exact, _ = both(cfg, args)
    for kind, tolerance in (("int8", 1e-2), ("fp8", 1e-1)):
        rounded, _ = both(cfg, eight_bit(args, kind))
        error = np.abs(rounded - exact).max() / np.abs(exact).max()
        assert 0 < error < tolerance, (kind, error)
