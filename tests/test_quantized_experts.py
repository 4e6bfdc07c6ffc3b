"""Quantized weights of MoE models: experts stay quantized resident, in the device pool,
in host RAM and when read from the file, and compute what float32 computes on the same
values. The checkpoints are the golden Hugging Face ones, quantized at load (--quantize)
or written as quantized GGUF files (gguf_fixtures.py)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import replace
from functools import partial

import jax
import numpy as np
import pytest
from conftest import GOLDEN
from gguf import GGMLQuantizationType as Q
from gguf_fixtures import add_tokenizer, mix, simple, write_gguf, write_tensors
from kquants import quantize_k
from test_expert_tiers import MOE_ARCHS, long_prompt, make_pool, resident_run, tiered_run

from motet.model import UnsupportedModelError, load_model, native
from motet.model.forward import prefill
from motet.model.moe import MOE_IMPLS, pick_impl
from motet.model.quant import QTensor, dequantize, quantize
from motet.model.tiered_model import TieredModel

RTOL = 1e-3  # weight-only paths against float32 on the same values (the bound)


def dequantized(model):
    """The model with every QTensor replaced by the float32 matrix it stands for, in the
    float layout (x @ W; the embedding's rows stay rows)."""
    def leaf(name: str, w):
        if not isinstance(w, QTensor):
            return w
        f = np.asarray(dequantize(w))
        return f if name == "embed" else np.swapaxes(f, -1, -2)

    weights = {k: leaf(k, v) for k, v in model.weights.items() if k != "layers"}
    weights["layers"] = [{k: leaf(k, v) for k, v in layer.items()} for layer in model.weights["layers"]]
    return replace(model, weights=jax.device_put(weights))


def relative_error(got, want) -> float:
    return float(np.abs(np.asarray(got) - np.asarray(want)).max() / np.abs(np.asarray(want)).max())


def test_quantize_keeps_each_value_within_half_a_step():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((6, 96)).astype(np.float32)
    w[1] = 0  # an all-zero row, and a constant one
    w[2] = 0.75
    for layout, steps in (("q8", 254), ("q4", 15)):
        q = quantize(w, layout, "test")
        back = np.asarray(dequantize(q))
        groups = w.reshape(6, -1, 32)
        step = np.repeat((groups.max(-1) - groups.min(-1)) / steps, 32, axis=-1).reshape(w.shape)
        if layout == "q8":  # symmetric: absmax / 127
            step = np.repeat(np.abs(groups).max(-1) / 127, 32, axis=-1).reshape(w.shape)
        assert np.all(np.abs(back - w) <= step / 2 + 1e-6), layout
        np.testing.assert_array_equal(back[1], 0)
        np.testing.assert_allclose(back[2], 0.75, rtol=1e-6)


@pytest.mark.parametrize("kind", ("int8", "int4"))
@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_quantized_experts_compute_what_float32_computes_on_the_same_values(arch, kind):
    model = load_model(GOLDEN / arch, dtype=kind)
    layer = next(x for x in model.weights["layers"] if "experts_gate_up" in x)
    cfg = model.config
    assert isinstance(layer["experts_gate_up"], QTensor) and isinstance(layer["experts_down"], QTensor)
    assert layer["experts_gate_up"].shape == (cfg.n_experts, 2 * cfg.moe_intermediate_size, cfg.hidden_size)
    assert model.weights["lm_head"].source == "int8"  # the head keeps 8 bits even at int4
    ids = np.load(GOLDEN / arch / "golden.npz")["prompt_ids"]
    assert relative_error(model.logits(ids), dequantized(model).logits(ids)) < RTOL


@pytest.mark.parametrize("impl", [impl for impl in MOE_IMPLS if impl != "auto"])
def test_every_moe_implementation_reads_quantized_experts(impl):
    """The GPU's expert paths (ragged, gather) dequantize inside the step, the CPU's
    loop reads the blocks in place: each gives float32's logits on the same values."""
    model = load_model(GOLDEN / "qwen3_moe", dtype="int4")
    ids = np.load(GOLDEN / "qwen3_moe" / "golden.npz")["prompt_ids"]
    run = partial(prefill, k_cache=[], v_cache=[], tokens=jax.numpy.asarray(ids), slot=0, offset=0,
                  n_valid=len(ids), cfg=model.config, with_history=False, all_logits=True)
    got = run(model.weights, moe_impl=impl)[0]
    want = run(dequantized(model).weights, moe_impl="grouped")[0]
    assert relative_error(got, want) < RTOL


def test_auto_picks_the_expert_path_measured_fastest_for_the_batch():
    """docs/performance.md's H200 table: gather for decode batches (float experts at one
    row only), ragged_dot for float experts at 16 rows, the grouped loop for prefills."""
    gpu = {(pairs, quantized): pick_impl("auto", pairs, quantized, "gpu")
           for pairs in (8, 128, 4096) for quantized in (False, True)}
    assert gpu == {(8, False): "gather", (128, False): "ragged", (4096, False): "grouped",
                   (8, True): "gather", (128, True): "gather", (4096, True): "grouped"}
    assert {pick_impl("auto", pairs, True, "cpu") for pairs in (8, 4096)} == {"grouped"}
    assert pick_impl("ragged", 8, True, "gpu") == "ragged"


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_quantized_tiered_experts_give_the_resident_greedy_tokens(arch):
    """A pool of top-k slots and a RAM tier of a few experts, every one quantized: the
    same tokens as the resident quantized model, the pool and RAM holding the bytes of
    quantized experts."""
    resident = load_model(GOLDEN / arch, dtype="int4")
    lazy = load_model(GOLDEN / arch, dtype="int4", lazy_experts=True)
    cfg = resident.config
    prompt = long_prompt(arch, cfg.vocab_size)
    want_tokens, want_logits, want_routing = resident_run(resident, prompt)
    pool = make_pool(lazy, cfg.n_experts_per_tok, ram=3)
    tokens, logits, routing = tiered_run(TieredModel(lazy, pool), prompt)
    assert tokens == want_tokens
    np.testing.assert_array_equal(routing, want_routing)
    assert relative_error(logits, want_logits) < RTOL
    assert pool.quantized and isinstance(pool.pools[0][0], QTensor)
    assert pool.device_bytes() == sum(leaf.nbytes for leaf in jax.tree.leaves(pool.pools))
    assert pool.stats.moves and len(pool.ram) == 3
    assert all(isinstance(gu, QTensor) for gu, _ in pool.ram.values())
    assert pool.ram_bytes() == 3 * pool.expert_bytes[0]
    float_expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size * 4
    assert pool.expert_bytes.max() * 5 < float_expert  # 4 bits and a scale and min per 32


def test_quantize_refuses_what_it_cannot_do_with_a_clear_error():
    with pytest.raises(UnsupportedModelError, match="does not run on a mesh yet"):
        load_model(GOLDEN / "qwen3_moe", dtype="int4", mesh="ep=1")
    with pytest.raises(UnsupportedModelError, match="unsupported dtype 'int3'"):
        load_model(GOLDEN / "qwen3_moe", dtype="int3")


def test_motet_info_quantizes_a_float_checkpoint_on_request():
    cmd = [sys.executable, "-m", "motet", "info", "--model", str(GOLDEN / "qwen3_moe")]
    out = subprocess.run([*cmd, "--quantize", "int4"], capture_output=True, text=True, timeout=120,
                         check=True).stdout
    assert re.search(r"experts_gate_up\s+int4", out) and re.search(r"lm_head\s+int8", out)
    plain = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True).stdout
    assert re.search(r"experts_gate_up\s+float32", plain)
    wrong = subprocess.run([*cmd, "--quantize", "int4", "--dtype", "bfloat16"], capture_output=True,
                           text=True, timeout=120)
    assert wrong.returncode == 2 and "cannot go with --dtype bfloat16" in wrong.stderr


