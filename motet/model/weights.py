"""Pack a model's tensors into the pytree the forward functions take.

Layout (x @ W, so every matrix is [in, out]):
  lm_head [d, V]         final_norm [d]          embed [V, d] (absent when tied: the
                                                 lookup then reads lm_head's columns)
  layers[i]: attn_norm [d], wqkv [d, (H + 2·KV)·hd], wo [H·hd, d], q_norm/k_norm (optional),
             ffn_norm [d], and either
             dense: w_gate_up [d, 2·ff], w_down [ff, d]
             moe:   router [d, E], experts_gate_up [E, d, 2·f], experts_down [E, f, d]
Q, K and V share one matrix and gate/up another, so a decode step runs fewer, larger
GEMVs; each layer is its own set of arrays (slicing a stacked array copies on XLA:CPU).

With a mesh, each leaf goes from the host straight into its shards (sharding.place_leaf,
which also interleaves the fused matrices' columns by tp shard).

Quantized (pack_weights(quantized=True)), wqkv, wo, w_gate_up, w_down, lm_head, embed
and the experts are QTensors as the file holds them: [out, in] rows, the head [V, d],
experts_gate_up [E, 2·f, d], experts_down [E, d, f] (quant.py).
"""

from __future__ import annotations

from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from .config import ModelConfig
from .errors import ModelFileError
from .file_rows import FileRows
from .panel_layout import PANELS
from .panels import as_read_here
from .quant import QRows, QTensor, join_rows, stack_rows
from .sharding import place_leaf


class TensorSource(Protocol):
    def has(self, name: str) -> bool: ...

    def get(self, name: str) -> np.ndarray: ...

    def describe(self, name: str) -> str:
        """Where a tensor lives, for errors: the file and the tensor's own name."""
        ...

    def get_packed(self, name: str) -> QTensor | None:
        """The tensor still quantized, as a host QTensor [rows, columns], or None where
        the file holds it as floats."""
        ...

    def get_packed_expert(self, name: str, e: int) -> QTensor | None:
        """Expert e of a stacked expert tensor, as get_packed (the tiered pool's reads)."""
        ...

    def release_pages(self) -> None:
        """The pages read so far out of the process's resident set (mapped_file.py); a
        later read faults them back in."""
        ...

    def file_rows(self, name: str) -> FileRows | None:
        """A quantized tensor as the file's own blocks over its mapping, for a lookup of a
        few rows (file_rows.py), or None where the file cannot give it so."""
        ...


def _get(source: TensorSource, name: str, shape: tuple[int, ...]) -> np.ndarray:
    w = source.get(name)
    if tuple(w.shape) != shape:
        raise ModelFileError(
            f"{source.describe(name)} has shape {tuple(w.shape)}, "
            f"expected {shape} from the model's config"
        )
    return np.asarray(w, dtype=np.float32)


def _matrix(source: TensorSource, parts: list[tuple[str, tuple[int, ...]]], quantized: bool):
    """The rows of `parts` ([out, in] each, as files hold them; [E, out, in] for a stack
    of experts) as one matrix: a QTensor [..., out, in] when quantized and the file holds
    every part quantized (a QRows where 2-D parts' layouts differ), else float32 [..., in,
    out] (x @ W)."""
    if quantized:
        packed = [p for p in (source.get_packed(name) for name, _ in parts) if p is not None]
        if len(packed) == len(parts):
            for p, (name, shape) in zip(packed, parts):
                if p.shape != shape:
                    raise ModelFileError(f"{source.describe(name)} has shape {p.shape}, "
                                         f"expected {shape} from the model's config")
            return packed[0] if len(packed) == 1 else (stack_rows if packed[0].values.ndim == 3 else join_rows)(packed)
    return np.concatenate([_get(source, name, shape) for name, shape in parts], axis=-2).swapaxes(-1, -2)


