"""Readers of one expert at a time, for the tiered pool's disk tier: from the model file
(safetensors or GGUF, both mmapped: an expert read touches only its own bytes), or from
arrays already in memory (a model loaded whole, the benchmark's mmapped .npy files)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .config import ModelConfig


def moe_layer_indices(cfg: ModelConfig) -> list[int]:
    """The model layers that are MoE, in order: MoE layer r is model layer [r]."""
    return [i for i in range(cfg.n_layers) if cfg.moe_layers[i]]


def pack_expert(gate: np.ndarray, up: np.ndarray, down: np.ndarray):
    """Hugging Face orientation (gate, up [f, d], down [d, f]) → the packed layout of
    weights.py for one expert: gate_up [d, 2f], down [f, d], float32."""
    gate_up = np.concatenate([gate, up], axis=0).T
    return (np.ascontiguousarray(gate_up, np.float32), np.ascontiguousarray(down.T, np.float32))


class SourceExpertReader:
    """Experts straight from the model file through its TensorSource's get_expert."""

    def __init__(self, cfg: ModelConfig, source):
        self.source = source
        self.layers = moe_layer_indices(cfg)

    def read(self, r: int, e: int):
        p = f"{self.layers[r]}.experts."
        get = self.source.get_expert
        return pack_expert(get(p + "gate", e), get(p + "up", e), get(p + "down", e))


class ArrayExpertReader:
    """Experts from packed per-layer arrays (gate_up [E, d, 2f], down [E, f, d]) — JAX
    arrays of a model loaded whole, or np.memmap views of files."""

    def __init__(self, gate_up: Sequence, down: Sequence):
        self.gate_up, self.down = list(gate_up), list(down)
        self._host: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    @classmethod
    def from_weights(cls, cfg: ModelConfig, weights: dict) -> ArrayExpertReader:
        layers = [weights["layers"][i] for i in moe_layer_indices(cfg)]
        return cls([x["experts_gate_up"] for x in layers], [x["experts_down"] for x in layers])

    def read(self, r: int, e: int):
        if r not in self._host:  # a JAX array's host view once per layer, not per read
            self._host[r] = (np.asarray(self.gate_up[r]), np.asarray(self.down[r]))
        gu, dn = self._host[r]
        return np.array(gu[e], np.float32), np.array(dn[e], np.float32)


def with_packed_experts(model):
    """The model with every expert packed into its weights (resident), read one by one
    through its expert_reader: for a model loaded lazily whose experts turn out to fit."""
    from dataclasses import replace

    import jax.numpy as jnp

    cfg, reader = model.config, model.expert_reader
    dtype = model.weights["lm_head"].dtype
    layers = [dict(layer) for layer in model.weights["layers"]]
    for r, i in enumerate(moe_layer_indices(cfg)):
        experts = [reader.read(r, e) for e in range(cfg.n_experts)]
        layers[i]["experts_gate_up"] = jnp.asarray(np.stack([gu for gu, _ in experts]), dtype)
        layers[i]["experts_down"] = jnp.asarray(np.stack([dn for _, dn in experts]), dtype)
        del experts
    return replace(model, weights={**model.weights, "layers": layers}, expert_reader=None)
