"""model/file_rows.py: a GGUF file's quantized embedding stays the file's own blocks,
read in place, and a lookup unpacks its rows to the floats the repacked form gives, bit
for bit, in every type the loader takes."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import GOLDEN
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf_fixtures import add_tokenizer, mix, read_hf, simple, write_gguf, write_tensors
from kquants import quantize_k

from motet.model import ModelFileError, load_model
from motet.model.file_rows import UNPACK, FileRows, over
from motet.model.gguf_file import GGUFSource, open_gguf
from motet.model.gguf_quants import REPACK
from motet.model.quant import QTensor, take_rows

KINDS = tuple(UNPACK)
COLUMNS = 512
# Where each type's blocks hold f16 scales (byte offsets in a block).
HALVES = {"Q4_0": (0,), "Q4_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def uneven(rows: int, seed: int = 0) -> np.ndarray:
    """Rows whose 32-value runs differ in scale by up to e^6."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, COLUMNS // 32, 32)) * np.exp(rng.uniform(-3, 3, (rows, COLUMNS // 32, 1)))
    return x.astype(np.float32).reshape(rows, COLUMNS)


def quantized_rows(kind: str, x: np.ndarray) -> np.ndarray:
    if kind in ("Q4_K", "Q5_K", "Q6_K"):
        return quantize_k(x, kind)
    return gguf.quants.quantize(x, Q[kind])


def any_bytes(kind: str, rows: int, seed: int = 1) -> np.ndarray:
    """Random blocks of `kind` with random finite f16 scales: every bit pattern of the
    values and packed sub-scales, not just those a quantizer writes."""
    block, size = GGML_QUANT_SIZES[Q[kind]]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, COLUMNS // block, size), dtype=np.uint8)
    for at in HALVES[kind]:
        halves = rng.uniform(-4, 4, (rows, COLUMNS // block)).astype(np.float16)
        raw[..., at:at + 2] = halves[..., None].view(np.uint8).reshape(rows, -1, 2)
    return raw.reshape(rows, -1)


def lookups(raw: np.ndarray, kind: str, ids) -> tuple[np.ndarray, np.ndarray]:
    """The rows `ids` through FileRows and through the repacked QTensor."""
    ids = jnp.asarray(ids, jnp.int32)
    in_place = jax.jit(take_rows)(FileRows(jnp.asarray(raw.reshape(-1)), kind, len(raw), COLUMNS), ids)
    repacked = jax.jit(take_rows)(jax.device_put(REPACK[kind](raw)), ids)
    return np.asarray(in_place), np.asarray(repacked)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("source", ["quantized", "any bytes"])
def test_a_lookup_gives_the_repacked_floats_bit_for_bit(kind, source):
    raw = quantized_rows(kind, uneven(40)) if source == "quantized" else any_bytes(kind, 40)
    got, want = lookups(raw, kind, [3, 0, 39, 3, 17])
    assert got.shape == (5, COLUMNS)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    # and they are the type's values, as gguf-py reads them
    floats = gguf.quants.dequantize(raw, Q[kind]).reshape(40, COLUMNS)[[3, 0, 39, 3, 17]]
    np.testing.assert_allclose(got, floats, rtol=1e-6, atol=1e-6 * np.abs(floats).max())


def test_every_type_the_loader_repacks_is_unpacked_in_place():
    assert set(UNPACK) == set(REPACK)


@pytest.fixture(scope="module")
def q8_moe(tmp_path_factory) -> Path:
    """A quantized OLMoE file whose embedding is Q8_0 (not tied to its head)."""
    return write_gguf(GOLDEN / "olmoe", tmp_path_factory.mktemp("rows") / "olmoe.gguf", simple(Q.Q8_0))


def test_a_quantized_embedding_stays_the_files_bytes(q8_moe):
    model = load_model(q8_moe)
    embed = model.weights["embed"]
    assert isinstance(embed, FileRows) and embed.source == "Q8_0"
    assert embed.shape == (model.config.vocab_size, model.config.hidden_size)
    tensor = next(t for t in open_gguf(q8_moe).tensors if t.name == "token_embd.weight")
    assert embed.nbytes == np.asarray(tensor.data).nbytes and 0 <= embed.skip < 64
    # the device array lies in the file's own mapping (XLA:CPU took it without a copy),
    # from the 64-byte boundary at or before the tensor
    address = embed.data.unsafe_buffer_pointer()
    assert address % 64 == 0 and mapped_file_at(address) == str(Path(q8_moe).resolve())


def mapped_file_at(address: int) -> str | None:
    """The file mapped at `address` in this process, from /proc/self/maps."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        span, *rest = line.split(maxsplit=5)
        low, high = (int(a, 16) for a in span.split("-"))
        if low <= address < high:
            return rest[4].strip() if len(rest) == 5 else None
    return None


@pytest.mark.parametrize("skip", [0, 32, 8])
def test_rows_held_from_a_boundary_before_them(skip):
    raw = quantized_rows("Q8_0", uneven(12))
    mapping = np.zeros(64 * 3 + raw.nbytes, np.uint8)
    first = (-mapping.ctypes.data) % 64 + 64 + skip  # the tensor `skip` bytes past a boundary
    mapping[first:first + raw.nbytes] = raw.reshape(-1)
    rows = over(mapping, mapping[first:first + raw.nbytes].reshape(raw.shape), "Q8_0", COLUMNS)
    assert rows.skip == skip and rows.data.ctypes.data % 64 == 0
    ids = jnp.asarray([11, 0, 5], jnp.int32)
    got = jax.jit(take_rows)(jax.device_put(rows), ids)
    want = jax.jit(take_rows)(jax.device_put(REPACK["Q8_0"](raw)), ids)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_the_model_answers_as_with_the_embedding_repacked(q8_moe):
    model = load_model(q8_moe)
    source = GGUFSource(Path(q8_moe), open_gguf(q8_moe), None)
    repacked = replace(model, weights={**model.weights, "embed": jax.device_put(source.get_packed("embed"))})
    assert isinstance(repacked.weights["embed"], QTensor)
    prompt = list(range(1, 40))
    np.testing.assert_array_equal(model.logits(prompt), repacked.logits(prompt))


def test_a_tied_or_float_embedding_is_built_as_before(tmp_path):
    tied = load_model(write_gguf(GOLDEN / "llama", tmp_path / "llama.gguf", simple(Q.Q8_0)))
    assert "embed" not in tied.weights and isinstance(tied.weights["lm_head"], QTensor)
    # rows that do not fill a block stay float in the file: nothing to read in place
    floats = load_model(write_gguf(GOLDEN / "olmoe", tmp_path / "k.gguf", mix(lambda name, array: Q.Q4_K)))
    assert not isinstance(floats.weights["embed"], FileRows)
    assert not isinstance(load_model(GOLDEN / "olmoe").weights["embed"], FileRows)  # safetensors


def test_an_embedding_of_the_wrong_shape_is_named(tmp_path):
    hf_dir = GOLDEN / "olmoe"
    hf, raw = read_hf(hf_dir)
    raw = {**raw, "model.embed_tokens.weight": raw["model.embed_tokens.weight"][:-32]}  # a block of rows short
    path = write_tensors(tmp_path / "short.gguf", hf, raw, lambda w: add_tokenizer(w, hf_dir, hf["vocab_size"]),
                         simple(Q.Q8_0))
    with pytest.raises(ModelFileError, match=r"token_embd\.weight.*expected"):
        load_model(path)
