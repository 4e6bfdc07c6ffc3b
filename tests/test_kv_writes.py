"""The native KV write (kernels/kv_write.cc) stores a step's new rows exactly as XLA's
write does (kv_writes._write_rows_xla, _write_chunk_xla): every byte of every layer's
caches, for float32, half and bfloat16 caches, halves rounded with F16C and without, and
for 8-bit caches their values and scales."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from motet.model import kv_quant, kv_writes, native
from motet.model.kv_layout import KEY_BLOCK, keys_in_blocks, keys_in_order

pytestmark = pytest.mark.skipif(not native.available(), reason="the native kernels were not built")

LAYERS, SLOTS, HEADS, DIM, CAPACITY = 3, 5, 2, 8, 2 * KEY_BLOCK
CACHE_TYPES = [jnp.float32, jnp.float16, jnp.bfloat16]


def caches(dtype, seed: int):
    """K (in blocks, kv_layout.py) and V of every layer, host arrays of `dtype`."""
    rng = np.random.default_rng(seed)
    k = [keys_in_blocks(rng.standard_normal((SLOTS, HEADS, DIM, CAPACITY)).astype(np.float32)) for _ in range(LAYERS)]
    v = [rng.standard_normal((SLOTS, HEADS, CAPACITY, DIM)).astype(np.float32) for _ in range(LAYERS)]
    return [np.asarray(jnp.asarray(a, dtype)) for a in k], [np.asarray(jnp.asarray(a, dtype)) for a in v]


def awkward(shape, seed: int) -> np.ndarray:
    """Values that test rounding: ordinary ones, ties, half's subnormals and overflow,
    bfloat16's ties, infinities and NaN."""
    rng = np.random.default_rng(seed)
    values = rng.standard_normal(shape).astype(np.float32) * rng.choice([1e-7, 1e-3, 1.0, 1e3, 1e5], shape)
    special = np.array([np.nan, np.inf, -np.inf, 65504.0, 65520.0, 65519.99, 2.0**-24, 2.0**-25, 3 * 2.0**-26,
                        1.0 + 2.0**-11, 1.0 + 3 * 2.0**-11, 1.0 + 2.0**-8, -0.0, 6.1e-5], np.float32)
    flat = values.reshape(-1)
    flat[: min(flat.size, special.size)] = special[: flat.size]
    return values


def both(write_native, write_xla, dtype, seed: int):
    """Both writes from identical caches: their caches as bytes."""
    outs = []
    for write in (write_native, write_xla):
        k, v = caches(dtype, seed)
        new_k, new_v = write([jnp.asarray(a) for a in k], [jnp.asarray(a) for a in v])
        outs.append([np.asarray(a).view(np.uint8) for a in new_k + new_v])
    return outs


@pytest.mark.parametrize("dtype", CACHE_TYPES, ids=lambda t: jnp.dtype(t).name)
def test_a_chunk_is_written_as_xla_writes_it(dtype, isa):
    tokens = 16
    # one across a block of K; the last: a padded chunk's tail dropped
    for offset in (0, 10, KEY_BLOCK - 6, CAPACITY - tokens, CAPACITY - 6):
        new_k = [jnp.asarray(awkward((HEADS, DIM, tokens), offset + i)) for i in range(LAYERS)]
        new_v = [jnp.asarray(awkward((HEADS, tokens, DIM), 50 + offset + i)) for i in range(LAYERS)]
        ours, xla = both(
            lambda k, v: kv_writes._write_native(k, v, new_k, new_v, jnp.int32(2), jnp.int32(offset), chunk=True),
            lambda k, v: kv_writes._write_chunk_xla(k, v, new_k, new_v, 2, offset), dtype, offset)
        for layer, (a, b) in enumerate(zip(ours, xla)):
            np.testing.assert_array_equal(a, b, err_msg=f"offset {offset}, cache {layer}")


@pytest.mark.parametrize("dtype", CACHE_TYPES, ids=lambda t: jnp.dtype(t).name)
def test_decode_rows_are_written_as_xla_writes_them(dtype, isa):
    slots, positions = np.array([0, 3, 1, 4], np.int32), np.array([0, CAPACITY - 1, 7, 12], np.int32)
    new_k = [jnp.asarray(awkward((4, HEADS, DIM), i)) for i in range(LAYERS)]
    new_v = [jnp.asarray(awkward((4, HEADS, DIM), 9 + i)) for i in range(LAYERS)]
    ours, xla = both(lambda k, v: kv_writes._write_native(k, v, new_k, new_v, slots, positions, chunk=False),
                     lambda k, v: kv_writes._write_rows_xla(k, v, new_k, new_v, slots, positions), dtype, 1)
    for layer, (a, b) in enumerate(zip(ours, xla)):
        np.testing.assert_array_equal(a, b, err_msg=f"cache {layer}")


