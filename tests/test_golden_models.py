"""The four tiny Hugging Face checkpoints against transformers' float32 outputs.

Each golden dir holds golden.npz: prompt_ids [T], logits [T, V], greedy_ids [8] (greedy
continuation) and greedy_logits [8, V] (the logits each greedy token was picked from).
"""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import GOLDEN, TINY_ARCHS, TINY_GEO

from motet.model import load_model
from motet.model.forward import prefill
from motet.model.generate import decode_step, generate, prefill_slot
from motet.model.kv import bucket, init_kv
from motet.model.moe import MOE_IMPLS

# Measured max |motet - transformers| over every logit: 1.4e-5 (llama), 2.1e-5
# (qwen3_moe), 1.7e-5 (olmoe), 1.9e-5 (mixtral), with logits up to ~33 in magnitude
# (std 3-8). 1e-4 leaves about 5x headroom and is still ~1e-5 of the logit scale.
ATOL = 1e-4
MOE_ARCHS = ("qwen3_moe", "olmoe", "mixtral")
# Each explicit MoE implementation ("auto" picks one of them and runs in the tests that
# pass no moe_impl), on every MoE arch; the dense arch through "auto" only.
EXPLICIT_IMPLS = tuple(impl for impl in MOE_IMPLS if impl != "auto")
ARCH_IMPLS = [("llama", "auto")] + [(a, impl) for a in MOE_ARCHS for impl in EXPLICIT_IMPLS]


def golden(arch: str) -> dict[str, np.ndarray]:
    return dict(np.load(GOLDEN / arch / "golden.npz"))


def hf_config(arch: str) -> dict:
    return json.loads((GOLDEN / arch / "config.json").read_text())


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_prompt_logits(tiny_model, arch):
    g = golden(arch)
    logits = tiny_model(arch).logits(g["prompt_ids"])
    assert logits.shape == g["logits"].shape
    np.testing.assert_allclose(logits, g["logits"], rtol=0, atol=ATOL)


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_greedy_generate(tiny_model, arch):
    model, g = tiny_model(arch), golden(arch)
    expected = []
    for token in g["greedy_ids"].tolist():
        if token in model.tokenizer.eos_ids:  # generate() stops there, without yielding it
            break
        expected.append(token)
    got = list(generate(model, g["prompt_ids"].tolist(), max_tokens=len(g["greedy_ids"])))
    assert got == expected


@pytest.mark.parametrize(("arch", "moe_impl"), ARCH_IMPLS)
def test_greedy_decode_steps(tiny_model, arch, moe_impl):
    """All 8 greedy steps through prefill_slot/decode_step (which never stop at EOS),
    in chunks of 16 so prefill also attends to cached history."""
    model, g = tiny_model(arch), golden(arch)
    prompt = g["prompt_ids"].tolist()
    geo = TINY_GEO
    kv = init_kv(model.config, geo)
    logits, kv = prefill_slot(model, kv, geo, 0, prompt, 0, moe_impl=moe_impl)
    step_logits = [np.asarray(logits)]
    tokens = [int(np.argmax(step_logits[-1]))]
    for i in range(len(g["greedy_ids"]) - 1):
        pos = len(prompt) + i
        logits, kv = decode_step(model, kv, geo, [tokens[-1]], [0], [pos], moe_impl=moe_impl)
        step_logits.append(np.asarray(logits[0]))
        tokens.append(int(np.argmax(step_logits[-1])))
    assert tokens == g["greedy_ids"].tolist()
    np.testing.assert_allclose(np.stack(step_logits), g["greedy_logits"], rtol=0, atol=ATOL)


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_greedy_step_logits_full_forward(tiny_model, arch):
    """A full forward over prompt + greedy: row T-1+i is the logits greedy token i came from."""
    g = golden(arch)
    prompt, greedy = g["prompt_ids"], g["greedy_ids"]
    logits = tiny_model(arch).logits(np.concatenate([prompt, greedy]))
    n = len(prompt)
    np.testing.assert_allclose(logits[n - 1 : n - 1 + len(greedy)], g["greedy_logits"], rtol=0, atol=ATOL)


@pytest.mark.parametrize("arch", MOE_ARCHS)
@pytest.mark.parametrize("moe_impl", EXPLICIT_IMPLS)
def test_moe_implementations_agree(tiny_model, arch, moe_impl):
    model, g = tiny_model(arch), golden(arch)
    ids = g["prompt_ids"]
    n = len(ids)
    padded = np.zeros(bucket(n), np.int32)
    padded[:n] = ids
    logits, _, _, _ = prefill(
        model.weights, [], [], jnp.asarray(padded), 0, 0, n,
        cfg=model.config, with_history=False, all_logits=True, moe_impl=moe_impl,
    )
    np.testing.assert_allclose(np.asarray(logits[:n]), g["logits"], rtol=0, atol=ATOL)


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_info_matches_config(tiny_model, arch):
    info, hf = tiny_model(arch).info(), hf_config(arch)
    n_experts = hf.get("num_experts") or hf.get("num_local_experts") or 0
    assert info["architecture"] == arch
    assert info["layers"] == hf["num_hidden_layers"]
    assert info["hidden_size"] == hf["hidden_size"]
    assert info["heads"] == hf["num_attention_heads"]
    assert info["kv_heads"] == hf["num_key_value_heads"]
    assert info["vocab_size"] == hf["vocab_size"]
    assert info["experts"] == n_experts
    assert info["experts_per_token"] == hf.get("num_experts_per_tok", 0)
    assert info["parameters"] > 0
    assert info["dtype"] == "float32"


def test_qwen3_moe_mlp_only_layers(tiny_model):
    cfg = tiny_model("qwen3_moe").config
    assert cfg.moe_layers == (True, False, True)  # mlp_only_layers: [1]
    assert tiny_model("qwen3_moe").info()["moe_layers"] == 2


@pytest.mark.parametrize("arch", ("olmoe", "mixtral"))
def test_all_layers_moe(tiny_model, arch):
    cfg = tiny_model(arch).config
    assert cfg.moe_layers == (True,) * cfg.n_layers


def test_llama_is_dense(tiny_model):
    cfg = tiny_model("llama").config
    assert not cfg.is_moe and cfg.n_experts == 0


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_bfloat16_weights_stay_close_to_the_goldens(arch):
    """bfloat16 weights (the GPU dtype) run the same code; logits keep ~3 significant digits."""
    model = load_model(GOLDEN / arch, dtype="bfloat16")
    golden = np.load(GOLDEN / arch / "golden.npz")
    logits = model.logits(golden["prompt_ids"])
    assert logits.dtype == np.float32
    scale = np.abs(golden["logits"]).max()
    error = np.abs(logits - golden["logits"]).max()
    assert error < 0.05 * scale
    # Wherever the golden top-1 leads by more than twice the error, bf16 must agree.
    top2 = np.sort(golden["logits"], axis=-1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 2 * error
    assert clear.sum() >= len(clear) // 2
    np.testing.assert_array_equal(logits.argmax(-1)[clear], golden["logits"].argmax(-1)[clear])