# A Q4_K_M-like mix where these tiny checkpoints allow it (rows of 32 or 64 values fit
# the legacy types only): attention in Q4_0, gate and up in Q4_1, down and the head in Q8_0.
def _mixed(name: str, array) -> Q:
    if "attn_" in name:
        return Q.Q4_0
    if "down" in name or name == "output.weight" or name == "token_embd.weight":
        return Q.Q8_0
    return Q.Q4_1


@pytest.mark.parametrize("policy", ("Q8_0", "mixed"))
@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_a_quantized_moe_gguf_computes_what_float32_computes_on_its_values(tmp_path, arch, policy):
    """The file's own values, kept quantized (the default) against dequantized to float32
    (--dtype float32), on the same file: experts included, and every tier."""
    path = write_gguf(GOLDEN / arch, tmp_path / f"{arch}.gguf", mix(_mixed) if policy == "mixed" else simple(policy))
    quantized, float32 = load_model(path), load_model(path, dtype="float32")
    layer = next(x for x in quantized.weights["layers"] if "experts_gate_up" in x)
    want_source = {"Q8_0": "Q8_0", "mixed": "Q4_1"}[policy]
    assert isinstance(layer["experts_gate_up"], QTensor) and layer["experts_gate_up"].source == want_source
    assert not isinstance(float32.weights["layers"][0]["wqkv"], QTensor)
    prompt = long_prompt(arch, quantized.config.vocab_size)
    assert relative_error(quantized.logits(prompt), float32.logits(prompt)) < RTOL
    # tiered, every expert read from the file as a raw slice
    lazy = load_model(path, lazy_experts=True)
    want_tokens, want_logits, _ = resident_run(quantized, prompt)
    pool = make_pool(lazy, quantized.config.n_experts_per_tok, ram=2)
    tokens, logits, _ = tiered_run(TieredModel(lazy, pool), prompt)
    assert tokens == want_tokens and pool.quantized
    assert relative_error(logits, want_logits) < RTOL