def test_the_public_writes_take_the_native_call_on_one_cpu_device():
    k, v = caches(jnp.float16, 0)
    k, v = [jnp.asarray(a) for a in k], [jnp.asarray(a) for a in v]
    rows = [jnp.zeros((1, HEADS, DIM), jnp.float32)] * LAYERS
    assert kv_writes._native(k, rows)
    assert not kv_writes._native(k, [r.astype(jnp.bfloat16) for r in rows])  # rows not float32: XLA's write
    k, v = kv_writes.write_rows(k, v, rows, rows, np.array([2], np.int32), np.array([5], np.int32))
    k0 = keys_in_order(np.asarray(k[0], np.float32))
    assert not k0[2, :, :, 5].any() and k0[1, :, :, 5].any()


def test_a_write_of_the_wrong_shape_is_refused():
    k, v = caches(jnp.float32, 0)
    wrong = [jnp.zeros((1, HEADS + 1, DIM), jnp.float32)] * LAYERS
    with pytest.raises(Exception, match="do not fit"):
        kv_writes._write_native([jnp.asarray(a) for a in k], [jnp.asarray(a) for a in v], wrong, wrong,
                                np.array([0], np.int32), np.array([0], np.int32), chunk=False)


def scaled_caches(kind: str, seed: int):
    """8-bit caches (kv_quant.py) of random values, as device arrays."""
    k, v = caches(jnp.float32, seed)

    def keys(a):  # quantized along head_dim in order, then put back in blocks
        values, scales = kv_quant.quantize(jnp.asarray(keys_in_order(a)), kind, axis=2)
        return kv_quant.QuantizedCache(keys_in_blocks(values), scales)

    return ([keys(a) for a in k],
            [kv_quant.QuantizedCache(*kv_quant.quantize(jnp.asarray(a), kind, axis=3)) for a in v])


def ordinary(shape, seed: int) -> np.ndarray:
    """Values of many magnitudes, and a zero vector (a zero scale)."""
    rng = np.random.default_rng(seed)
    values = rng.standard_normal(shape).astype(np.float32) * rng.choice([1e-7, 1e-3, 1.0, 1e3, 1e5], shape)
    values.reshape(-1)[: shape[-1]] = 0.0
    return values


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_an_8_bit_cache_is_written_as_xla_writes_it(kind, isa):
    """Values and scales, byte for byte: a chunk (its padded tail dropped) and decode rows."""
    tokens = 16
    rows_at = np.array([0, 3, 1, 4], np.int32), np.array([0, CAPACITY - 1, 7, 12], np.int32)
    cases = [(True, (HEADS, DIM, tokens), (HEADS, tokens, DIM), (jnp.int32(2), jnp.int32(offset)))
             for offset in (0, CAPACITY - 6)] + [(False, (4, HEADS, DIM), (4, HEADS, DIM), rows_at)]
    for seed, (chunk, k_shape, v_shape, where) in enumerate(cases):
        new_k = [jnp.asarray(ordinary(k_shape, seed * 10 + i)) for i in range(LAYERS)]
        new_v = [jnp.asarray(ordinary(v_shape, seed * 10 + 5 + i)) for i in range(LAYERS)]
        xla = kv_writes._write_chunk_xla if chunk else kv_writes._write_rows_xla
        outs = []
        for write in (lambda k, v: kv_writes._write_scaled(k, v, new_k, new_v, *where, chunk=chunk),
                      lambda k, v: xla(k, v, new_k, new_v, *where)):
            k, v = write(*scaled_caches(kind, seed))
            outs.append([np.asarray(leaf).view(np.uint8) for c in k + v for leaf in (c.values, c.scales)])
        for i, (a, b) in enumerate(zip(*outs)):
            np.testing.assert_array_equal(a, b, err_msg=f"case {seed}, array {i}")


def test_the_public_writes_take_the_native_call_for_an_8_bit_cache():
    k, v = scaled_caches("int8", 0)
    rows = [jnp.ones((1, HEADS, DIM), jnp.float32)] * LAYERS
    assert kv_writes._native(k, rows)
    k, v = kv_writes.write_rows(k, v, rows, rows, np.array([2], np.int32), np.array([5], np.int32))
    assert (keys_in_order(np.asarray(k[0].values))[2, :, :, 5] == 127).all()
    assert (np.asarray(k[0].scales[2, :, 5]) == 1 / 127).all()


# ---- a new cache's zeros (kv_writes.cache_zeros) -------------------------------------------

@pytest.mark.parametrize("dtype", [*CACHE_TYPES, jnp.int8, jnp.uint8])
@pytest.mark.parametrize("shape", [(3,), (5, 2, 1000, 3), (17, 4, 64, 768)])
def test_a_new_cache_is_zeros_to_its_last_byte(dtype, shape):
    """Whole pages handed back, partial ones at the ends zeroed: every byte reads 0,
    whatever the size (less than a page; pages and a part; whole ones)."""
    cache = kv_writes.cache_zeros(shape, dtype)
    assert cache.shape == shape and cache.dtype == jnp.dtype(dtype)
    assert not np.asarray(cache).view(np.uint8).any()


