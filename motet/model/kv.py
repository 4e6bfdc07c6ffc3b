"""The KV cache's geometry and its shape buckets.

Prompt chunks and decode batches are padded to a few sizes so a new prompt length or a
new number of streams reuses a compiled function: chunks to powers of two up to 1024
(then multiples of 1024), batches to 1, 2, 4, 8, 16. Context length is no shape at all
(attention walks the cache block by block).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp

from .config import ModelConfig
from .forward import ATTN_BLOCK

MIN_BUCKET = 16


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


@dataclass(frozen=True)
class KVGeometry:
    n_slots: int  # conversations; one more scratch slot takes padded decode rows
    max_context: int  # positions a conversation may use
    chunk: int  # longest prefill chunk

    @property
    def length(self) -> int:
        # Room past the last position for a padded chunk's write and for the last
        # attention block's read (forward.ATTN_BLOCK), so neither is clamped.
        return self.max_context + max(self.chunk, ATTN_BLOCK)

    @property
    def scratch_slot(self) -> int:
        return self.n_slots


def init_kv(cfg: ModelConfig, geo: KVGeometry, dtype=jnp.float32):
    """Zeroed caches, per layer: K [slots + 1, kv_heads, head_dim, length] and
    V [slots + 1, kv_heads, length, head_dim] (see forward.py)."""
    slots = geo.n_slots + 1
    k = [jnp.zeros((slots, cfg.n_kv_heads, cfg.head_dim, geo.length), dtype) for _ in range(cfg.n_layers)]
    v = [jnp.zeros((slots, cfg.n_kv_heads, geo.length, cfg.head_dim), dtype) for _ in range(cfg.n_layers)]
    return k, v