def random_qwen3_moe(d: int = 256, f: int = 256, layers: int = 2, experts: int = 4, seed: int = 0):
    """A config.json dict and random weights (Hugging Face names) of a Qwen3-MoE whose
    rows fill the K types' 256-value super-blocks; the golden tokenizer's 512 tokens."""
    hf = json.loads((GOLDEN / "qwen3_moe" / "config.json").read_text()) | {
        "hidden_size": d, "moe_intermediate_size": f, "intermediate_size": f, "num_hidden_layers": layers,
        "num_experts": experts, "num_experts_per_tok": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 64, "mlp_only_layers": []}
    rng = np.random.default_rng(seed)

    def w(*shape):
        return (rng.standard_normal(shape) * 0.05).astype(np.float32)

    v, q, kv = hf["vocab_size"], 4 * 64, 2 * 64
    raw = {"model.embed_tokens.weight": w(v, d), "lm_head.weight": w(v, d), "model.norm.weight": np.ones(d, np.float32)}
    for i in range(layers):
        p = f"model.layers.{i}."
        raw |= {p + "input_layernorm.weight": np.ones(d, np.float32),
                p + "post_attention_layernorm.weight": np.ones(d, np.float32),
                p + "self_attn.q_proj.weight": w(q, d), p + "self_attn.k_proj.weight": w(kv, d),
                p + "self_attn.v_proj.weight": w(kv, d), p + "self_attn.o_proj.weight": w(d, q),
                p + "self_attn.q_norm.weight": np.ones(64, np.float32),
                p + "self_attn.k_norm.weight": np.ones(64, np.float32), p + "mlp.gate.weight": w(experts, d)}
        for e in range(experts):
            raw |= {f"{p}mlp.experts.{e}.gate_proj.weight": w(f, d), f"{p}mlp.experts.{e}.up_proj.weight": w(f, d),
                    f"{p}mlp.experts.{e}.down_proj.weight": w(d, f)}
    return hf, raw


