"""The Engine's arguments checked before anything starts: a bad one is a ValueError that
names it and the values it may take."""

from __future__ import annotations

from typing import get_args

from ..runtime.config import MAX_BURST, Activations
from ..runtime.kv_format import KV_DTYPE_CHOICES

MAX_SLOTS = 16
PREFILL_CHUNK = 256  # tokens a prompt's prefill step reads at most while streams decode (each waits for a chunk)
# ... and while none does, in a model with routed experts: each expert's weights then serve
# twice the rows a read. A dense model's matrices already serve every row of a chunk, so
# its lone chunks stay PREFILL_CHUNK (docs/performance.md, "A lone prompt's chunks of 512").
PREFILL_CHUNK_ALONE = 512


def lone_prompt_chunk(asked: int | None, prefill_chunk: int, routed_experts: bool) -> int:
    """The longest chunk a prompt is read in while no stream decodes: `asked`, or by
    default PREFILL_CHUNK_ALONE for a model with routed experts; never below prefill_chunk."""
    default = PREFILL_CHUNK_ALONE if routed_experts else prefill_chunk
    return max(default if asked is None else asked, prefill_chunk)


def check_engine_arguments(kv_slots: int, kv_dtype: str, activations: str | None, prefill_chunk: int,
                           prefill_chunk_alone: int | None, decode_burst: int, prefix_cache_gb: float) -> None:
    if not 1 <= kv_slots <= MAX_SLOTS:
        raise ValueError(f"kv_slots must be in [1, {MAX_SLOTS}], got {kv_slots}")
    if kv_dtype not in KV_DTYPE_CHOICES:
        raise ValueError(f"kv_dtype must be one of {', '.join(KV_DTYPE_CHOICES)}, got {kv_dtype!r}")
    if activations is not None and activations not in get_args(Activations):
        raise ValueError(f"activations must be one of {', '.join(get_args(Activations))} or None, "
                         f"got {activations!r}")
    for name, chunk in (("prefill_chunk", prefill_chunk), ("prefill_chunk_alone", prefill_chunk_alone)):
        if chunk is not None and (chunk < 16 or chunk & (chunk - 1)):
            raise ValueError(f"{name} must be a power of two >= 16, got {chunk}")
    if not 1 <= decode_burst <= MAX_BURST:
        raise ValueError(f"decode_burst must be in [1, {MAX_BURST}], got {decode_burst}")
    if prefix_cache_gb < 0:
        raise ValueError(f"prefix_cache_gb must be >= 0, got {prefix_cache_gb}")
