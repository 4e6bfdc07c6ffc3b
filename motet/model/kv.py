"""The KV cache's geometry and its shape buckets.

Prompt chunks and decode batches are padded to a few sizes so a new prompt length or a
new number of streams reuses a compiled function: chunks to powers of two up to 1024
(then multiples of 1024), batches to 1, 2, 4, 8, 16, a slot's KV read or written in
powers of two. Context length is no shape at all (attention walks the cache block by
block). A geometry lists every size it can use, so an engine compiles them all before
it serves (actors/warmup.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import numpy as np

from ..runtime.kv_format import KV_DTYPE_CHOICES, SCALED_KV, kv_row_bytes
from . import kv_quant, kv_writes
from .attention import ATTN_BLOCK
from .config import ModelConfig
from .kv_layout import KEY_BLOCK, key_shape, keys_in_blocks, keys_in_order

MIN_BUCKET = 16
assert ATTN_BLOCK % KEY_BLOCK == 0


def bucket(n: int, cap: int | None = None) -> int:
    if n <= MIN_BUCKET:
        size = MIN_BUCKET
    elif n <= 1024:
        size = 1 << (n - 1).bit_length()
    else:
        size = -(-n // 1024) * 1024
    return size if cap is None else min(size, cap)


def batch_bucket(n: int) -> int:
    """Decode batch sizes 1, 2, 4, 8, 16, ... so a changing number of streams rarely recompiles."""
    return 1 << (n - 1).bit_length()


def slot_width(tokens: int, length: int) -> int:
    """How many positions of a slot move when `tokens` of them are read or written: a
    power of two (so a long context adds few sizes) of whole K blocks, at most the
    cache's length."""
    return min(batch_bucket(max(tokens, KEY_BLOCK)), length)


