"""Bad model files and oversized prompts each give one clear error that names the file,
tensor or architecture; the CLI turns them into one `motet: error:` line and exit 2."""

from __future__ import annotations

import json
import os
import shutil
import string
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from conftest import COMPILE_CACHE, GOLDEN, REPO
from gguf import GGMLQuantizationType as Q

from motet.model import (
    SUPPORTED_ARCHITECTURES,
    ContextLengthError,
    ModelError,
    ModelFileError,
    UnsupportedModelError,
    load_model,
)
from motet.model.generate import generate

# gguf.quants.dequantize raises NotImplementedError for Q8_1 (also Q8_K, Q1_0 and the
# integer/F64 types, which motet converts itself): checked against gguf 0.19.
UNSUPPORTED_QUANT = Q.Q8_1


def write_gguf(path: Path, arch: str, embed_type: Q = Q.F32, hidden: int = 32) -> Path:
    """A minimal GGUF: one-layer llama-style metadata, a 63-token byte-level BPE
    vocabulary, and only the embedding and final norm tensors."""
    tokens = list(string.ascii_letters + string.digits) + ["ab"]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_embedding_length(hidden)
    w.add_head_count(2)
    w.add_head_count_kv(2)
    w.add_context_length(64)
    w.add_feed_forward_length(64)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_merges(["a b"])
    w.add_eos_token_id(0)
    if embed_type == Q.F32:
        w.add_tensor("token_embd.weight", np.zeros((len(tokens), hidden), np.float32))
    else:  # raw quantized blocks: [rows, bytes per row]
        block, size = gguf.GGML_QUANT_SIZES[embed_type]
        raw = np.zeros((len(tokens), hidden // block * size), np.uint8)
        w.add_tensor("token_embd.weight", raw, raw_dtype=embed_type)
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def copy_golden(tmp_path: Path, arch: str = "llama") -> Path:
    return Path(shutil.copytree(GOLDEN / arch, tmp_path / arch))


def edit_config(model_dir: Path, **changes) -> None:
    path = model_dir / "config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | changes))


# -- load_model -----------------------------------------------------------------------


def test_missing_path(tmp_path):
    missing = tmp_path / "nope" / "model.gguf"
    with pytest.raises(ModelFileError, match="no such file") as exc:
        load_model(missing)
    assert str(missing) in str(exc.value)


def test_neither_gguf_nor_safetensors(tmp_path):
    path = tmp_path / "x.bin"
    path.write_bytes(b"\x00\x01not a model at all" * 10)
    with pytest.raises(ModelFileError, match="not a GGUF file") as exc:
        load_model(path)
    assert str(path) in str(exc.value)


def test_safetensors_file_instead_of_its_directory(tmp_path):
    path = copy_golden(tmp_path) / "model.safetensors"
    with pytest.raises(ModelFileError, match="pass the directory") as exc:
        load_model(path)
    assert str(path) in str(exc.value)


def test_directory_without_config(tmp_path):
    with pytest.raises(ModelFileError, match="no config.json") as exc:
        load_model(tmp_path)
    assert str(tmp_path) in str(exc.value)


def test_config_not_json(tmp_path):
    model_dir = copy_golden(tmp_path)
    (model_dir / "config.json").write_text("{not json")
    with pytest.raises(ModelFileError, match="not valid JSON") as exc:
        load_model(model_dir)
    assert str(model_dir / "config.json") in str(exc.value)


def test_hf_unsupported_architecture(tmp_path):
    model_dir = copy_golden(tmp_path)
    edit_config(model_dir, model_type="gpt2", architectures=["GPT2LMHeadModel"])
    with pytest.raises(UnsupportedModelError) as exc:
        load_model(model_dir)
    message = str(exc.value)
    assert "'gpt2'" in message
    assert all(arch in message for arch in SUPPORTED_ARCHITECTURES)


def test_gguf_unsupported_architecture(tmp_path):
    path = write_gguf(tmp_path / "gpt2.gguf", "gpt2")
    with pytest.raises(UnsupportedModelError) as exc:
        load_model(path)
    message = str(exc.value)
    assert "'gpt2'" in message
    assert all(arch in message for arch in SUPPORTED_ARCHITECTURES)


def test_gguf_unsupported_quantization(tmp_path):
    _, size = gguf.GGML_QUANT_SIZES[UNSUPPORTED_QUANT]
    with pytest.raises(NotImplementedError):  # the premise: gguf cannot dequantize it
        gguf.quants.dequantize(np.zeros((1, size), np.uint8), UNSUPPORTED_QUANT)
    path = write_gguf(tmp_path / "q81.gguf", "llama", embed_type=UNSUPPORTED_QUANT)
    with pytest.raises(UnsupportedModelError) as exc:
        load_model(path)
    message = str(exc.value)
    assert str(path) in message
    assert "token_embd.weight" in message
    assert UNSUPPORTED_QUANT.name in message


def test_gguf_missing_tensor(tmp_path):
    path = write_gguf(tmp_path / "partial.gguf", "llama")  # no attention or FFN tensors
    with pytest.raises(ModelFileError, match="not found") as exc:
        load_model(path)
    assert str(path) in str(exc.value)


def test_truncated_gguf(tmp_path):
    whole = write_gguf(tmp_path / "whole.gguf", "llama").read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(ModelFileError, match="truncated") as exc:
        load_model(path)
    assert str(path) in str(exc.value)


def test_truncated_safetensors(tmp_path):
    model_dir = copy_golden(tmp_path)
    path = model_dir / "model.safetensors"
    os.truncate(path, path.stat().st_size // 2)
    with pytest.raises(ModelFileError, match="truncated") as exc:
        load_model(model_dir)
    message = str(exc.value)
    assert str(path) in message
    assert "tensor 'model." in message  # the first tensor past the end, by its file name


def test_safetensors_shape_mismatch_names_the_tensor(tmp_path):
    model_dir = copy_golden(tmp_path)
    edit_config(model_dir, hidden_size=32)
    with pytest.raises(ModelFileError) as exc:
        load_model(model_dir)
    message = str(exc.value)
    assert "'model.embed_tokens.weight'" in message
    assert "(512, 64)" in message and "(512, 32)" in message


def test_safetensors_shape_mismatch_names_the_file(tmp_path):
    model_dir = copy_golden(tmp_path)
    edit_config(model_dir, hidden_size=32)
    with pytest.raises(ModelFileError) as exc:
        load_model(model_dir)
    assert str(model_dir) in str(exc.value)


def test_errors_share_a_base_class():
    assert issubclass(ModelFileError, ModelError)
    assert issubclass(UnsupportedModelError, ModelError)
    assert issubclass(ContextLengthError, ModelError)


def test_an_unknown_kv_dtype_is_refused_with_the_choices():
    from motet.engines.engine import Engine
    from motet.runtime.config import ModelSettings

    with pytest.raises(UnsupportedModelError, match="unsupported KV dtype 'int3'; choose one of auto, float32"):
        load_model(GOLDEN / "llama", kv_dtype="int3")
    with pytest.raises(ValueError, match="kv_dtype must be one of auto, float32, float16, bfloat16, int8, fp8, got 'fp4'"):
        Engine(kv_dtype="fp4")
    with pytest.raises(ValueError, match="kv_dtype must be auto, float32, float16, bfloat16, int8 or fp8"):
        ModelSettings(kv_dtype="float64")


def test_prompt_longer_than_the_context(tiny_model):
    model = tiny_model("llama")
    prompt = list(range(3, 40))
    with pytest.raises(ContextLengthError) as exc:
        list(generate(model, prompt, max_tokens=4, max_context=16))
    assert (exc.value.used, exc.value.limit) == (37, 16)
    assert "37" in str(exc.value) and "16" in str(exc.value)


def test_prompt_and_answer_fill_at_most_the_context(tiny_model):
    model = tiny_model("llama")
    prompt = list(range(3, 13))
    answer = list(generate(model, prompt, max_tokens=100, max_context=20))
    assert len(prompt) + len(answer) == 20


def test_prefill_past_the_cache_is_refused(tiny_model):
    from motet.model.generate import prefill_slot
    from motet.model.kv import KVGeometry, init_kv

    model = tiny_model("llama")
    geo = KVGeometry(n_slots=1, max_context=32, chunk=16)
    kv = init_kv(model.config, geo)
    with pytest.raises(ContextLengthError) as exc:
        prefill_slot(model, kv, geo, 0, list(range(3, 23)), offset=20)
    assert (exc.value.used, exc.value.limit) == (40, 32)


def test_logits_longer_than_the_context(tiny_model):
    model = tiny_model("llama")
    with pytest.raises(ContextLengthError):
        model.logits(np.zeros(model.config.max_context + 1, np.int32))


# -- the CLI --------------------------------------------------------------------------


def motet(*args: str, stdin: str = "") -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "motet", *args, "--compile-cache", str(COMPILE_CACHE)],
        input=stdin, capture_output=True, text=True, cwd=REPO, timeout=120,
    )


def assert_one_error(result: subprocess.CompletedProcess, *needles: str) -> str:
    """Exit 2, nothing on stdout, no traceback, exactly one `motet: error:` line (the
    last on stderr; an INFO 'loading' log line may precede it)."""
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    errors = [line for line in lines if line.startswith("motet: error:")]
    assert len(errors) == 1 and lines[-1] == errors[0], result.stderr
    for needle in needles:
        assert needle in errors[0]
    return errors[0]


def test_cli_missing_model(tmp_path):
    missing = tmp_path / "missing.gguf"
    assert_one_error(motet("chat", "hi", "--model", str(missing)), str(missing))


def test_cli_not_a_model(tmp_path):
    path = tmp_path / "x.bin"
    path.write_bytes(b"garbage" * 20)
    assert_one_error(motet("chat", "hi", "--model", str(path)), str(path), "not a GGUF file")


def test_cli_unsupported_architecture(tmp_path):
    model_dir = copy_golden(tmp_path)
    edit_config(model_dir, model_type="gpt2")
    assert_one_error(motet("chat", "hi", "--model", str(model_dir)), "'gpt2'", "llama")


def test_cli_prompt_longer_than_the_context():
    long_prompt = "tell me about the sea and the ships " * 10
    result = motet("chat", long_prompt, "--model", str(GOLDEN / "llama"), "--max-context", "16")
    assert_one_error(result, "exceeds the context of 16 tokens")
