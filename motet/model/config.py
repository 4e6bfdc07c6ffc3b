"""The static, hashable description of a model: what the forward functions specialise on.

Architectures differ by fields, not classes. A dense model is the case `n_experts == 0`.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Literal

from .errors import UnsupportedModelError

SUPPORTED_ARCHITECTURES = ("llama", "qwen3_moe", "olmoe", "mixtral")

# Hugging Face `architectures` / `model_type` and GGUF `general.architecture` names.
_HF_MODEL_TYPES = {
    "llama": "llama",
    "qwen3_moe": "qwen3_moe",
    "olmoe": "olmoe",
    "mixtral": "mixtral",
}
_GGUF_ARCHS = {"llama": "llama", "qwen3moe": "qwen3_moe", "olmoe": "olmoe"}

QkNorm = Literal["none", "head", "full"]
# The architectures that normalise queries and keys; the rest use "none".
_QK_NORMS: dict[str, QkNorm] = {"qwen3_moe": "head", "olmoe": "full"}


# What the quantized products may round x to (load_model's activations), and its bits.
ACTIVATIONS = {"int16": 16, "int8": 8}


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    vocab_size: int
    hidden_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int  # dense FFN width (dense layers only)
    rope_theta: float
    rms_eps: float
    max_context: int
    tie_embeddings: bool
    # none, head (RMSNorm over each head, Qwen3), full (over the whole projection, OLMoE)
    qk_norm: QkNorm = "none"
    n_experts: int = 0
    n_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    # Per layer: True where the layer's FFN is a mixture of experts.
    moe_layers: tuple[bool, ...] = ()
    # What the native quantized products round x to (load_model's activations): int16 per
    # 32 values, or 8: int8, as llama.cpp does, where a kernel has that form
    x_bits: int = 16

    def __post_init__(self):
        if self.arch not in SUPPORTED_ARCHITECTURES:
            raise unsupported_architecture(self.arch)
        if self.n_heads % self.n_kv_heads:
            raise UnsupportedModelError(
                f"{self.n_heads} attention heads is not a multiple of {self.n_kv_heads} KV heads"
            )
        if self.head_dim % 2:
            raise UnsupportedModelError(f"head_dim {self.head_dim} must be even for RoPE")
        if not self.moe_layers:
            object.__setattr__(self, "moe_layers", (self.n_experts > 0,) * self.n_layers)
        if len(self.moe_layers) != self.n_layers:
            raise ValueError("moe_layers must name every layer")

    @property
    def is_moe(self) -> bool:
        return any(self.moe_layers)

    @property
    def group_size(self) -> int:
        """Query heads per KV head (grouped-query attention)."""
        return self.n_heads // self.n_kv_heads


def unsupported_architecture(name: str) -> UnsupportedModelError:
    return UnsupportedModelError(
        f"unsupported architecture {name!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def _first(cfg: dict, *keys, default=None):
    for key in keys:
        if cfg.get(key) is not None:
            return cfg[key]
    return default


def _check_rope_scaling(scaling) -> None:
    if scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default"):
        raise UnsupportedModelError(f"unsupported rope_scaling {scaling!r}")


def config_from_hf(cfg: dict) -> ModelConfig:
    """From a Hugging Face `config.json` dict."""
    model_type = cfg.get("model_type") or ""
    arch = _HF_MODEL_TYPES.get(model_type)
    if arch is None:
        raise unsupported_architecture(model_type or str(cfg.get("architectures")))
    _check_rope_scaling(cfg.get("rope_scaling"))
    rope_params = cfg.get("rope_parameters") or {}
    _check_rope_scaling(rope_params)
    n_heads = cfg["num_attention_heads"]
    hidden = cfg["hidden_size"]
    n_layers = cfg["num_hidden_layers"]
    n_experts = _first(cfg, "num_experts", "num_local_experts", default=0)
    moe_layers = None
    if arch == "qwen3_moe":
        dense = set(cfg.get("mlp_only_layers") or ())
        step = cfg.get("decoder_sparse_step", 1)
        moe_layers = tuple(
            i not in dense and n_experts > 0 and (i + 1) % step == 0 for i in range(n_layers)
        )
    if arch in ("mixtral", "qwen3_moe") and cfg.get("sliding_window") and cfg.get(
        "use_sliding_window", arch == "mixtral"
    ):
        raise UnsupportedModelError("sliding-window attention is not supported")
    return ModelConfig(
        arch=arch,
        vocab_size=cfg["vocab_size"],
        hidden_size=hidden,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=cfg.get("num_key_value_heads") or n_heads,
        head_dim=cfg.get("head_dim") or hidden // n_heads,
        intermediate_size=cfg.get("intermediate_size", 0),
        rope_theta=float(_first(cfg, "rope_theta", default=rope_params.get("rope_theta", 10000.0))),
        rms_eps=float(_first(cfg, "rms_norm_eps", default=1e-6)),
        max_context=int(cfg.get("max_position_embeddings", 4096)),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qk_norm=_QK_NORMS.get(arch, "none"),
        n_experts=n_experts,
        n_experts_per_tok=_first(cfg, "num_experts_per_tok", default=0),
        moe_intermediate_size=(
            cfg.get("intermediate_size", 0)
            if arch in ("mixtral", "olmoe")
            else cfg.get("moe_intermediate_size", 0)
        ),
        # Mixtral's softmax over the top-k logits equals softmax-all, top-k, renormalise.
        norm_topk_prob=True if arch == "mixtral" else bool(cfg.get("norm_topk_prob", False)),
        moe_layers=moe_layers or (),
    )


# Architectures whose GGUF files carry no `expert_weights_norm` key but whose top-k
# routing weights llama.cpp renormalizes, as transformers does for their checkpoints
# (Qwen3-MoE's all set norm_topk_prob); OLMoE's are left as the softmax gave them.
_GGUF_RENORMALIZED = ("mixtral", "qwen3_moe")


def config_from_gguf(meta: dict, has_output_weight: bool,
                     tensor_names: Collection[str] | None = None) -> ModelConfig:
    """From GGUF metadata (`general.architecture` and its `<arch>.*` keys).

    tensor_names: the file's tensor names, which say which layers are MoE: those with a
    router (`blk.N.ffn_gate_inp.weight`). llama.cpp's MoE architectures have no metadata
    key for dense layers, yet a Qwen3-MoE checkpoint's `mlp_only_layers` are dense, stored
    as ffn_gate/ffn_up/ffn_down. Without the names every layer of a MoE model is MoE.
    """
    gguf_arch = str(meta.get("general.architecture", ""))
    arch = _GGUF_ARCHS.get(gguf_arch)
    if arch is None:
        raise unsupported_architecture(gguf_arch)

    def key(name, default=None):
        return meta.get(f"{gguf_arch}.{name}", default)

    if key("rope.scaling.type") not in (None, "none"):
        raise UnsupportedModelError(f"unsupported rope scaling {key('rope.scaling.type')!r}")
    n_heads = int(key("attention.head_count"))
    hidden = int(key("embedding_length"))
    n_experts = int(key("expert_count", 0))
    if arch == "llama" and n_experts:
        arch = "mixtral"  # llama.cpp stores Mixtral under the llama architecture
    vocab = key("vocab_size") or len(meta.get("tokenizer.ggml.tokens", ()))
    n_layers = int(key("block_count"))
    moe_layers: tuple[bool, ...] = ()
    if n_experts and tensor_names is not None:
        moe_layers = tuple(f"blk.{i}.ffn_gate_inp.weight" in tensor_names for i in range(n_layers))
        if not any(moe_layers):  # no router anywhere: all MoE, so loading names the missing one
            moe_layers = ()
    return ModelConfig(
        arch=arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=int(key("attention.head_count_kv", n_heads)),
        head_dim=int(key("attention.key_length", hidden // n_heads)),
        intermediate_size=int(key("feed_forward_length", 0)),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rms_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        max_context=int(key("context_length", 4096)),
        tie_embeddings=not has_output_weight,
        qk_norm=_QK_NORMS.get(arch, "none"),
        n_experts=n_experts,
        n_experts_per_tok=int(key("expert_used_count", 0)),
        # a dense model has no expert width (0, as config_from_hf gives)
        moe_intermediate_size=(
            int(key("expert_feed_forward_length", key("feed_forward_length", 0))) if n_experts else 0
        ),
        norm_topk_prob=bool(key("expert_weights_norm", arch in _GGUF_RENORMALIZED)),
        moe_layers=moe_layers,
    )