@dataclass(frozen=True)
class KVGeometry:
    n_slots: int  # conversations; one more scratch slot takes padded decode rows
    max_context: int  # positions a conversation may use
    chunk: int  # longest prefill chunk

    @property
    def length(self) -> int:
        """Positions a slot holds: the context, and at least the longest padded chunk,
        rounded up to whole attention blocks (the XLA path reads a block at a time,
        attention.ATTN_BLOCK, which holds whole K blocks). A padded chunk's rows past the
        end are dropped as it is written (kv_writes.write_chunk)."""
        held = max(self.max_context, max(self.prefill_chunks(), default=0))
        return -(-held // ATTN_BLOCK) * ATTN_BLOCK

    @property
    def scratch_slot(self) -> int:
        return self.n_slots

    def decode_batches(self) -> tuple[int, ...]:
        """Every padded batch a decode step can have (1 up to every slot decoding)."""
        return tuple(1 << i for i in range(batch_bucket(self.n_slots).bit_length()))

    def prefill_chunks(self) -> tuple[int, ...]:
        """Every padded length a prefill chunk can have (a prompt is shorter than the
        context)."""
        longest = min(self.chunk, self.max_context - 1)
        return tuple(sorted({bucket(n, cap=self.chunk) for n in range(1, longest + 1)}))

    def slot_widths(self) -> tuple[int, ...]:
        """Every width a slot's KV is read or written in (sessions, handovers)."""
        return tuple(sorted({slot_width(n, self.length) for n in _powers_up_to(self.max_context)}))


def _powers_up_to(n: int) -> list[int]:
    """1, 2, 4, ... and n itself: the token counts where slot_width can change."""
    return [1 << i for i in range(n.bit_length()) if 1 << i < n] + [n]


def pick_kv_dtype(asked: str, weights_dtype: str, quantized: bool) -> str:
    """The cache's element type (runtime/kv_format.py): `asked`, or for "auto" float16
    under quantized weights, as llama.cpp's cache (half float32's bytes; the native
    attention widens it as it reads), and the weights' own dtype otherwise (--dtype
    float32 keeps the float32 path whole)."""
    if asked not in KV_DTYPE_CHOICES:
        raise ValueError(f"kv_dtype must be one of {', '.join(KV_DTYPE_CHOICES)}, got {asked!r}")
    if asked != "auto":
        return asked
    return "float16" if quantized else weights_dtype


def kv_bytes_per_position(cfg: ModelConfig, dtype: str) -> int:
    """The bytes one position of one slot holds: K and V of every layer."""
    return 2 * cfg.n_layers * cfg.n_kv_heads * kv_row_bytes(dtype, cfg.head_dim)


def init_kv(cfg: ModelConfig, geo: KVGeometry, dtype: str = "float32", sharding=None):
    """Zeroed caches, per layer: K [slots + 1, kv_heads, length / KEY_BLOCK, head_dim,
    KEY_BLOCK] (kv_layout.py) and V [slots + 1, kv_heads, length, head_dim]; an 8-bit dtype makes
    each a kv_quant.QuantizedCache of those values and their scales. sharding: where they
    live (on a mesh: sharding.kv_sharding, split along kv_heads); None: the default device."""
    slots = geo.n_slots + 1
    k_shape = key_shape(slots, cfg.n_kv_heads, cfg.head_dim, geo.length)
    v_shape = (slots, cfg.n_kv_heads, geo.length, cfg.head_dim)

    fill = partial(kv_writes.cache_zeros, sharding=sharding)

    def layer(shape):
        if dtype in SCALED_KV:
            return kv_quant.zeros(dtype, shape, (slots, cfg.n_kv_heads, geo.length), fill)
        return fill(shape, dtype)

    return [layer(k_shape) for _ in range(cfg.n_layers)], [layer(v_shape) for _ in range(cfg.n_layers)]


def copy_slot_prefix(kv, source: int, target: int, positions: int):
    """Slot `source`'s first `positions` positions of every layer over slot `target`'s,
    in place (kv donated): natively on one CPU device, which touches only those
    positions; elsewhere the whole slot (copy_slot)."""
    k_cache, v_cache = kv
    if kv_writes.on_one_cpu(k_cache):
        return kv_writes.copy_positions(k_cache, v_cache, source, target, positions)
    return copy_slot(kv, np.int32(source), np.int32(target))


@partial(jax.jit, donate_argnums=0)
def copy_slot(kv, source, target):
    """Every layer's K and V of slot `source` written over slot `target` (in place): the
    choices of an n > 1 request start from the one prefill of their prompt. The slots
    are traced, so one compile serves every pair."""

    def copy(layer):
        rows = jax.lax.dynamic_index_in_dim(layer, source, keepdims=True)
        return jax.lax.dynamic_update_index_in_dim(layer, rows, target, axis=0)

    return jax.tree.map(copy, kv)


# ---- one slot's KV as host arrays (sessions, handovers) ----------------------------------
# On the host a layer's K and V are both [tokens, kv_heads, row]: a row is head_dim values,
# or an 8-bit cache's head_dim bytes and their scale (runtime/kv_format.py). The layout a
# session file and a K_LAYER frame carry, whatever the device layout is.

def read_slot_layer(kv, layer: int, slot: int, tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """The first `tokens` positions of one layer of `slot`, (K, V), contiguous host arrays
    [tokens, kv_heads, row] (runtime/kv_format.py)."""
    k, v = kv
    # A bucketed width comes over (a few compiled slices cover every length), then numpy
    # cuts it to size.
    k_rows, v_rows = _take_layer(k[layer], v[layer], slot, width=slot_width(tokens, v[layer].shape[2]))
    if kv_quant.quantized(k_rows):
        return (kv_quant.pack_rows(_keys_on_host(k_rows.values, tokens), _scales_on_host(k_rows.scales, tokens)),
                kv_quant.pack_rows(_values_on_host(v_rows.values, tokens), _scales_on_host(v_rows.scales, tokens)))
    return _keys_on_host(k_rows, tokens), _values_on_host(v_rows, tokens)


def _keys_on_host(k, tokens: int) -> np.ndarray:  # [kv_heads, head_dim, width] → [tokens, kv_heads, head_dim]
    return np.ascontiguousarray(_on_host(k)[:, :, :tokens].transpose(2, 0, 1))


def _values_on_host(v, tokens: int) -> np.ndarray:  # [kv_heads, width, head_dim] → [tokens, kv_heads, head_dim]
    return np.ascontiguousarray(_on_host(v)[:, :tokens, :].transpose(1, 0, 2))


def _scales_on_host(s, tokens: int) -> np.ndarray:  # [kv_heads, width] → [tokens, kv_heads]
    return np.ascontiguousarray(_on_host(s)[:, :tokens].T)


@partial(jax.jit, static_argnames=("width",))
def _take_layer(k_layer, v_layer, slot, *, width: int):
    """A slot's first `width` positions (whole K blocks) of one layer: K [kv_heads,
    head_dim, width], V [kv_heads, width, head_dim] (and an 8-bit cache's scales,
    [kv_heads, width]). The slot is traced, so one compile serves every slot."""

    def take(x, axis, size=width):  # axis: the positions', once the slot's is gone
        return jax.lax.slice_in_dim(jax.lax.dynamic_index_in_dim(x, slot, keepdims=False), 0, size, axis=axis)

    def keys(x):
        return keys_in_order(take(x, 1, width // KEY_BLOCK))

    if kv_quant.quantized(k_layer):
        return (kv_quant.QuantizedCache(keys(k_layer.values), take(k_layer.scales, 1)),
                kv_quant.QuantizedCache(take(v_layer.values, 1), take(v_layer.scales, 1)))
    return keys(k_layer), take(v_layer, 1)


def _on_host(x) -> np.ndarray:
    """A device array as one host array. KV heads split over several processes are
    gathered: a collective, so every process of the group makes this call."""
    if x.is_fully_addressable:
        return np.asarray(x)
    from jax.experimental.multihost_utils import process_allgather

    return np.asarray(process_allgather(x, tiled=True))


@partial(jax.jit, donate_argnums=(0, 1))
def _put_layer(k_layer, v_layer, k_rows, v_rows, slot):
    """Host rows [t, kv_heads, head_dim] (t whole K blocks; an 8-bit cache's as
    QuantizedCache(values, scales [t, kv_heads])) at positions 0.. of `slot`."""

    def put(cache, rows, order, arrange=lambda x: x):
        rows = arrange(rows.transpose(order))[None].astype(cache.dtype)
        return jax.lax.dynamic_update_slice(cache, rows, (slot,) + (0,) * (cache.ndim - 1))

    def put_layer(cache, rows, order, arrange=lambda x: x):
        if not kv_quant.quantized(cache):
            return put(cache, rows, order, arrange)
        return kv_quant.QuantizedCache(put(cache.values, rows.values, order, arrange),
                                       put(cache.scales, rows.scales, (1, 0)))

    # to [kv_heads, blocks, head_dim, KEY_BLOCK] and [kv_heads, t, head_dim]
    return put_layer(k_layer, k_rows, (1, 2, 0), keys_in_blocks), put_layer(v_layer, v_rows, (1, 0, 2))


def write_slot_layer(kv, geo: KVGeometry, layer: int, slot: int, k_rows: np.ndarray, v_rows: np.ndarray):
    """Store host rows ([tokens, kv_heads, row] each, as read_slot_layer gives them) at
    positions 0.. of one layer of `slot` (in place); returns the updated kv. Rows are
    padded to a bucket so a few compiled shapes cover every length; the padding lands
    past the slot's history."""
    tokens = k_rows.shape[0]
    width = slot_width(tokens, geo.length)
    pad = ((0, width - tokens), (0, 0), (0, 0))
    k, v = list(kv[0]), list(kv[1])
    rows: list = [np.pad(k_rows, pad), np.pad(v_rows, pad)]
    if kv_quant.quantized(k[layer]):
        rows = [kv_quant.QuantizedCache(*kv_quant.unpack_rows(r, k[layer].kind)) for r in rows]
    k[layer], v[layer] = _put_layer(k[layer], v[layer], *rows, slot)
    return k, v
