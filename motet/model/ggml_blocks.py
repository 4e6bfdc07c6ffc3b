"""ggml's K-type blocks unpacked to their small integers, written once for both readers:
the loader's repack (numpy, gguf_quants.py) and the in-step lookup of an embedding left
in the file (jax.numpy, file_rows.py). `xp` is the array module; the bytes are uint8."""

from __future__ import annotations

QK = 32  # values per block of the simple types, and per run of a K type's super-block
QK_K = 256  # values per super-block of the K types


def k_scales(packed, xp):
    """The 8 six-bit (scale, min) pairs of a Q4_K / Q5_K super-block's 12 bytes."""
    low, high, rest = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scales = xp.concatenate([low & 63, (rest & 15) | ((low >> 6) << 4)], axis=-1)
    mins = xp.concatenate([high & 63, (rest >> 4) | ((high >> 6) << 4)], axis=-1)
    return scales, mins


def k_nibbles(qs, xp):
    """128 bytes → 8 runs of 32 values [..., 8, 32]: each 32 bytes' low nibbles, then
    their high ones."""
    q = qs.reshape(*qs.shape[:-1], 4, 1, QK)
    return xp.concatenate([q & 15, q >> 4], axis=-2).reshape(*qs.shape[:-1], 8, QK)


def q5_values(qh, qs, xp):
    """A Q5_K super-block's 256 values [..., 8, 32]: run j takes bit j of each of the 32
    high-bit bytes qh over the nibbles of qs."""
    high = xp.stack([(qh >> j) & 1 for j in range(8)], axis=-2)
    return k_nibbles(qs, xp) + (high << 4)


def q6_values(ql, qh, xp):
    """A Q6_K super-block's 256 values [..., 2, 4, 32] as int16 in -32..31, from its 128
    low-nibble bytes and 64 high-bit bytes: each half of 128 values is four runs of 32,
    from the low or high nibbles of ql's two halves and two bits of qh each."""
    ql = ql.reshape(*ql.shape[:-1], 2, 64)
    qh = qh.reshape(*qh.shape[:-1], 2, 32)
    runs = [(ql[..., :32] & 15) | ((qh & 3) << 4), (ql[..., 32:] & 15) | (((qh >> 2) & 3) << 4),
            (ql[..., :32] >> 4) | (((qh >> 4) & 3) << 4), (ql[..., 32:] >> 4) | (((qh >> 6) & 3) << 4)]
    return xp.stack(runs, axis=-2).astype(xp.int16) - 32
