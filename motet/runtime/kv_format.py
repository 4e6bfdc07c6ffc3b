"""The KV cache's element types, and how one slot's positions look off the device
(session files, K_LAYER frames, the host prefix store).

Off the device a layer's K and V are each [tokens, kv_heads, row]. A row of a float
cache is head_dim elements of its type. A row of an 8-bit cache is head_dim one-byte
values (int8, or fp8 e4m3 bit patterns) followed by their float32 scale, little-endian:
the bytes the device holds, so a session restores the same numbers it saved.
"""

from __future__ import annotations

FLOAT_KV = ("float32", "float16", "bfloat16")
SCALED_KV = ("int8", "fp8")  # one float32 scale per position and KV head
KV_DTYPES = FLOAT_KV + SCALED_KV
KV_DTYPE_CHOICES = ("auto", *KV_DTYPES)
SCALE_BYTES = 4


def host_row(dtype: str, head_dim: int) -> tuple[str, int]:
    """(numpy element type, elements a row) of one position of one KV head off the device."""
    if dtype in SCALED_KV:
        return "uint8", head_dim + SCALE_BYTES
    return dtype, head_dim


def kv_layout(dtype: str) -> str:
    """The layout string session headers and K_FIRST facts carry."""
    return "tokens,kv_heads,head_dim+f32_scale" if dtype in SCALED_KV else "tokens,kv_heads,head_dim"


def kv_row_bytes(dtype: str, head_dim: int) -> int:
    """Bytes one position of one KV head takes in K (or in V)."""
    if dtype in SCALED_KV:
        return head_dim + SCALE_BYTES
    return head_dim * {"float32": 4, "float16": 2, "bfloat16": 2}[dtype]
