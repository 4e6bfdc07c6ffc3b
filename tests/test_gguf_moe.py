"""GGUF files written as llama.cpp's converter writes them (tests/gguf_fixtures.py), from
the tiny golden checkpoints: motet reads the same model from them as from the Hugging
Face directories (weights, config, tokenizer) and gives the same transformers logits."""

from __future__ import annotations

import dataclasses
import json

import gguf
import jax
import numpy as np
import pytest
from conftest import GOLDEN
from gguf import GGMLQuantizationType as Q
from gguf_fixtures import mix, permute_rope_rows, simple, write_gguf

from motet.model import load_model
from motet.model.config import config_from_gguf, config_from_hf
from motet.model.gguf_file import gguf_metadata, open_gguf, unpermute_rope_rows
from motet.model.tokenizer import Tokenizer

# The Hugging Face directories meet 1e-4 (tests/test_golden_models.py); so must the files.
# Measured max |GGUF - transformers|: 2.6e-5 (qwen3_moe), 1.8e-5 (olmoe), 2.0e-5
# (mixtral), 1.5e-5 (llama).
ATOL = 1e-4
MOE_ARCHS = ("qwen3_moe", "olmoe", "mixtral")
ARCHS = (*MOE_ARCHS, "llama")  # llama: dense, with a tied head (no output.weight)
# transformers' routing: qwen3_moe's config sets norm_topk_prob, olmoe's clears it,
# Mixtral always renormalizes its top-k.
RENORMALIZED = {"qwen3_moe": True, "olmoe": False, "mixtral": True}

@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    """gguf_file(arch) -> the float32 GGUF of arch's golden checkpoint, written once."""
    made = {}

    def get(arch: str):
        if arch not in made:
            made[arch] = write_gguf(GOLDEN / arch, tmp_path_factory.mktemp(arch) / f"{arch}.gguf")
        return made[arch]

    return get


@pytest.fixture(scope="module")
def gguf_model(gguf_file):
    models = {}

    def get(arch: str):
        if arch not in models:
            models[arch] = load_model(gguf_file(arch), dtype="float32")
        return models[arch]

    return get


def read_config(path, with_names: bool = True):
    """config_from_gguf on a file's metadata, as the loader should call it."""
    reader = open_gguf(path)
    names = {t.name for t in reader.tensors}
    return config_from_gguf(gguf_metadata(reader), "output.weight" in names, names if with_names else None)


def hf_config(arch: str):
    return config_from_hf(json.loads((GOLDEN / arch / "config.json").read_text()))


def assert_same_config(got, want):
    """Field by field. GGUF stores rms_eps as float32 (1e-6 reads back 9.99999997e-7), so
    it is compared at float32, as the forward uses it. max_context (context_length) and
    tie_embeddings (no output.weight) agree with config.json for these checkpoints."""
    got, want = dataclasses.asdict(got), dataclasses.asdict(want)
    assert np.float32(got.pop("rms_eps")) == np.float32(want.pop("rms_eps"))
    assert got == want


@pytest.mark.parametrize("arch", ARCHS)
def test_prompt_logits_match_golden(gguf_model, arch):
    g = np.load(GOLDEN / arch / "golden.npz")
    logits = gguf_model(arch).logits(g["prompt_ids"])
    assert logits.shape == g["logits"].shape
    np.testing.assert_allclose(logits, g["logits"], rtol=0, atol=ATOL)


@pytest.mark.parametrize("arch", ARCHS)
def test_config_matches_hf_dir(gguf_model, arch):
    assert_same_config(gguf_model(arch).config, hf_config(arch))


@pytest.mark.parametrize("arch", ARCHS)
def test_config_reader_matches_hf_dir(gguf_file, arch):
    """config_from_gguf given the tensor names, as the loader should call it: qwen3_moe's
    dense layer included."""
    assert_same_config(read_config(gguf_file(arch)), hf_config(arch))


