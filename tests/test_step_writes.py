"""A decode step whose caches the native write takes stores its own rows, in the same
compiled call (forward.decode_sampled, kv_writes.write_rows_traced): the same tokens,
logits and cache bytes as the step and the write as two calls, and no copy of a cache in
the compiled step."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from motet.model import forward, kv_writes, native
from motet.model.kv import KVGeometry, init_kv

pytestmark = pytest.mark.skipif(not native.available(), reason="the native kernels were not built")

GEO = KVGeometry(n_slots=3, max_context=128, chunk=64)
ROWS = 2


def steps(model, kv_dtype: str, in_one_call: bool):
    """Five steps of two rows (one chained from the step before): each step's packed
    output, the last logits, and every cache's bytes."""
    cfg = model.config
    k, v = init_kv(cfg, GEO, kv_dtype)
    carry = forward.empty_carry(GEO.scratch_slot + 1)
    packed_steps = []
    for i in range(5):
        tokens = np.array([3 + i, 11], np.int32)
        slots = np.array([0, 2], np.int32)
        positions = np.array([i, 70 + i], np.int32)  # the second row past a block of K
        chained = np.array([i > 0, False])
        args = (tokens, slots, positions, forward.greedy_sampling(ROWS), np.bool_(True), carry, chained)
        if in_one_call:
            k, v, packed, carry, logits, _ = forward.decode_sampled(model.weights, k, v, *args, cfg=cfg)
        else:
            new_k, new_v, packed, carry, logits, _ = forward._decode_sampled(model.weights, k, v, *args, cfg=cfg,
                                                                             moe_impl="auto", mesh=None)
            k, v = kv_writes.write_rows(k, v, new_k, new_v, slots, positions)
        packed_steps.append(np.asarray(packed))
    return packed_steps, np.asarray(logits), [np.asarray(a).view(np.uint8) for a in jax.tree.leaves((k, v))]


@pytest.mark.parametrize("kv_dtype", ["float16", "float32", "int8"])
def test_one_call_equals_the_step_and_the_write_apart(default_model, kv_dtype):
    assert kv_writes.writes_in_step(init_kv(default_model.config, GEO, kv_dtype)[0])
    one = steps(default_model, kv_dtype, in_one_call=True)
    two = steps(default_model, kv_dtype, in_one_call=False)
    for a, b in zip(one[0], two[0]):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(one[1], two[1])
    assert len(one[2]) == len(two[2])
    for a, b in zip(one[2], two[2]):
        np.testing.assert_array_equal(a, b)
    assert any(a.any() for a in one[2])  # the rows were stored


@pytest.mark.parametrize("kv_dtype", ["float16", "int8"])
def test_the_compiled_step_copies_no_cache(default_model, kv_dtype):
    """The write runs after the sampled tokens, so no layer's attention reads a cache the
    write has replaced: a write left free to run earlier made XLA copy caches (four, in
    the default model's step, when this was written)."""
    k, v = init_kv(default_model.config, GEO, kv_dtype)
    text = forward.lower_decode_sampled(default_model.weights, k, v, ROWS, cfg=default_model.config).compile().as_text()
    assert "motet_kv_write" in text  # the step stores its rows itself
    shapes = {"[" + ",".join(map(str, a.shape)) + "]" for a in jax.tree.leaves((k, v))}
    copies = [line for line in text.splitlines()
              if " copy(" in line and any(shape in line.split("=", 1)[1][:80] for shape in shapes)]
    assert copies == []
