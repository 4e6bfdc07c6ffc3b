"""Settings built once from the command line (or by an embedding program) and passed down."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ModelSettings:
    path: Path | None = None  # None: the embedded default model
    dtype: str = "float32"
    max_context: int | None = None  # None: the model's own
    compile_cache: Path | None = None  # JAX's persistent compilation cache

    def __post_init__(self):
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be float32 or bfloat16, got {self.dtype!r}")
        if self.max_context is not None and self.max_context < 16:
            raise ValueError(f"max_context must be at least 16, got {self.max_context}")


@dataclass(frozen=True)
class SamplingSettings:
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
