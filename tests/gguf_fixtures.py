"""GGUF files made from the tiny Hugging Face checkpoints in tests/golden, laid out as
llama.cpp's convert_hf_to_gguf.py lays them out: its architecture names, metadata keys,
tensor names and orientation, the Q/K row permutation of the "llama" architecture, and a
byte-level BPE tokenizer. So motet's GGUF reader is tested on the files it will meet,
against the same goldens as the Hugging Face reader. write_tensors takes a config dict and
tensors held in memory instead (benchmarks/moe_gguf.py writes its random models with it).

Where this writer departs from the converter, on purpose:
  * tokenizer.ggml.pre is "gpt-2": the converter names the pre-tokenizer by hashing a
    known model's tokenization, which these 512-token vocabularies match none of; their
    pre-tokenizer is the plain GPT-2 byte-level split.
  * OLMoE keeps the checkpoint's rms_norm_eps. The converter overwrites it with 1e-5 (the
    released OLMoE's value), which for these checkpoints (1e-6) is another model.
  * A Qwen3-MoE checkpoint's dense (mlp_only) layers are written as ffn_gate/ffn_up/
    ffn_down. The converter cannot convert them (qwen3moe has no dense FFN tensors in
    gguf-py's tables); real Qwen3-MoE models have none.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q
from safetensors.numpy import load_file

# Hugging Face model_type -> GGUF general.architecture. Mixtral is stored as "llama"
# with experts, as the converter's LlamaModel (registered for MixtralForCausalLM) does.
GGUF_ARCH = {"llama": "llama", "mixtral": "llama", "qwen3_moe": "qwen3moe", "olmoe": "olmoe"}

# A policy gets each weight (GGUF name, float32 array as stored: rows [out, in], experts
# [E, out, in]) and returns (raw bytes, type), or None to keep it float32.
Policy = Callable[[str, np.ndarray], "tuple[np.ndarray, Q] | None"]

_TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
_LAYER = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
    "block_sparse_moe.gate": "ffn_gate_inp",
}
# Per-expert projections, stacked into one [E, out, in] tensor per layer. Mixtral's w1,
# w3 and w2 are gate, up and down.
_EXPERT = {"gate_proj": "ffn_gate_exps", "w1": "ffn_gate_exps", "up_proj": "ffn_up_exps",
           "w3": "ffn_up_exps", "down_proj": "ffn_down_exps", "w2": "ffn_down_exps"}
_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)\.weight")
_EXPERT_RE = re.compile(r"(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)")
_KNOWN = {n.format(bid=0).replace("blk.0.", "") for n in gguf.TENSOR_NAMES.values()}


def permute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """The converter's LlamaModel.permute: within each head, rows (first half, second
    half) of Hugging Face's half-split rotary layout become interleaved pairs, the order
    llama.cpp's "normal" RoPE rotates. motet's gguf_file.unpermute_rope_rows undoes it."""
    rows = w.shape[0]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_hf(hf_dir: Path) -> tuple[dict, dict[str, np.ndarray]]:
    """A checkpoint directory's config.json and its tensors (Hugging Face names, float32)."""
    hf_dir = Path(hf_dir)
    hf = json.loads((hf_dir / "config.json").read_text())
    raw: dict[str, np.ndarray] = {}
    for shard in sorted(hf_dir.glob("*.safetensors")):
        raw.update((name, np.asarray(a, dtype=np.float32)) for name, a in load_file(shard).items())
    return hf, raw


