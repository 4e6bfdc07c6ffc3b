"""Open a GGUF file: its metadata as plain Python values, and its tensors dequantized or
repacked as they are quantized (gguf_quants.py)."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np

from . import native
from .errors import ModelFileError, UnsupportedModelError
from .file_rows import UNPACK, FileRows, over
from .gguf_quants import REPACK
from .mapped_file import release_pages
from .quant import QTensor, pick_rows, plain

GGUF_MAGIC = b"GGUF"


def open_gguf(path: Path):
    import gguf

    with open(path, "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise ModelFileError(f"{path}: not a GGUF file (bad magic)")
    try:
        return gguf.GGUFReader(path, "r")
    except (ValueError, IndexError, OSError, KeyError) as exc:
        raise ModelFileError(f"{path}: damaged or truncated GGUF file: {exc}") from exc


def gguf_metadata(reader) -> dict[str, object]:
    """Every key/value field as a str, int, float, bool or list of those."""
    meta: dict[str, object] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        value = field.contents()
        if isinstance(value, list) and value and isinstance(value[0], (np.integer, np.floating)):
            value = [v.item() for v in value]
        elif isinstance(value, (np.integer, np.floating, np.bool_)):
            value = value.item()
        meta[key] = value
    return meta


COPIED_FLOATS = 4 << 20  # bytes: a float32 tensor up to this size is copied out of the file


def dequantize_tensor(path: Path, tensor, index: int | None = None) -> np.ndarray:
    """A tensor as float32 in numpy (row-major, GGUF's dims reversed); with `index`,
    only that slice of its first axis (one expert of a stacked tensor, read alone)."""
    import gguf
    from gguf import GGMLQuantizationType as Q

    shape = tuple(int(d) for d in reversed(tensor.shape))
    data = tensor.data
    if index is not None:
        shape, data = shape[1:], data[index]
    kind = tensor.tensor_type
    if kind == Q.F32:
        # A view would share the file's pages: a norm or router read every step would
        # keep faulting them back in after release_pages (13-38 MB of the default model's
        # resident set, measured). Small tensors are copied; a float32 file's big ones
        # stay views, never held twice.
        out = np.array(data, np.float32) if data.nbytes <= COPIED_FLOATS else np.asarray(data, np.float32)
    elif kind in (Q.F16, Q.F64, Q.I8, Q.I16, Q.I32):
        out = np.asarray(data).astype(np.float32)
    else:
        try:
            out = gguf.quants.dequantize(data, kind)
        except NotImplementedError as exc:
            raise UnsupportedModelError(
                f"{path}: tensor {tensor.name!r} uses quantization {kind.name}, "
                "which cannot be dequantized"
            ) from exc
    if out.size != int(np.prod(shape)):
        raise ModelFileError(
            f"{path}: tensor {tensor.name!r} has {out.size} values, expected shape {shape}"
        )
    return out.reshape(shape).astype(np.float32, copy=False)


_GGUF_NAMES = {
    "token_embd": "embed",
    "output_norm": "final_norm",
    "output": "lm_head",
    "attn_norm": "attn_norm",
    "attn_q": "q",
    "attn_k": "k",
    "attn_v": "v",
    "attn_output": "o",
    "attn_q_norm": "q_norm",
    "attn_k_norm": "k_norm",
    "ffn_norm": "ffn_norm",
    "ffn_gate": "gate",
    "ffn_up": "up",
    "ffn_down": "down",
    "ffn_gate_inp": "router",
    "ffn_gate_exps": "experts.gate",
    "ffn_up_exps": "experts.up",
    "ffn_down_exps": "experts.down",
}


def _gguf_name(canonical: str) -> str:
    """The GGUF tensor name a canonical name comes from, for messages."""
    layer: str | None
    layer, _, kind = canonical.partition(".")
    if not kind:
        kind, layer = layer, None
    gguf_kind = next((g for g, c in _GGUF_NAMES.items() if c == kind), kind)
    return f"blk.{layer}.{gguf_kind}.weight" if layer is not None else f"{gguf_kind}.weight"


def canonical_gguf_name(name: str) -> str | None:
    parts = name.removesuffix(".weight").split(".")
    if parts[0] == "blk" and len(parts) == 3 and parts[2] in _GGUF_NAMES:
        return f"{parts[1]}.{_GGUF_NAMES[parts[2]]}"
    if len(parts) == 1 and parts[0] in _GGUF_NAMES:
        return _GGUF_NAMES[parts[0]]
    return None


def unpermuted_row_order(rows: int, n_heads: int) -> np.ndarray:
    """The row order unpermute_rope_rows gives, for reordering packed rows."""
    return unpermute_rope_rows(np.arange(rows)[:, None], n_heads)[:, 0]


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's converter, which interleaves each head's rotary halves.

    On disk each head's rows are (x0, x_half, x1, x_half+1, ...); the forward uses the
    Hugging Face half-split rotation, so put the rows back.
    """
    rows, cols = w.shape
    return w.reshape(n_heads, rows // n_heads // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


class GGUFSource:
    """Canonical name → float32 array (Hugging Face orientation), dequantized on demand."""

    def __init__(self, path: Path, reader, permuted_rope_heads: tuple[int, int] | None):
        self.path = path
        self.tensors = {}
        for tensor in reader.tensors:
            canon = canonical_gguf_name(tensor.name)
            if canon is not None:
                self.tensors[canon] = tensor
        # (query heads, KV heads) when Q/K rows were permuted by llama.cpp's converter
        self.permuted_rope_heads = permuted_rope_heads
        self._map = reader.data  # the whole file, mapped read-only

    def release_pages(self) -> None:
        """The file's pages out of this process's resident set (mapped_file.py)."""
        release_pages(self._map)

    def has(self, name: str) -> bool:
        return name in self.tensors

    def describe(self, name: str) -> str:
        tensor = self.tensors.get(name)
        return f"{self.path}: tensor {tensor.name if tensor is not None else name!r}"

    def get(self, name: str) -> np.ndarray:
        w = dequantize_tensor(self.path, self._tensor(name))
        kind = name.rpartition(".")[2]
        if self.permuted_rope_heads and kind in ("q", "k"):
            w = unpermute_rope_rows(w, self.permuted_rope_heads[kind == "k"])
        return w

    def get_packed(self, name: str) -> QTensor | None:
        tensor = self._tensor(name)
        shape = tuple(int(d) for d in reversed(tensor.shape))
        w = self._repack(name, tensor, np.asarray(tensor.data), shape)
        kind = name.rpartition(".")[2]
        if w is not None and self.permuted_rope_heads and kind in ("q", "k"):
            w = pick_rows(w, unpermuted_row_order(shape[0], self.permuted_rope_heads[kind == "k"]))
        return w

    def file_rows(self, name: str) -> FileRows | None:
        """A quantized 2-D tensor's bytes as the file holds them, [rows, bytes a row], over
        the read-only mapping (None for a type file_rows.py does not unpack)."""
        tensor = self._tensor(name)
        raw = np.asarray(tensor.data)
        if tensor.tensor_type.name not in UNPACK or raw.ndim != 2 or raw.dtype != np.uint8:
            return None
        return over(self._map, raw, tensor.tensor_type.name, int(tensor.shape[0]))

    def get_packed_expert(self, name: str, e: int) -> QTensor | None:
        """Expert e of a stacked expert tensor still quantized, [rows, columns]: a raw
        slice of the mmapped file, repacked (None where the file holds floats)."""
        tensor = self._tensor(name)
        shape = tuple(int(d) for d in reversed(tensor.shape))
        return self._repack(name, tensor, np.asarray(tensor.data[e]), shape[1:])

    def _tensor(self, name: str):
        tensor = self.tensors.get(name)
        if tensor is None:
            raise ModelFileError(f"{self.path}: tensor {_gguf_name(name)!r} not found")
        return tensor

    def _repack(self, name: str, tensor, raw: np.ndarray, shape: tuple[int, ...]) -> QTensor | None:
        """raw bytes [..., rows, bytes per row] → a QTensor of `shape` (leading axes kept:
        a stack of experts), or None for a type that stays float."""
        repack = REPACK.get(tensor.tensor_type.name)
        if repack is None:
            return None
        if raw.ndim != len(shape) or raw.shape[:-1] != shape[:-1] or raw.dtype != np.uint8:
            raise ModelFileError(f"{self.describe(name)}: {raw.shape} bytes do not hold shape {shape}")
        w = repack(raw.reshape(-1, raw.shape[-1]))
        if w.super_scale is not None and not native.k_scales_packed():
            w = plain(w)
        if w.shape[-1] != shape[-1]:
            raise ModelFileError(f"{self.describe(name)} has rows of {w.shape[-1]} values, expected {shape[-1]}")
        if len(shape) > 2:
            w = jax.tree.map(lambda a: a.reshape(*shape[:-1], a.shape[-1]), w)
        return w

    def get_expert(self, name: str, e: int) -> np.ndarray:
        """Expert e of a stacked expert tensor, dequantized alone (the file is mmapped)."""
        return dequantize_tensor(self.path, self._tensor(name), e)