# A fresh interpreter makes a 512 MB cache and writes into the first of its 16 slots:
# how much its resident set grew at each step.
UNTOUCHED = """
import json, psutil, numpy as np, jax, jax.numpy as jnp
from motet.model import kv_writes
def mb():
    return psutil.Process().memory_info().rss / 2**20
jnp.zeros(4).block_until_ready()
start = mb()
cache = kv_writes.cache_zeros((16, 4, 4096, 1024), jnp.float32).block_until_ready()
made = mb() - start
cache = jax.jit(lambda c: c.at[0].set(1.0), donate_argnums=0)(cache).block_until_ready()  # in place
print(json.dumps({"made_mb": made, "written_mb": mb() - start, "sum": float(cache[0, 0, 0, :4].sum())}))
"""


def test_a_new_caches_pages_count_once_written():
    import json
    import subprocess
    import sys

    out = json.loads(subprocess.run([sys.executable, "-c", UNTOUCHED], capture_output=True, text=True,
                                    check=True).stdout)
    assert out["sum"] == 4.0
    assert out["made_mb"] < 64  # XLA's zeros: all 512 MB at once
    assert 24 < out["written_mb"] < 128  # one slot of 16 (32 MB) written, in place


# A fresh interpreter makes caches of 8 layers, 2 slots of 1024 positions (8 MB of K a
# slot), and writes one decode row into slot 0: how much its resident set grew.
FIRST_ROW = """
import json, types, psutil, numpy as np, jax.numpy as jnp
from motet.model import kv_writes
from motet.model.kv import KVGeometry, init_kv
def mb():
    return psutil.Process().memory_info().rss / 2**20
cfg = types.SimpleNamespace(n_layers=8, n_kv_heads=4, head_dim=64)
k, v = init_kv(cfg, KVGeometry(n_slots=1, max_context=1024, chunk=256))
rows = [jnp.ones((1, 4, 64), jnp.float32)] * 8
slot, position = np.array([0], np.int32), np.array([0], np.int32)
kv_writes.write_rows(k, v, rows, rows, slot, position)  # compiled, and the first pages
k, v = init_kv(cfg, KVGeometry(n_slots=1, max_context=1024, chunk=256))
start = mb()
k, v = kv_writes.write_rows(k, v, rows, rows, slot, position)
k[0].block_until_ready()
print(json.dumps({"grew_mb": mb() - start}))
"""


def test_a_slots_first_row_touches_its_first_block_of_k_only():
    """K in blocks of positions (kv_layout.py): one row's write touches a block a layer
    and head (0.5 MB in all here), where K held position last touched the slot's whole K
    (8 MB: a page in every dimension's run of positions)."""
    import json
    import subprocess
    import sys

    out = json.loads(subprocess.run([sys.executable, "-c", FIRST_ROW], capture_output=True, text=True,
                                    check=True).stdout)
    assert out["grew_mb"] < 2


# ---- a prefix copied between slots (kv_writes.copy_positions) ------------------------------

@pytest.mark.parametrize("scaled", [False, True])
@pytest.mark.parametrize("positions", [0, 7, KEY_BLOCK + 3, CAPACITY, CAPACITY + 5])
def test_a_prefix_copy_takes_its_positions_and_leaves_the_rest(scaled, positions):
    """Slot 1's first `positions` positions over slot 3's in every layer: K's blocks
    that hold them, V's positions and an 8-bit cache's scales; slot 3's later positions
    and every other slot as they were."""
    k, v = caches(jnp.float16, seed=5)
    if scaled:
        rng = np.random.default_rng(6)
        k = [kv_quant.QuantizedCache(a.astype(np.int8), rng.standard_normal((SLOTS, HEADS, CAPACITY), np.float32))
             for a in k]
        v = [kv_quant.QuantizedCache(a.astype(np.int8), rng.standard_normal((SLOTS, HEADS, CAPACITY), np.float32))
             for a in v]

    def arrays(layers):  # values (K in order), then an 8-bit cache's scales
        def ordered(a):
            return keys_in_order(a) if a.ndim == 5 else a

        if not scaled:
            return [ordered(np.asarray(a)) for a in layers]
        return [ordered(np.asarray(a)) for layer in layers for a in (layer.values, layer.scales)]

    def device(layers):
        if scaled:
            return [kv_quant.QuantizedCache(jnp.asarray(a.values), jnp.asarray(a.scales)) for a in layers]
        return [jnp.asarray(a) for a in layers]

    before = arrays(k) + arrays(v)
    new_k, new_v = kv_writes.copy_positions(device(k), device(v), 1, 3, positions)
    n = min(positions, CAPACITY)
    for i, (old, new) in enumerate(zip(before, arrays(new_k) + arrays(new_v))):
        is_k = i < len(before) // 2
        is_k_values = is_k and (not scaled or i % 2 == 0)
        axis = 3 if is_k_values else 2  # K [s, h, d, positions], V [s, h, positions, d], scales [s, h, positions]
        expected = old.copy()
        window = [slice(None)] * old.ndim
        window[axis] = slice(0, -(-n // KEY_BLOCK) * KEY_BLOCK if is_k_values else n)
        expected[(3, *window[1:])] = old[(1, *window[1:])]
        np.testing.assert_array_equal(new, expected)
