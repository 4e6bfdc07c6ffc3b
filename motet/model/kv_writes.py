"""Storing a step's new K and V rows into the caches, in place (the caches donated).

The steps (forward.py) only read the caches and return the new rows: reading and
writing the same donated array in one step makes XLA copy the whole cache. On the CPU
the writes are one native call for every layer (kernels/kv_write.cc), where XLA's form
below was a few kernels a layer and cache, and its compiled writes (one a row count and
a chunk size) held twice the memory (benchmarks/kv_writes.py). An 8-bit cache's write
(kv_quant.py) quantizes the rows as it stores them, natively or in XLA, to the same
bytes. Caches spread over several devices (a mesh) take XLA's form, which its
partitioner splits.

A new cache's zeros are native too (cache_zeros): its pages then count in the process's
resident set only once a conversation writes them; and so is a prefix's copy from one
slot to another (copy_positions), which touches only the positions it copies.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from . import kv_quant, native
from .kv_layout import KEY_BLOCK

_CACHE_TYPES = (jnp.float32, jnp.float16, jnp.bfloat16)


def cache_zeros(shape: tuple[int, ...], dtype, sharding=None) -> jax.Array:
    """A zeroed cache array (values or scales). On the CPU the native call makes it
    (kernels/kv_copy.cc), handing its whole pages back to the system: they read as
    zeros, and count in the resident set once written, so slots and positions no
    conversation reached cost no memory. Elsewhere, and spread over a mesh, XLA's."""
    if sharding is None and native.available() and jax.default_backend() == "cpu":
        return _untouched_zeros(tuple(shape), jnp.dtype(dtype))
    return jnp.zeros(shape, dtype, device=sharding)


@partial(jax.jit, static_argnums=(0, 1))
def _untouched_zeros(shape, dtype):
    return jax.ffi.ffi_call(native.KV_ZEROS, jax.ShapeDtypeStruct(shape, dtype))()


def copy_positions(k_cache, v_cache, source, target, positions):
    """Slot `source`'s first `positions` positions over slot `target`'s, in every layer,
    in place (the caches donated), by the native call: caches where on_one_cpu.
    Returns the caches."""
    return _copy_native(k_cache, v_cache, np.array([source, target, positions], np.int32))


@partial(jax.jit, donate_argnums=(0, 1))
def _copy_native(k_cache, v_cache, where):
    layers = len(k_cache)
    if kv_quant.quantized(k_cache[0]):
        caches = [c.values for c in [*k_cache, *v_cache]] + [c.scales for c in [*k_cache, *v_cache]]
    else:
        caches = [*k_cache, *v_cache]
    call = jax.ffi.ffi_call(native.KV_COPY, [jax.ShapeDtypeStruct(c.shape, c.dtype) for c in caches],
                            input_output_aliases={1 + i: i for i in range(len(caches))})
    out = call(where, *caches, layers=layers)
    if kv_quant.quantized(k_cache[0]):
        k = [kv_quant.QuantizedCache(out[i], out[2 * layers + i]) for i in range(layers)]
        return k, [kv_quant.QuantizedCache(out[layers + i], out[3 * layers + i]) for i in range(layers)]
    return list(out[:layers]), list(out[layers:])


def write_chunk(k_cache, v_cache, new_k, new_v, slot, offset):
    """Store a prefilled chunk (K [k, d, t], V [k, t, d] per layer) at `offset` in
    `slot`. A padded chunk may reach past the cache's last position (the cache holds the
    context, not a chunk more): those rows are dropped. Returns the caches."""
    if _native(k_cache, new_k):
        write = _write_scaled if kv_quant.quantized(k_cache[0]) else _write_native
        return write(k_cache, v_cache, new_k, new_v, jnp.int32(slot), jnp.int32(offset), chunk=True)
    return _write_chunk_xla(k_cache, v_cache, new_k, new_v, slot, offset)


def write_rows(k_cache, v_cache, new_k, new_v, slots, positions):
    """Store each decode row's K/V [b, k, d] (per layer) at (slots[b], positions[b]).
    Returns the caches."""
    if _native(k_cache, new_k):
        write = _write_scaled if kv_quant.quantized(k_cache[0]) else _write_native
        return write(k_cache, v_cache, new_k, new_v, slots, positions, chunk=False)
    return _write_rows_xla(k_cache, v_cache, new_k, new_v, slots, positions)


def _native(k_cache, new_k) -> bool:
    """Whether the native write takes these: caches it takes (writes_in_step), and
    float32 rows."""
    return new_k[0].dtype == jnp.float32 and writes_in_step(k_cache)


def writes_in_step(k_cache) -> bool:
    """Whether the native write takes these caches: on one CPU device, of a type it
    stores (an 8-bit cache's values: kv_quant.py). A decode step then stores its own
    rows (write_rows_traced)."""
    first = _first_values(k_cache)
    return (first.dtype in _CACHE_TYPES or first.dtype in (jnp.int8, jnp.uint8)) and on_one_cpu(k_cache)


def _first_values(k_cache):
    """The first layer's stored values (an 8-bit cache's without its scales)."""
    first = k_cache[0]
    return first.values if kv_quant.quantized(first) else first


