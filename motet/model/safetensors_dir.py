"""Read a Hugging Face model directory's safetensors, memory-mapped, under canonical names.

The safetensors header is parsed here rather than through the `safetensors` package so
every tensor is a zero-copy `np.memmap` view (bf16 included, via `ml_dtypes`) and a
truncated file is caught before any tensor is touched.
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

from .errors import ModelFileError
from .mapped_file import release_pages

_DTYPES = {
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "F64": np.float64,
}


def read_safetensors_header(path: Path) -> tuple[int, dict]:
    """(offset of the data section, header dict); validates every tensor's extent."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ModelFileError(f"{path}: not a safetensors file (too short)")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8 or n > 100 << 20:
            raise ModelFileError(f"{path}: not a safetensors file (bad header length)")
        try:
            header = json.loads(f.read(n))
        except ValueError as exc:
            raise ModelFileError(f"{path}: not a safetensors file (header is not JSON)") from exc
    data_size = size - 8 - n
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        if end > data_size:
            raise ModelFileError(
                f"{path}: tensor {name!r} ends at byte {end} but the data section has "
                f"{data_size} bytes (file truncated?)"
            )
    return 8 + n, header


class SafetensorsFile:
    def __init__(self, path: Path):
        self.path = path
        self.data_offset, header = read_safetensors_header(path)
        header.pop("__metadata__", None)
        self.header = header
        self._map: np.memmap | None = None  # mapped on the first read

    def array(self, name: str) -> np.ndarray:
        info = self.header[name]
        dtype = _DTYPES.get(info["dtype"])
        if dtype is None:
            raise ModelFileError(f"{self.path}: tensor {name!r} has unsupported dtype {info['dtype']}")
        if self._map is None:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        begin, end = info["data_offsets"]
        raw = self._map[self.data_offset + begin : self.data_offset + end]
        shape = tuple(info["shape"])
        if raw.size != int(np.prod(shape)) * np.dtype(dtype).itemsize:
            raise ModelFileError(f"{self.path}: tensor {name!r} size does not match its shape {shape}")
        return raw.view(dtype).reshape(shape)

    def release_pages(self) -> None:
        release_pages(self._map)