def gguf_tensors(raw: dict[str, np.ndarray], hf: dict) -> dict[str, np.ndarray]:
    """Hugging Face name -> array to GGUF name -> array: experts stacked, Q/K permuted for
    "llama". Arrays keep their dtype (float32 or float16)."""
    out: dict[str, np.ndarray] = {}
    experts: dict[str, dict[int, np.ndarray]] = {}
    for name, array in raw.items():
        if name.removesuffix(".weight") in _TOP:
            out[_TOP[name.removesuffix(".weight")] + ".weight"] = array
            continue
        m = _LAYER_RE.fullmatch(name)
        if m is None:
            raise ValueError(f"no GGUF name for tensor {name!r}")
        layer, rest = m.groups()
        if e := _EXPERT_RE.fullmatch(rest):
            experts.setdefault(f"blk.{layer}.{_EXPERT[e[2]]}.weight", {})[int(e[1])] = array
        elif rest in _LAYER:
            out[f"blk.{layer}.{_LAYER[rest]}.weight"] = array
        else:
            raise ValueError(f"no GGUF name for tensor {name!r}")
    for name, by_index in experts.items():
        out[name] = np.stack([by_index[i] for i in range(len(by_index))])
    if GGUF_ARCH[hf["model_type"]] == "llama":
        # The converter's LlamaModel permutes Q by the query heads and K by the KV heads.
        heads = {"attn_q": hf["num_attention_heads"],
                 "attn_k": hf.get("num_key_value_heads") or hf["num_attention_heads"]}
        for name, w in out.items():
            if (kind := name.split(".")[-2]) in heads:
                out[name] = permute_rope_rows(w, heads[kind])
    for name in out:  # every name one llama.cpp knows (gguf-py's table)
        assert re.sub(r"^blk\.\d+\.", "", name.removesuffix(".weight")) in _KNOWN, name
    return out