def on_one_cpu(k_cache) -> bool:
    """Whether the native kernels were built and the caches live on one CPU device (the
    native writes and copies take them)."""
    first = _first_values(k_cache)
    if not (native.available() and isinstance(first, jax.Array) and len(first.sharding.device_set) == 1):
        return False
    # JAX's own annotation names its Device class through an alias mypy cannot follow
    device: jax.Device = next(iter(first.sharding.device_set))
    return device.platform == "cpu"


def write_rows_traced(k_cache, v_cache, new_k, new_v, slots, positions, after):
    """write_rows inside a jitted step whose caches are donated (writes_in_step): the
    native write, run after `after` (an array the step computes last). Free to run once
    its rows exist, the write may be ordered before a layer's attention reads the same
    cache, and XLA then copies the cache for that read; after the step's sampled tokens
    it comes last, and nothing is copied. Returns the caches."""
    write = _scaled_call if kv_quant.quantized(k_cache[0]) else _native_call
    new_k, new_v = ([r.astype(jnp.float32) for r in rows] for rows in (new_k, new_v))
    return write(k_cache, v_cache, new_k, new_v, slots, positions, False, (after,))


@partial(jax.jit, donate_argnums=(0, 1), static_argnames=("chunk",))
def _write_native(k_cache, v_cache, new_k, new_v, slots, positions, *, chunk: bool):
    return _native_call(k_cache, v_cache, new_k, new_v, slots, positions, chunk)


def _native_call(k_cache, v_cache, new_k, new_v, slots, positions, chunk: bool, after: tuple = ()):
    layers = len(k_cache)
    caches = [*k_cache, *v_cache]
    call = jax.ffi.ffi_call(native.KV_WRITE, [jax.ShapeDtypeStruct(c.shape, c.dtype) for c in caches],
                            input_output_aliases={2 + i: i for i in range(2 * layers)})
    out = call(jnp.asarray(slots, jnp.int32).reshape(-1), jnp.asarray(positions, jnp.int32).reshape(-1), *caches,
               *new_k, *new_v, *after, layers=layers, chunk=int(chunk))
    return list(out[:layers]), list(out[layers:])


@partial(jax.jit, donate_argnums=(0, 1), static_argnames=("chunk",))
def _write_scaled(k_cache, v_cache, new_k, new_v, slots, positions, *, chunk: bool):
    """_write_native for 8-bit caches: values and scales, every layer, in one call."""
    return _scaled_call(k_cache, v_cache, new_k, new_v, slots, positions, chunk)


def _scaled_call(k_cache, v_cache, new_k, new_v, slots, positions, chunk: bool, after: tuple = ()):
    layers = len(k_cache)
    caches = [c.values for c in k_cache] + [c.values for c in v_cache]
    caches += [c.scales for c in k_cache] + [c.scales for c in v_cache]
    call = jax.ffi.ffi_call(native.KV_WRITE_SCALED, [jax.ShapeDtypeStruct(c.shape, c.dtype) for c in caches],
                            input_output_aliases={2 + i: i for i in range(4 * layers)})
    out = call(jnp.asarray(slots, jnp.int32).reshape(-1), jnp.asarray(positions, jnp.int32).reshape(-1), *caches,
               *new_k, *new_v, *after, layers=layers, chunk=int(chunk))
    k = [kv_quant.QuantizedCache(out[i], out[2 * layers + i]) for i in range(layers)]
    v = [kv_quant.QuantizedCache(out[layers + i], out[3 * layers + i]) for i in range(layers)]
    return k, v


@partial(jax.jit, donate_argnums=(0, 1))
def _write_chunk_xla(k_cache, v_cache, new_k, new_v, slot, offset):
    """write_chunk in XLA: token j at position offset + j, one past the cache's end
    dropped."""
    t = new_k[0].shape[-1]
    slots = jnp.full((t,), slot, jnp.int32)
    positions = offset + jnp.arange(t, dtype=jnp.int32)
    # as decode rows, [t, k, d]
    new_k = [k.transpose(2, 0, 1) for k in new_k]
    new_v = [v.transpose(1, 0, 2) for v in new_v]
    return _write_rows_xla(k_cache, v_cache, new_k, new_v, slots, positions)


@partial(jax.jit, donate_argnums=(0, 1))
def _write_rows_xla(k_cache, v_cache, new_k, new_v, slots, positions):
    def store(cache, rows, key: bool):  # rows [b, k, d]
        if not kv_quant.quantized(cache):
            return _put_rows(cache, rows.astype(cache.dtype), slots, positions, key)
        values, scales = kv_quant.quantize(rows, cache.kind, 2)
        return kv_quant.QuantizedCache(_put_rows(cache.values, values, slots, positions, key),
                                       cache.scales.at[slots, :, positions].set(scales, mode="drop"))

    return [store(c, r, True) for c, r in zip(k_cache, new_k)], [store(c, r, False) for c, r in zip(v_cache, new_v)]


def _put_rows(cache, rows, slots, positions, key: bool):
    """Row b at (slots[b], positions[b]); one past the cache's end is dropped."""
    if key:  # K [slots, k, blocks, d, KEY_BLOCK] (kv_layout.py)
        return cache.at[slots, :, positions // KEY_BLOCK, :, positions % KEY_BLOCK].set(rows, mode="drop")
    return cache.at[slots, :, positions].set(rows, mode="drop")