# Hugging Face tensor names → canonical names (see weights.py). Per-expert names carry
# the expert index; they are stacked into `experts.*` by the source below.
_HF_PATTERNS = [
    (r"model\.embed_tokens\.weight", "embed"),
    (r"model\.norm\.weight", "final_norm"),
    (r"lm_head\.weight", "lm_head"),
    (r"model\.layers\.(\d+)\.input_layernorm\.weight", r"\1.attn_norm"),
    (r"model\.layers\.(\d+)\.post_attention_layernorm\.weight", r"\1.ffn_norm"),
    (r"model\.layers\.(\d+)\.self_attn\.([qkvo])_proj\.weight", r"\1.\2"),
    (r"model\.layers\.(\d+)\.self_attn\.([qk])_norm\.weight", r"\1.\2_norm"),
    (r"model\.layers\.(\d+)\.mlp\.(gate|up|down)_proj\.weight", r"\1.\2"),
    (r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.gate\.weight", r"\1.router"),
    (r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(?:gate_proj|w1)\.weight", r"\1.expert.\2.gate"),
    (r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(?:up_proj|w3)\.weight", r"\1.expert.\2.up"),
    (r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(?:down_proj|w2)\.weight", r"\1.expert.\2.down"),
    # Fused expert tensors as some writers store them: [E, 2f, d] and [E, d, f].
    (r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.gate_up_proj", r"\1.experts.gate_up"),
    (r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.down_proj", r"\1.experts.down"),
]
_HF_COMPILED = [(re.compile(p + r"\Z"), r) for p, r in _HF_PATTERNS]


def canonical_hf_name(name: str) -> str | None:
    for pattern, repl in _HF_COMPILED:
        if pattern.match(name):
            return pattern.sub(repl, name)
    return None


class SafetensorsSource:
    """Canonical name → float32 array, read lazily from one or more shards."""

    def release_pages(self) -> None:
        """Every shard's pages out of this process's resident set (mapped_file.py)."""
        for shard in {id(st): st for st, _ in self.files.values()}.values():
            shard.release_pages()

    def __init__(self, model_dir: Path):
        self.path = model_dir
        index = model_dir / "model.safetensors.index.json"
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError) as exc:
                raise ModelFileError(f"{index}: not a valid safetensors index: {exc}") from exc
            shard_names = sorted(set(weight_map.values()))
        else:
            shard_names = sorted(p.name for p in model_dir.glob("*.safetensors"))
            if not shard_names:
                raise ModelFileError(f"{model_dir}: no *.safetensors files")
        self.files: dict[str, tuple[SafetensorsFile, str]] = {}
        for shard in shard_names:
            path = model_dir / shard
            if not path.exists():
                raise ModelFileError(f"{path}: shard named in the index is missing")
            st = SafetensorsFile(path)
            for hf_name in st.header:
                canon = canonical_hf_name(hf_name)
                if canon is not None:
                    self.files[canon] = (st, hf_name)
        if index.exists():
            for hf_name, shard in weight_map.items():
                canon = canonical_hf_name(hf_name)
                if canon is not None and canon not in self.files:
                    raise ModelFileError(f"{model_dir / shard}: tensor {hf_name!r} listed in the index is missing")

    def get_packed(self, name: str) -> None:
        """Hugging Face checkpoints hold floats."""
        return None

    def get_packed_expert(self, name: str, e: int) -> None:
        return None

    def file_rows(self, name: str) -> None:
        return None

    def describe(self, name: str) -> str:
        if name in self.files:
            st, hf_name = self.files[name]
            return f"{st.path}: tensor {hf_name!r}"
        return f"{self.path}: tensor {name!r}"

    def has(self, name: str) -> bool:
        try:
            self._locate(name)
        except KeyError:
            return False
        return True

    def get(self, name: str) -> np.ndarray:
        """A tensor in Hugging Face orientation ([out, in]); experts stacked on axis 0."""
        try:
            return self._locate(name)()
        except KeyError:
            raise ModelFileError(f"{self.path}: tensor {name!r} not found in the safetensors files") from None

    def get_expert(self, name: str, e: int) -> np.ndarray:
        """Expert e of a stacked canonical tensor (`<layer>.experts.gate|up|down`), read
        alone: the other experts' bytes are never touched (the files are mmapped)."""
        layer, _, rest = name.partition(".")
        kind = rest.removeprefix("experts.")
        if name in self.files:
            st, hf_name = self.files[name]
            return st.array(hf_name)[e]
        if kind in ("gate", "up") and f"{layer}.experts.gate_up" in self.files:
            st, hf_name = self.files[f"{layer}.experts.gate_up"]
            fused = st.array(hf_name)[e]
            f = fused.shape[0] // 2
            return fused[:f] if kind == "gate" else fused[f:]
        if f"{layer}.expert.{e}.{kind}" in self.files:
            st, hf_name = self.files[f"{layer}.expert.{e}.{kind}"]
            return st.array(hf_name)
        raise ModelFileError(f"{self.path}: expert {e} of {name!r} not found in the safetensors files")

    def _locate(self, name: str):
        if name in self.files:
            st, hf_name = self.files[name]
            return lambda: st.array(hf_name)
        layer, _, rest = name.partition(".")
        kind = rest.removeprefix("experts.")
        if kind in ("gate", "up") and f"{layer}.experts.gate_up" in self.files:
            st, hf_name = self.files[f"{layer}.experts.gate_up"]

            def half():
                fused = st.array(hf_name)
                f = fused.shape[1] // 2
                return fused[:, :f] if kind == "gate" else fused[:, f:]

            return half
        per_expert: list[tuple[SafetensorsFile, str]] = []
        while f"{layer}.expert.{len(per_expert)}.{kind}" in self.files:
            per_expert.append(self.files[f"{layer}.expert.{len(per_expert)}.{kind}"])
        if rest.startswith("experts.") and per_expert:
            return lambda: np.stack([st.array(n) for st, n in per_expert])
        raise KeyError(name)
