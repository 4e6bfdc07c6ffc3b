"""Sharding over a JAX device Mesh on one process: experts along `ep`, attention heads
and FFN widths along `tp` (Megatron style), KV with its heads.

The forward pass runs inside one `jax.shard_map` over the mesh (forward.py), so every
collective is explicit; per layer:

  attention   wqkv column-parallel by heads (each tp shard holds its own q, k, v heads),
              wo row-parallel → psum over tp of [t, d]
  dense FFN   gate_up column-parallel, down row-parallel → psum over tp of [t, d]
  MoE FFN     tokens replicated; each (ep, tp) device runs its own experts (E/ep of
              them, f/tp of each one's width) over the assignments routed to them,
              the others skipped → psum over (ep, tp) of [t, d]

Routers, norms, the embedding and the LM head are replicated. The KV cache is
[slots, kv_heads, ...] split along kv_heads by tp (replicated along ep). Where tp is a
multiple of the KV heads (Qwen3-MoE's 4 at tp=8), each KV head is repeated on
tp / kv_heads devices, as vLLM does: the model is loaded as one with tp KV heads
(KVHeadsRepeated), so each device holds one, and the KV cache that many times over. Weights go
from host arrays straight into their shards (`jax.device_put` with a NamedSharding,
leaf by leaf): no device ever holds a full copy of a sharded leaf.

Axis names: "ep" (expert-parallel) and "tp" (tensor-parallel); the mesh is ep × tp with
tp the inner (fastest-varying) axis, so a tp group is neighbouring devices.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from .config import ModelConfig

EP, TP = "ep", "tp"
AXES = (EP, TP)

# How each weight leaf (by its name in weights.py's pytree) is split; absent: replicated.
_COLUMNS_BY_HEAD = P(None, TP)
LEAF_SPECS = {
    "wqkv": _COLUMNS_BY_HEAD,  # after _by_shard reordering: [q_s | k_s | v_s] per shard s
    "wo": P(TP, None),
    "w_gate_up": P(None, TP),  # after reordering: [gate_s | up_s] per shard s
    "w_down": P(TP, None),
    "experts_gate_up": P(EP, None, TP),
    "experts_down": P(EP, TP, None),
}
# The KV cache, K [slots, kv_heads, blocks, head_dim, KEY_BLOCK] (kv_layout.py) and V
# [slots, kv_heads, length, head_dim]: both split along kv_heads (an 8-bit cache's scales [slots, kv_heads, length]
# too: the spec names the first two axes only).
KV_SPEC = P(None, TP)


@dataclass(frozen=True)
class MeshSpec:
    """A device layout: ep expert-parallel × tp tensor-parallel devices."""

    ep: int = 1
    tp: int = 1

    def __post_init__(self):
        for axis in AXES:
            size = getattr(self, axis)
            if not isinstance(size, int) or size < 1:
                raise ValueError(f"mesh axis {axis} must be a positive integer, got {size!r}")

    @classmethod
    def parse(cls, text: str) -> MeshSpec:
        """From "ep=4,tp=2" (either axis may be left out; it is then 1)."""
        sizes: dict[str, int] = {}
        for part in text.replace(" ", "").split(","):
            if not part:
                continue
            name, eq, value = part.partition("=")
            if not eq or name not in AXES:
                raise ValueError(
                    f"bad mesh {text!r}: each part is ep=N or tp=N (expert- and tensor-parallel), got {part!r}"
                )
            if name in sizes:
                raise ValueError(f"bad mesh {text!r}: axis {name} is given twice")
            if not value.isdigit() or int(value) < 1:
                raise ValueError(f"bad mesh {text!r}: {name} must be a positive integer, got {value!r}")
            sizes[name] = int(value)
        if not sizes:
            raise ValueError(f"bad mesh {text!r}: name at least one axis, e.g. ep=4 or ep=2,tp=2")
        return cls(**sizes)

    @classmethod
    def of(cls, mesh: MeshSpec | str) -> MeshSpec:
        return mesh if isinstance(mesh, MeshSpec) else cls.parse(mesh)

    @property
    def size(self) -> int:
        return self.ep * self.tp

    def __str__(self) -> str:
        return f"ep={self.ep},tp={self.tp}"

    def check(self, cfg: ModelConfig) -> None:
        """Raise ValueError unless the model splits evenly over this layout."""
        problems = []
        if self.ep > 1 and not cfg.is_moe:
            problems.append(f"ep={self.ep} needs a mixture-of-experts model ({cfg.arch} is dense)")
        elif cfg.is_moe and cfg.n_experts % self.ep:
            problems.append(f"{cfg.n_experts} experts do not divide into ep={self.ep} equal shares")
        if not head_split_fits(cfg, self.tp):
            fits = [tp for tp in range(1, 2 * max(self.tp, cfg.n_heads) + 1) if head_split_fits(cfg, tp)]
            near = sorted(fits, key=lambda tp: (abs(tp - self.tp), tp))[:2]
            problems.append(f"{cfg.n_heads} attention heads over {cfg.n_kv_heads} KV heads do not split into "
                            f"tp={self.tp} (the query heads must divide by tp, and tp and the KV heads one by "
                            f"the other); tp={' or tp='.join(map(str, sorted(near)))} would")
        if cfg.is_moe and cfg.moe_intermediate_size % self.tp:
            problems.append(f"expert width {cfg.moe_intermediate_size} does not divide by tp={self.tp}")
        if not all(cfg.moe_layers) and cfg.intermediate_size % self.tp:
            problems.append(f"dense FFN width {cfg.intermediate_size} does not divide by tp={self.tp}")
        if problems:
            raise ValueError(f"mesh {self} does not fit this model: " + "; ".join(problems))

    def build(self, devices=None) -> Mesh:
        """The Mesh over the first `size` devices (default: jax.devices())."""
        devices = list(jax.devices() if devices is None else devices)
        if len(devices) < self.size:
            raise ValueError(
                f"mesh {self} needs {self.size} devices, but only {len(devices)} "
                f"{'is' if len(devices) == 1 else 'are'} visible to JAX"
            )
        return Mesh(np.array(devices[: self.size]).reshape(self.ep, self.tp), AXES)


def local_config(cfg: ModelConfig, mesh: Mesh) -> ModelConfig:
    """The config as one shard sees it: its own attention and KV heads."""
    tp = mesh.shape[TP]
    return replace(cfg, n_heads=cfg.n_heads // tp, n_kv_heads=cfg.n_kv_heads // tp)


def head_split_fits(cfg: ModelConfig, tp: int) -> bool:
    """Whether tp devices split the attention: the query heads evenly, and the KV heads
    evenly or each repeated on tp / kv_heads of them."""
    return cfg.n_heads % tp == 0 and (cfg.n_kv_heads % tp == 0 or tp % cfg.n_kv_heads == 0)


def kv_repeats(cfg: ModelConfig, tp: int) -> int:
    """How many devices hold each KV head (1: the heads are split, not repeated)."""
    return tp // cfg.n_kv_heads if tp > cfg.n_kv_heads else 1


class KVHeadsRepeated:
    """A TensorSource (weights.py) whose K and V projections (and a per-channel K norm)
    have each KV head repeated `times` times in a row, for a model config with that many
    times the KV heads: head h becomes heads h·times … h·times + times - 1, so query head i
    still reads its own KV head (i // group)."""

    def __init__(self, source, cfg: ModelConfig, times: int):
        self.source, self.times, self.head_dim = source, times, cfg.head_dim
        self.repeated = (".k", ".v") + ((".k_norm",) if cfg.qk_norm == "full" else ())

    def has(self, name: str) -> bool:
        return self.source.has(name)

    def describe(self, name: str) -> str:
        return self.source.describe(name)

    def get(self, name: str) -> np.ndarray:
        tensor = np.asarray(self.source.get(name))
        if not name.endswith(self.repeated):
            return tensor
        heads = tensor.reshape(-1, self.head_dim, *tensor.shape[1:])
        return np.repeat(heads, self.times, axis=0).reshape(-1, *tensor.shape[1:])

    def get_packed(self, name: str):
        return None if name.endswith(self.repeated) else self.source.get_packed(name)

    def get_packed_expert(self, name: str, e: int):
        return self.source.get_packed_expert(name, e)

    def release_pages(self) -> None:
        self.source.release_pages()

    def file_rows(self, name: str) -> None:  # a mesh splits every leaf: none stays the file's
        return None


def model_mesh(mesh: MeshSpec | str | Mesh, cfg: ModelConfig) -> Mesh:
    """A checked Mesh for this model, from a spec, a string or a Mesh with axes (ep, tp)."""
    if isinstance(mesh, Mesh):
        if tuple(mesh.axis_names) != AXES:
            raise ValueError(f"a model mesh has the axes {AXES}, got {tuple(mesh.axis_names)}")
        MeshSpec(mesh.shape[EP], mesh.shape[TP]).check(cfg)
        return mesh
    spec = MeshSpec.of(mesh)
    spec.check(cfg)
    return spec.build()


def mesh_of(weights: dict) -> Mesh | None:
    """The mesh a model's weights were placed on by place_leaf/place_weights (None: one
    device). The weights carry their layout: a sharded pytree runs only on its mesh."""
    leaf = weights["lm_head"]
    if isinstance(leaf, jax.core.Tracer):
        return None
    sharding = getattr(leaf, "sharding", None)
    # a placed array's mesh is concrete (an AbstractMesh appears only under tracing)
    mesh = sharding.mesh if isinstance(sharding, NamedSharding) else None
    if isinstance(mesh, Mesh) and mesh.axis_names == AXES and mesh.size > 1:
        return mesh
    return None


def mesh_axis(mesh: MeshSpec | str | Mesh, axis: str) -> int:
    """The size of an axis of a mesh given as a spec, a string or a Mesh."""
    return mesh.shape[axis] if isinstance(mesh, Mesh) else getattr(MeshSpec.of(mesh), axis)


def axis_size(mesh: Mesh | None, axis: str) -> int:
    return 1 if mesh is None else mesh.shape[axis]


# ---- weights ---------------------------------------------------------------------------


def _by_shard(array: np.ndarray, parts: list[int], shards: int) -> np.ndarray:
    """Reorder the last axis, made of consecutive parts of the given widths, so that
    shard s of an even split holds the s-th slice of every part, in part order."""
    pieces = np.split(array, np.cumsum(parts)[:-1], axis=-1)
    return np.concatenate(
        [np.split(piece, shards, axis=-1)[s] for s in range(shards) for piece in pieces], axis=-1
    )


def host_layout(cfg: ModelConfig, name: str, array: np.ndarray, tp: int) -> np.ndarray:
    """A leaf in the column order its tp shards need (fused matrices interleaved by
    shard); the array itself where nothing moves."""
    if tp == 1:
        return array
    if name == "wqkv":
        q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        return _by_shard(array, [q, kv, kv], tp)
    if name in ("w_gate_up", "experts_gate_up"):
        return gate_up_layout(array, tp)
    return array


def gate_up_layout(array: np.ndarray, tp: int) -> np.ndarray:
    """A fused gate/up leaf as host_layout gives it; it needs no config (the expert pool's)."""
    half = array.shape[-1] // 2
    return _by_shard(array, [half, half], tp) if tp > 1 else array


def canonical_gate_up(array: np.ndarray, tp: int) -> np.ndarray:
    """gate_up_layout undone: [gate | up] again from the columns of tp shards."""
    if tp == 1:
        return array
    halves = [np.split(shard, 2, axis=-1) for shard in np.split(array, tp, axis=-1)]
    return np.concatenate([gate for gate, _ in halves] + [up for _, up in halves], axis=-1)


def leaf_spec(cfg: ModelConfig, name: str) -> P:
    if name in ("q_norm", "k_norm") and cfg.qk_norm == "full":
        return P(TP)  # one weight per channel of the whole projection: split with the heads
    return LEAF_SPECS.get(name, P())


def place_leaf(cfg: ModelConfig, mesh: Mesh, name: str, array: np.ndarray, dtype) -> jax.Array:
    """Host array (canonical layout, weights.py) → its shards on the mesh's devices."""
    host = np.ascontiguousarray(host_layout(cfg, name, np.asarray(array), mesh.shape[TP]), np.dtype(dtype))
    return jax.device_put(host, NamedSharding(mesh, leaf_spec(cfg, name)))


def place_weights(weights: dict, cfg: ModelConfig, mesh: Mesh) -> dict:
    """A packed (one-device or host) pytree → the same pytree sharded over the mesh, leaf
    by leaf through the host."""

    def put(name, leaf):
        return place_leaf(cfg, mesh, name, np.asarray(leaf), leaf.dtype)

    out = {name: put(name, leaf) for name, leaf in weights.items() if name != "layers"}
    out["layers"] = [{name: put(name, leaf) for name, leaf in layer.items()} for layer in weights["layers"]]
    return out


def weight_specs(cfg: ModelConfig, weights: dict) -> dict:
    """The pytree of PartitionSpecs matching `weights` (shard_map's in_specs)."""
    out: dict[str, P | list[dict[str, P]]] = {name: leaf_spec(cfg, name) for name in weights if name != "layers"}
    out["layers"] = [{name: leaf_spec(cfg, name) for name in layer} for layer in weights["layers"]]
    return out


def kv_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, KV_SPEC)