def _metadata(w: gguf.GGUFWriter, hf: dict) -> None:
    """The keys the converter's TextModel.set_gguf_parameters and the architecture's
    class write, from the same config.json fields."""
    arch = hf["model_type"]
    w.add_block_count(hf["num_hidden_layers"])
    w.add_context_length(hf["max_position_embeddings"])
    w.add_embedding_length(hf["hidden_size"])
    w.add_feed_forward_length(hf["intermediate_size"])
    w.add_head_count(hf["num_attention_heads"])
    w.add_head_count_kv(hf.get("num_key_value_heads") or hf["num_attention_heads"])
    rope = hf.get("rope_parameters") or {}
    w.add_rope_freq_base(float(hf.get("rope_theta") or rope.get("rope_theta", 10000.0)))
    w.add_layer_norm_rms_eps(hf["rms_norm_eps"])
    if (n_experts := hf.get("num_local_experts") or hf.get("num_experts")) is not None:
        w.add_expert_count(n_experts)
        w.add_expert_used_count(hf["num_experts_per_tok"])
    if (head_dim := hf.get("head_dim")) is not None:  # written only where config.json has it
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if arch == "qwen3_moe":
        # Qwen2MoeModel adds the experts' width. Nothing is written for norm_topk_prob:
        # llama.cpp renormalizes Qwen3-MoE's top-k weights unconditionally.
        w.add_expert_feed_forward_length(hf["moe_intermediate_size"])
    if GGUF_ARCH[arch] == "llama":  # LlamaModel
        w.add_vocab_size(hf["vocab_size"])
        w.add_rope_dimension_count(hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"])


def add_tokenizer(w: gguf.GGUFWriter, hf_dir: Path, vocab_size: int) -> None:
    """The converter's _set_vocab_gpt2, from tokenizer.json instead of AutoTokenizer."""
    spec = json.loads((hf_dir / "tokenizer.json").read_text())
    pre = spec.get("pre_tokenizer") or {}
    if spec["model"]["type"] != "BPE" or pre.get("type") != "ByteLevel" or not pre.get("use_regex", True):
        raise ValueError(f"{hf_dir}: not a GPT-2 style byte-level BPE tokenizer")
    by_id = {i: (t, gguf.TokenType.NORMAL) for t, i in spec["model"]["vocab"].items()}
    for added in spec.get("added_tokens", ()):
        text = added["content"]
        looks_special = text.startswith("<|") and text.endswith("|>")
        kind = gguf.TokenType.CONTROL if added["special"] or looks_special else gguf.TokenType.USER_DEFINED
        by_id[added["id"]] = (text, kind)
    # Ids the tokenizer leaves unused up to the embedding's size are padding, as there.
    tokens = [by_id.get(i, (f"[PAD{i}]", gguf.TokenType.UNUSED)) for i in range(vocab_size)]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list([t for t, _ in tokens])
    w.add_token_types([int(k) for _, k in tokens])
    # Merges, BOS/EOS/UNK/PAD ids, add_bos_token (from the post-processor) and the chat
    # template from tokenizer_config.json: gguf-py's own reader, which the converter calls.
    gguf.SpecialVocab(hf_dir, load_merges=True, n_vocab=vocab_size).add_to_gguf(w, quiet=True)


def _keeps_f32(name: str, array: np.ndarray) -> bool:
    # llama.cpp keeps norms (1-D) and the router (ffn_gate_inp) in F32 in every mix.
    return array.ndim < 2 or ".ffn_gate_inp." in name


def write_gguf(hf_dir: Path, out: Path, quantize: Policy | None = None) -> Path:
    """Convert the checkpoint in hf_dir to a GGUF file at out. quantize: None writes every
    tensor float32; a policy (simple(), mix()) picks each weight's type."""
    hf_dir = Path(hf_dir)
    hf, raw = read_hf(hf_dir)
    return write_tensors(out, hf, raw, lambda w: add_tokenizer(w, hf_dir, hf["vocab_size"]), quantize)


def write_tensors(out: Path, hf: dict, raw: dict[str, np.ndarray],
                  tokenizer: Callable[[gguf.GGUFWriter], None], quantize: Policy | None = None) -> Path:
    """A GGUF file at out from a config.json dict and its tensors by Hugging Face name, held
    in memory. tokenizer(writer) adds the tokenizer.* keys. quantize: None writes each
    weight in its own dtype (float32 or float16: a "MOSTLY_F16" file) and norms and
    routers float32; a policy (simple(), mix()) picks each weight's type."""
    if hf.get("model_type") not in GGUF_ARCH:
        raise ValueError(f"model_type {hf.get('model_type')!r} is not one of {sorted(GGUF_ARCH)}")
    tensors = gguf_tensors(raw, hf)
    writer = gguf.GGUFWriter(Path(out), GGUF_ARCH[hf["model_type"]])  # writes general.architecture
    _metadata(writer, hf)
    tokenizer(writer)
    if quantize is None:
        half = any(a.dtype == np.float16 for a in tensors.values())
        writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if half else gguf.LlamaFileType.ALL_F32)
    for name, array in tensors.items():
        if _keeps_f32(name, array):
            writer.add_tensor(name, array.astype(np.float32, copy=False))
        elif quantize is None or (packed := quantize(name, array)) is None:
            writer.add_tensor(name, array)
        else:
            raw_bytes, kind = packed
            writer.add_tensor(name, raw_bytes, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(out)


# -- quantization policies --------------------------------------------------------------

def fits(array: np.ndarray, kind: Q) -> bool:
    """Whether a weight can be stored as kind: a matrix or an expert stack whose rows
    split into whole blocks."""
    block, _ = gguf.GGML_QUANT_SIZES[kind]
    return array.ndim in (2, 3) and array.shape[-1] % block == 0


def mix(pick: Callable[[str, np.ndarray], Q | None],
        quantizer: Callable[[np.ndarray, Q], np.ndarray] = gguf.quants.quantize) -> Policy:
    """A policy from pick(name, array) -> type (None: float32), quantized by
    quantizer(array, type) -> raw bytes. A weight whose rows do not fit the type's blocks
    stays float32. A Q4_K_M-like mix is a pick by name with tests/kquants.quantize_k."""
    def policy(name: str, array: np.ndarray):
        kind = pick(name, array)
        if kind is None or not fits(array, kind):
            return None
        return quantizer(array, kind), kind

    return policy


def simple(kind: Q | str) -> Policy:
    """Every weight as one legacy type (Q8_0, Q4_0 or Q4_1), by gguf-py's quantizer."""
    kind = Q[kind] if isinstance(kind, str) else kind
    if kind not in (Q.Q8_0, Q.Q4_0, Q.Q4_1):
        raise ValueError(f"simple() quantizes Q8_0, Q4_0 or Q4_1, not {kind.name}")
    return mix(lambda name, array: kind)