def pack_weights(cfg: ModelConfig, source: TensorSource, dtype=jnp.float32, experts: bool = True,
                 mesh: Mesh | None = None, quantized: bool = False) -> dict:
    """experts=False leaves the experts out (a tiered model reads them one by one from
    the source when the expert pool needs them); the routers are always packed.
    mesh: place every leaf in its shards on the mesh (sharding.py) instead of one device.
    quantized: keep the projections, the experts, the embedding and the LM head as the
    file quantized them (QTensor, quant.py); the norms and routers stay float32."""
    if mesh is None:
        def put(name: str, array: QTensor | QRows | np.ndarray, dtype) -> jax.Array:
            if isinstance(array, (QTensor, QRows)):
                if name != "embed" and not (name == "lm_head" and cfg.tie_embeddings):  # lookups take rows
                    array = as_read_here(array)
                return jax.device_put(array)
            return jnp.asarray(array, dtype=dtype)
    else:
        def put(name: str, array: QTensor | QRows | np.ndarray, dtype) -> jax.Array:
            if isinstance(array, (QTensor, QRows)):  # quantized=True goes with a mesh only where the file holds floats
                raise ValueError(f"{name}: quantized weights are not split over a mesh yet: load with --dtype float32")
            return place_leaf(cfg, mesh, name, array, dtype)

    d, hd = cfg.hidden_size, cfg.head_dim
    q_out, kv_out = cfg.n_heads * hd, cfg.n_kv_heads * hd
    f32 = jnp.float32
    # x @ W with W [d, V] is XLA:CPU's fastest form of the head's GEMV (a [V, d] operand
    # runs at about half the bandwidth), so a tied model keeps only this copy; a
    # quantized one keeps its [V, d] rows, which the kernels read.
    head = _matrix(source, [("embed" if cfg.tie_embeddings else "lm_head", (cfg.vocab_size, d))], quantized)
    weights: dict = {
        "lm_head": put("lm_head", head, dtype),
        "final_norm": put("final_norm", _get(source, "final_norm", (d,)), f32),
        "layers": [],
    }
    del head
    if not cfg.tie_embeddings:
        # read a few rows a step: quantized, it stays the file's blocks (not copied, on the CPU)
        rows = None if mesh is not None or not quantized else source.file_rows("embed")
        if rows is not None:
            if rows.shape != (cfg.vocab_size, d):
                raise ModelFileError(f"{source.describe('embed')} has shape {rows.shape}, expected "
                                     f"{(cfg.vocab_size, d)} from the model's config")
            weights["embed"] = jax.device_put(rows)
        else:
            embed = _matrix(source, [("embed", (cfg.vocab_size, d))], quantized)
            weights["embed"] = put("embed", embed if isinstance(embed, QTensor) else embed.T, dtype)
            del embed
    for i in range(cfg.n_layers):
        # What is built no longer needs the file's pages it was read from: dropped layer
        # by layer, the load holds one layer of the file resident, not all of it (the
        # whole MoE Q8_0 file, 387 MB, at the load's peak).
        source.release_pages()
        p = f"{i}."
        qkv = _matrix(source, [(p + "q", (q_out, d)), (p + "k", (kv_out, d)), (p + "v", (kv_out, d))],
                      quantized)
        layer = {
            "attn_norm": put("attn_norm", _get(source, p + "attn_norm", (d,)), f32),
            "wqkv": put("wqkv", qkv, dtype),
            "wo": put("wo", _matrix(source, [(p + "o", (d, q_out))], quantized), dtype),
            "ffn_norm": put("ffn_norm", _get(source, p + "ffn_norm", (d,)), f32),
        }
        del qkv
        if cfg.qk_norm != "none":
            q_norm, k_norm = (hd, hd) if cfg.qk_norm == "head" else (q_out, kv_out)
            layer["q_norm"] = put("q_norm", _get(source, p + "q_norm", (q_norm,)), f32)
            layer["k_norm"] = put("k_norm", _get(source, p + "k_norm", (k_norm,)), f32)
        if cfg.moe_layers[i]:
            e, f = cfg.n_experts, cfg.moe_intermediate_size
            layer["router"] = put("router", _get(source, p + "router", (e, d)).T, f32)
            if not experts:
                weights["layers"].append(layer)
                continue
            gate_up = _matrix(source, [(p + "experts.gate", (e, f, d)), (p + "experts.up", (e, f, d))],
                              quantized)
            layer["experts_gate_up"] = put("experts_gate_up", gate_up, dtype)
            del gate_up
            layer["experts_down"] = put("experts_down", _matrix(source, [(p + "experts.down", (e, d, f))],
                                                                quantized), dtype)
        else:
            ff = cfg.intermediate_size
            gate_up = _matrix(source, [(p + "gate", (ff, d)), (p + "up", (ff, d))], quantized)
            layer["w_gate_up"] = put("w_gate_up", gate_up, dtype)
            layer["w_down"] = put("w_down", _matrix(source, [(p + "down", (d, ff))], quantized), dtype)
        weights["layers"].append(layer)
    return weights


def _leaves(weights: dict) -> list:
    return jax.tree_util.tree_leaves(weights, is_leaf=lambda x: isinstance(x, (QTensor, FileRows)))


def count_parameters(weights: dict) -> int:
    return sum(int(np.prod(x.shape)) for x in _leaves(weights))


def weight_bytes(weights: dict) -> int:
    return sum(x.nbytes for x in _leaves(weights))


def _format(w: QTensor | QRows) -> str:
    if isinstance(w, QRows):
        return " | ".join(_format(p) for p in w.pieces)
    return (w.source or w.layout) + (" in panels of 16 rows" if w.layout in PANELS else "")


def weight_formats(weights: dict) -> dict[str, dict]:
    """Per tensor group (wqkv, wo, lm_head, ...): its formats, values and bytes."""
    groups: dict[str, dict] = {}

    def visit(name: str, leaf) -> None:
        if isinstance(leaf, FileRows):
            fmt = f"{leaf.source} (the file's blocks)"
        else:
            fmt = _format(leaf) if isinstance(leaf, (QTensor, QRows)) else str(np.dtype(leaf.dtype))
        group = groups.setdefault(name, {"formats": set(), "values": 0, "bytes": 0})
        group["formats"].add(fmt)
        group["values"] += int(np.prod(leaf.shape))
        group["bytes"] += leaf.nbytes

    for name, leaf in weights.items():
        if name != "layers":
            visit(name, leaf)
    for layer in weights["layers"]:
        for name, leaf in layer.items():
            visit(name, leaf)
    return {name: {**g, "formats": sorted(g["formats"])} for name, g in groups.items()}


def decode_bytes(cfg: ModelConfig, weights: dict) -> int:
    """The weight bytes one decode token reads: every matrix but the embedding (one row
    of it), and of each MoE layer's experts only the k a token is routed to."""
    total = 0
    for name, leaf in weights.items():
        if name == "layers":
            continue
        total += leaf.nbytes // leaf.shape[0] if name == "embed" else leaf.nbytes
    share = cfg.n_experts_per_tok / max(cfg.n_experts, 1)
    for layer in weights["layers"]:
        for name, leaf in layer.items():
            total += int(leaf.nbytes * share) if name.startswith("experts_") else leaf.nbytes
    return total


def is_quantized(weights: dict) -> bool:
    return any(isinstance(x, (QTensor, FileRows)) for x in _leaves(weights))
