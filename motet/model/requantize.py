"""`--quantize int8|int4`: the float tensors of a checkpoint (a Hugging Face directory's
bf16 or f32, a GGUF's F16/F32) quantized at load, one tensor at a time, so no float32
copy of the whole model is ever held. Tensors a GGUF already holds quantized keep the
file's values.

int8 is symmetric with a scale per 32 values; int4 asymmetric (scale and min per 32).
The embedding and the LM head take int8 in both: the logits are the most sensitive to
their error (llama.cpp's Q4_K_M keeps its LM head at 6 bits, for the same reason)."""

from __future__ import annotations

import numpy as np

from .quant import QUANTIZE_BLOCK, QTensor, quantize

QUANTIZE_CHOICES = ("int8", "int4")
_LAYOUT = {"int8": "q8", "int4": "q4"}
_AT_LEAST_INT8 = ("embed", "lm_head")


class QuantizingSource:
    """A TensorSource whose get_packed quantizes what the file holds as floats."""

    def __init__(self, source, kind: str):
        if kind not in QUANTIZE_CHOICES:
            raise ValueError(f"unknown quantization {kind!r}; choose from {', '.join(QUANTIZE_CHOICES)}")
        self.source, self.kind = source, kind

    def __getattr__(self, name):  # has, get, describe, get_expert: the file's own
        return getattr(self.source, name)

    def get_packed(self, name: str) -> QTensor | None:
        packed = self.source.get_packed(name)
        return packed if packed is not None else self._quantize(name, self.source.get(name))

    def get_packed_expert(self, name: str, e: int) -> QTensor | None:
        packed = self.source.get_packed_expert(name, e)
        return packed if packed is not None else self._quantize(name, self.source.get_expert(name, e))

    def _quantize(self, name: str, w: np.ndarray) -> QTensor | None:
        """None (stays float) where rows do not split into groups of 32."""
        if w.shape[-1] % QUANTIZE_BLOCK:
            return None
        kind = "int8" if name in _AT_LEAST_INT8 else self.kind
        return quantize(w, _LAYOUT[kind], kind)
