"""The default model (SmolLM2-135M-Instruct, Q4_1 GGUF) against transformers' float32
forward of the same GGUF (tests/golden/smollm2/logits.npz, golden.json).

logits.npz, for prompt i in 0, 1, 2: ids_i [T], last_i [V] (logits after the last
token), argmax_i [T] (argmax at every position), head_i [T, 512] (the first 512 vocab
columns at every position); greedy_ids_0 (the greedy answer to prompt 0, with EOS).
"""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
from conftest import GOLDEN

from motet.model import default_model_path, native
from motet.model.generate import generate
from motet.model.panels import in_rows

# Measured max |motet - transformers|: last-position logits 6.5e-5 / 4.2e-5 / 5.9e-5,
# head columns 9.4e-5 / 6.0e-5 / 7.1e-5 for prompts 0/1/2; the logits' std is ~3.1-3.4.
# 3e-4 leaves 3-5x headroom.
ATOL = 3e-4
# With x as int16 per 32 values in every product (AVX-512 VNNI's integer pairs): last
# logits 9.5e-3 / 4.7e-3 / 6.1e-3, head columns 2.0e-2 / 1.5e-2 / 1.4e-2 (the largest
# |logit| 21-35); AVX2's pairs (Zen 2): last 6.3e-3 / 4.7e-3 / 6.1e-3, head columns
# 2.3e-2 / 1.5e-2.
PAIRS_ATOL = 5e-2
PROMPTS = (0, 1, 2)


@pytest.fixture(scope="module")
def smollm2():
    return dict(np.load(GOLDEN / "smollm2" / "logits.npz")), json.loads(
        (GOLDEN / "smollm2" / "golden.json").read_text()
    )


@pytest.fixture(scope="module")
def forwards(default_model, smollm2):
    """model.logits for each golden prompt, computed once, with x in float32 in the
    prompt's products: where the CPU's kernels would take them as int16 pairs (AVX-512
    VNNI, AVX2), these run on the instruction set that keeps x in float32 (plain AVX-512,
    the baseline; AVX2's panels back in rows, as those read them), and
    test_int16_pairs_stay_close checks the pairs."""
    npz, _ = smollm2
    best = native.instruction_set()
    model = replace(default_model, weights=in_rows(default_model.weights))
    if best in native.FLOAT_ROWS_INSTEAD:
        native.select_instruction_set(native.FLOAT_ROWS_INSTEAD[best])
    try:
        return {i: model.logits(npz[f"ids_{i}"]) for i in PROMPTS}
    finally:
        if best in native.FLOAT_ROWS_INSTEAD:
            native.select_instruction_set(best)


def test_int16_pairs_stay_close(default_model, smollm2):
    """The prompt's products as integer pairs (x as int16 per 32 values, as the one-row
    dots take it): within PAIRS_ATOL, and the same argmax everywhere."""
    if native.instruction_set() not in native.FLOAT_ROWS_INSTEAD:
        pytest.skip("this CPU's kernels take no integer pairs, or were not built")
    npz, _ = smollm2
    for i in PROMPTS:
        logits = default_model.logits(npz[f"ids_{i}"])
        head = npz[f"head_{i}"]
        np.testing.assert_allclose(logits[-1], npz[f"last_{i}"], rtol=0, atol=PAIRS_ATOL)
        np.testing.assert_allclose(logits[:, : head.shape[1]], head, rtol=0, atol=PAIRS_ATOL)
        np.testing.assert_array_equal(logits.argmax(-1), npz[f"argmax_{i}"])


def test_default_model_path_exists():
    path = default_model_path()
    assert path.is_file() and path.suffix == ".gguf"


@pytest.mark.parametrize("i", PROMPTS)
def test_tokenizer_matches_golden_ids(default_model, smollm2, i):
    npz, meta = smollm2
    assert default_model.tokenizer.encode(meta["prompts"][i]) == npz[f"ids_{i}"].tolist()


@pytest.mark.parametrize("i", PROMPTS)
def test_last_position_logits(forwards, smollm2, i):
    npz, _ = smollm2
    np.testing.assert_allclose(forwards[i][-1], npz[f"last_{i}"], rtol=0, atol=ATOL)


@pytest.mark.parametrize("i", PROMPTS)
def test_argmax_at_every_position(forwards, smollm2, i):
    npz, _ = smollm2
    np.testing.assert_array_equal(forwards[i].argmax(-1), npz[f"argmax_{i}"])


@pytest.mark.parametrize("i", PROMPTS)
def test_head_columns(forwards, smollm2, i):
    npz, _ = smollm2
    head = npz[f"head_{i}"]
    np.testing.assert_allclose(forwards[i][:, : head.shape[1]], head, rtol=0, atol=ATOL)


def test_greedy_answer(default_model, smollm2):
    npz, meta = smollm2
    prompt = default_model.render_chat([{"role": "user", "content": "What is the capital of France?"}])
    assert prompt == meta["prompts"][0]
    ids = default_model.tokenizer.encode(prompt)
    answer = list(generate(default_model, ids, max_tokens=20))
    # The golden greedy ids end with <|im_end|>, which generate() stops at and does not yield.
    golden_ids = npz["greedy_ids_0"].tolist()
    assert golden_ids[-1] in default_model.tokenizer.eos_ids
    assert answer == golden_ids[:-1]
    assert default_model.tokenizer.decode(answer) == meta["greedy_text_0"] == "The capital of France is Paris."


def test_info(default_model):
    info = default_model.info()
    assert info["architecture"] == "llama"
    assert info["layers"] == 30
    assert info["experts"] == 0
    assert info["vocab_size"] == 49152
    assert 130_000_000 < info["parameters"] < 140_000_000