def test_without_tensor_names_every_layer_of_a_moe_file_is_moe(gguf_file):
    assert read_config(gguf_file("qwen3_moe"), with_names=False).moe_layers == (True,) * 3
    assert read_config(gguf_file("qwen3_moe")).moe_layers == (True, False, True)


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_routing_rule(gguf_file, arch):
    """The converter writes no expert_weights_norm for these architectures: the rule is
    llama.cpp's per architecture, which must be transformers' for these configs."""
    path = gguf_file(arch)
    meta = gguf_metadata(open_gguf(path))
    assert not any(k.endswith(".expert_weights_norm") for k in meta)
    cfg = read_config(path, with_names=False)
    assert cfg.norm_topk_prob is RENORMALIZED[arch] is hf_config(arch).norm_topk_prob


@pytest.mark.parametrize("arch", ARCHS)
def test_weights_equal_hf_dir(gguf_model, tiny_model, arch):
    """Every packed array bit for bit: names, orientation, expert stacking and (llama,
    mixtral) the Q/K rows the loader puts back in Hugging Face order."""
    got = jax.tree_util.tree_leaves_with_path(gguf_model(arch).weights)
    want = jax.tree_util.tree_leaves_with_path(tiny_model(arch).weights)
    assert [p for p, _ in got] == [p for p, _ in want]
    for (path, a), (_, b) in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("arch", ARCHS)
def test_tokenizer_matches_hf_dir(gguf_file, arch):
    got = Tokenizer.from_gguf(gguf_metadata(open_gguf(gguf_file(arch))))
    want = Tokenizer.from_hf_dir(GOLDEN / arch)
    for attr in ("vocab_size", "bos_id", "eos_ids", "special_ids", "add_bos", "chat_template"):
        assert getattr(got, attr) == getattr(want, attr), attr
    texts = ["Hello world", "  two  spaces\tand a tab\n", "digits 12345 and 3.14",
             "<|im_start|>user\nhi<|im_end|>", "naïve café ☕"]
    for text in texts:
        for add_special in (False, True):
            assert got.encode(text, add_special) == want.encode(text, add_special), text
    ids = np.load(GOLDEN / arch / "golden.npz")["prompt_ids"].tolist()
    assert got.decode(ids) == want.decode(ids)


@pytest.mark.parametrize(("rows", "heads"), [(64, 4), (32, 2), (48, 1)])
def test_loader_undoes_the_rope_permutation(rows, heads):
    w = np.arange(rows * 3, dtype=np.float32).reshape(rows, 3)
    permuted = permute_rope_rows(w, heads)
    assert not np.array_equal(permuted, w)
    np.testing.assert_array_equal(unpermute_rope_rows(permuted, heads), w)


@pytest.mark.parametrize("kind", [Q.Q8_0, Q.Q4_0, Q.Q4_1])
def test_simple_policy(gguf_file, tmp_path, kind):
    """Every matrix and expert stack in `kind`, norms and routers in F32, values within the
    type's rounding of the float file's."""
    floats = {t.name: np.asarray(t.data) for t in open_gguf(gguf_file("olmoe")).tensors}
    path = write_gguf(GOLDEN / "olmoe", tmp_path / "q.gguf", quantize=simple(kind))
    for t in open_gguf(path).tensors:
        w = floats[t.name]
        if w.ndim == 1 or ".ffn_gate_inp." in t.name:
            assert t.tensor_type == Q.F32, t.name
            continue
        assert t.tensor_type == kind, t.name
        got = gguf.quants.dequantize(np.asarray(t.data), kind).reshape(w.shape)
        step = np.abs(w).max() / (127 if kind == Q.Q8_0 else 7)
        assert np.abs(got - w).max() <= step, t.name


def test_a_policy_keeps_rows_that_do_not_fill_a_block_in_float(gguf_file, tmp_path):
    """K-quant blocks hold 256 values, more than these models' 64- and 32-wide rows."""
    path = write_gguf(GOLDEN / "olmoe", tmp_path / "k.gguf", quantize=mix(lambda name, array: Q.Q4_K))
    assert {t.tensor_type for t in open_gguf(path).tensors} == {Q.F32}
