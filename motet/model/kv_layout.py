"""How a K cache holds its positions: in blocks of KEY_BLOCK.

A layer's K is [slots, kv_heads, length / KEY_BLOCK, head_dim, KEY_BLOCK]: within a
block, one dimension's positions lie side by side, as the native attention reads them
(a pass scores a vector of positions per dimension). Held as one run of `length`
positions a dimension ([slots, kv_heads, head_dim, length]), a slot's first write touched
a page in every dimension's run, so the whole slot counted in the resident set from its
first token; in blocks, a conversation's pages fill in the order of its positions, as V's
do (V [slots, kv_heads, length, head_dim]).

Everything off the device (sessions, the wire) and the XLA paths that read a few
positions see K as [..., head_dim, positions]: keys_in_order and keys_in_blocks convert.
kernels/qmatmul.h's KEY_BLOCK is the same number.
"""

from __future__ import annotations

# A native pass scores 4 vectors of 16 positions (AVX-512) or 2 of 8 (AVX2) from one
# dimension's run: a block of 64 holds whole passes of either, so none crosses a block.
KEY_BLOCK = 64


def key_shape(slots: int, kv_heads: int, head_dim: int, length: int) -> tuple[int, ...]:
    if length % KEY_BLOCK:
        raise ValueError(f"a K cache holds whole blocks of {KEY_BLOCK} positions, got {length}")
    return (slots, kv_heads, length // KEY_BLOCK, head_dim, KEY_BLOCK)


def keys_in_order(k):
    """[..., blocks, head_dim, KEY_BLOCK] → [..., head_dim, blocks · KEY_BLOCK] (numpy or
    jax arrays alike)."""
    *lead, blocks, head_dim, block = k.shape
    return k.swapaxes(-3, -2).reshape(*lead, head_dim, blocks * block)


def keys_in_blocks(k):
    """keys_in_order undone: [..., head_dim, positions] (whole blocks of them) →
    [..., blocks, head_dim, KEY_BLOCK]."""
    *lead, head_dim, positions = k.shape
    return k.reshape(*lead, head_dim, positions // KEY_BLOCK, KEY_BLOCK).swapaxes(-3, -2)
