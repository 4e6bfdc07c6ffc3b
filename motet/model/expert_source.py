"""Readers of one expert at a time, for the tiered pool's disk tier: from the model file
(safetensors or GGUF, both mmapped: an expert read touches only its own bytes), or from
arrays already in memory (a model loaded whole, the benchmark's mmapped .npy files).

An expert comes as (gate_up, down) in the packed layout of weights.py: float32
gate_up [d, 2f] and down [f, d], or, from a quantized file read quantized, QTensors
gate_up [2f, d] and down [d, f] holding the file's own values."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np

from .config import ModelConfig
from .quant import QTensor, host_index, stack, stack_rows
from .sharding import TP, canonical_gate_up, mesh_of, place_leaf


def moe_layer_indices(cfg: ModelConfig) -> list[int]:
    """The model layers that are MoE, in order: MoE layer r is model layer [r]."""
    return [i for i in range(cfg.n_layers) if cfg.moe_layers[i]]


def pack_expert(gate: np.ndarray, up: np.ndarray, down: np.ndarray):
    """Hugging Face orientation (gate, up [f, d], down [d, f]) → the packed layout of
    weights.py for one expert: gate_up [d, 2f], down [f, d], float32."""
    gate_up = np.concatenate([gate, up], axis=0).T
    return (np.ascontiguousarray(gate_up, np.float32), np.ascontiguousarray(down.T, np.float32))


class SourceExpertReader:
    """Experts straight from the model file through its TensorSource. quantized: as the
    file holds them (get_packed_expert), where it holds all three matrices quantized."""

    def __init__(self, cfg: ModelConfig, source, quantized: bool = False):
        self.source, self.quantized = source, quantized
        self.layers = moe_layer_indices(cfg)

    def read(self, r: int, e: int):
        p = f"{self.layers[r]}.experts."
        if self.quantized:
            gate, up, down = (self.source.get_packed_expert(p + k, e) for k in ("gate", "up", "down"))
            if gate is not None and up is not None and down is not None:
                return stack_rows([gate, up]), down
        get = self.source.get_expert
        return pack_expert(get(p + "gate", e), get(p + "up", e), get(p + "down", e))


class ArrayExpertReader:
    """Experts from packed per-layer stacks (gate_up, down: arrays [E, d, 2f], [E, f, d]
    or QTensors [E, 2f, d], [E, d, f]) — JAX arrays of a model loaded whole, or
    np.memmap views of files."""

    def __init__(self, gate_up: Sequence, down: Sequence):
        self.gate_up, self.down = list(gate_up), list(down)
        self._host: dict[int, tuple] = {}

    @classmethod
    def from_weights(cls, cfg: ModelConfig, weights: dict) -> ArrayExpertReader:
        """Weights placed on a mesh (of one process) are read back in the file's layout
        (the pool puts each expert in its mesh's layout as it reads it)."""
        layers = [weights["layers"][i] for i in moe_layer_indices(cfg)]
        gate_up = [x["experts_gate_up"] for x in layers]
        if (mesh := mesh_of(weights)) is not None:
            gate_up = [canonical_gate_up(np.asarray(leaf), mesh.shape[TP]) for leaf in gate_up]
        return cls(gate_up, [x["experts_down"] for x in layers])

    def read(self, r: int, e: int):
        if r not in self._host:  # a JAX array's host view once per layer, not per read
            self._host[r] = jax.tree.map(np.asarray, (self.gate_up[r], self.down[r]))
        gu, dn = (host_index(w, e) for w in self._host[r])
        if isinstance(gu, QTensor):
            return gu, dn
        return gu.astype(np.float32, copy=False), dn.astype(np.float32, copy=False)


def expert_bytes(model) -> int:
    """Bytes one expert takes on the device (the most over the MoE layers: a quantized
    file may give some layers more bits), as packed or as its reader reads it (floats in
    the model's dtype, as the pool holds them)."""
    layers = moe_layer_indices(model.config)
    if not layers:
        return 0
    if model.expert_reader is None:
        return max(sum(model.weights["layers"][i][k].nbytes for k in ("experts_gate_up", "experts_down"))
                   // model.config.n_experts for i in layers)
    itemsize = model.weights["lm_head"].dtype.itemsize

    def size(w) -> int:
        return w.nbytes if isinstance(w, QTensor) else w.size * itemsize

    return max(sum(size(w) for w in model.expert_reader.read(r, 0)) for r in range(len(layers)))


def with_packed_experts(model):
    """The model with every expert packed into its weights (resident), read one by one
    through its expert_reader: for a model loaded lazily whose experts turn out to fit.
    On a mesh (the shared weights placed there), each stack goes into its shards."""
    cfg, reader = model.config, model.expert_reader
    dtype = model.weights["lm_head"].dtype
    mesh = mesh_of(model.weights)
    layers = [dict(layer) for layer in model.weights["layers"]]
    for r, i in enumerate(moe_layer_indices(cfg)):
        experts = [reader.read(r, e) for e in range(cfg.n_experts)]
        for key, which in (("experts_gate_up", 0), ("experts_down", 1)):
            stacked = stack([x[which] for x in experts])
            if mesh is not None:
                layers[i][key] = place_leaf(cfg, mesh, key, stacked, dtype)
            else:
                layers[i][key] = (jax.device_put(stacked) if isinstance(stacked, QTensor)
                                  else jnp.asarray(stacked, dtype))
        del experts
    return replace(model, weights={**model.weights, "layers": layers}, expert_reader=None)