def _k_mix(name: str, array) -> Q:
    """As llama.cpp's Q4_K_M mixes them: Q4_K mostly, Q6_K for V, the head and half the
    layers' down projections (Q5_K for the others here, so two layers' experts differ)."""
    if "attn_v" in name or name == "output.weight" or name == "blk.0.ffn_down_exps.weight":
        return Q.Q6_K
    if "ffn_down" in name:
        return Q.Q5_K
    return Q.Q4_K


def test_a_k_quant_moe_gguf_runs_quantized_in_every_tier(tmp_path):
    """Q4_K, Q5_K and Q6_K experts (a Q4_K_M-like mix, two layers' down projections in
    different types): the same logits as the file dequantized to float32, and tiered the
    resident greedy tokens, each layer's pool in its own layer's format."""
    hf, raw = random_qwen3_moe()
    path = write_tensors(tmp_path / "k.gguf", hf, raw, partial(add_tokenizer, hf_dir=GOLDEN / "qwen3_moe",
                                                               vocab_size=hf["vocab_size"]),
                         mix(_k_mix, lambda array, kind: quantize_k(array, kind.name)))
    quantized, float32 = load_model(path), load_model(path, dtype="float32")
    downs = [layer["experts_down"].source for layer in quantized.weights["layers"]]
    assert downs == ["Q6_K", "Q5_K"] and quantized.weights["layers"][0]["experts_gate_up"].source == "Q4_K"
    # Q and K (Q4_K) and V (Q6_K) as two pieces, each in its own format
    assert quantized.weights["layers"][0]["wqkv"].source == "Q4_K | Q6_K"
    prompt = long_prompt("qwen3_moe", hf["vocab_size"])
    assert relative_error(quantized.logits(prompt), float32.logits(prompt)) < RTOL
    want_tokens, want_logits, _ = resident_run(quantized, prompt)
    lazy = load_model(path, lazy_experts=True)
    pool = make_pool(lazy, 2, ram=2)
    tokens, logits, _ = tiered_run(TieredModel(lazy, pool), prompt)
    assert tokens == want_tokens and relative_error(logits, want_logits) < RTOL
    assert [p[1].source for p in pool.pools] == ["Q6_K", "Q5_K"]
    assert (pool.pools[0][1].block, pool.pools[1][1].block) == (16, 32)  # Q6_K's scales per 16


@pytest.mark.skipif(not native.available(), reason="the native kernels were not built")
def test_k_scales_stay_packed_where_the_dots_read_them_in_place(tmp_path):
    """With AVX-512 and AVX2 a K type keeps the file's scales (an integer per block, a
    float per 256 values: Q4_K in 4.75 bits a value, not 6); the baseline dots widen them
    to float32 at load. All compute the same logits."""
    hf, raw = random_qwen3_moe(layers=1)
    path = write_tensors(tmp_path / "k.gguf", hf, raw, partial(add_tokenizer, hf_dir=GOLDEN / "qwen3_moe",
                                                               vocab_size=hf["vocab_size"]),
                         mix(_k_mix, lambda array, kind: quantize_k(array, kind.name)))
    prompt = long_prompt("qwen3_moe", hf["vocab_size"])
    best, logits = native.instruction_set(), {}
    try:
        for isa in ("avx512", "avx2", "base"):
            if not native.select_instruction_set(isa):
                continue
            model = load_model(path)
            gate_up = model.weights["layers"][0]["experts_gate_up"]
            packed = isa != "base"
            assert (gate_up.super_scale is not None) == packed == native.k_scales_packed()
            bits = 8 * gate_up.nbytes / np.prod(gate_up.shape)
            assert bits == (4.75 if packed else 6.0)
            logits[isa] = model.logits(prompt)
    finally:
        native.select_instruction_set(best)
    packed_ones = logits.keys() - {"base"}
    assert "base" in logits and packed_ones, logits.keys()
    for isa in packed_ones:
        tolerance = 1e-3 if isa in native.FLOAT_ROWS_INSTEAD else 1e-5
        assert relative_error(logits[isa], logits["base"]) < tolerance, isa