# ---- communication per step (benchmarks, docs) ----------------------------------------


def step_traffic(cfg: ModelConfig, spec: MeshSpec, rows: int, itemsize: int = 4) -> dict:
    """Bytes each device sends per decode step of `rows` tokens (ring all-reduce: a psum of
    n bytes over g devices sends 2·n·(g-1)/g per device), by collective."""

    def ring(nbytes: int, group: int) -> float:
        return 2 * nbytes * (group - 1) / group if group > 1 else 0.0

    act = rows * cfg.hidden_size * itemsize  # one [t, d] activation
    moe = sum(cfg.moe_layers)
    dense = cfg.n_layers - moe
    attn = cfg.n_layers * ring(act, spec.tp)
    ffn = dense * ring(act, spec.tp) + moe * ring(act, spec.size)
    return {"attention_psum": attn, "ffn_psum": ffn, "total": attn + ffn,
            "psums_per_step": (cfg.n_layers + dense) * (spec.tp > 1) + moe * (spec.size > 1)}


def moe_layer_traffic(cfg: ModelConfig, ep: int, rows: int, itemsize: int = 4) -> dict:
    """Bytes each device sends per MoE layer for `rows` tokens over ep devices, two ways:
    replicate-and-psum (motet's step: every device holds every token, a psum of [t, d]
    adds the experts' shares) against all-to-all dispatch (data-parallel attention: each
    device holds t/ep tokens and sends each to the devices of its k experts, which send
    the results back). Dispatch counts the expected remote devices among a token's k
    experts spread evenly, (ep - 1)·(1 - (1 - 1/ep)^k); with fewer tokens than devices
    a device holds one token or none (the busiest one is counted)."""
    token = cfg.hidden_size * itemsize
    psum = 2 * rows * token * (ep - 1) / ep if ep > 1 else 0.0
    remote = (ep - 1) * (1 - (1 - 1 / ep) ** cfg.n_experts_per_tok) if ep > 1 else 0.0
    held = max(rows / ep, 1.0) if ep > 1 else 0.0
    return {"psum": psum, "dispatch": 2 * held * remote * token}
