"""tests/kquants.py writes K-quant blocks that gguf-py's own dequantizer reads back as the
values quantized (within half a step), that are a fixed point of quantize(dequantize()),
and that survive a trip through a GGUF file with their logical shape."""

import gguf
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from kquants import KINDS, quantize_k


def dequantize(raw: np.ndarray, kind: str) -> np.ndarray:
    return gguf.quants.dequantize(raw, GGMLQuantizationType[kind])


def step_per_super_block(x: np.ndarray, kind: str) -> np.ndarray:
    """The quantization step each 256-value super-block's widest sub-block gets: the
    range from min(x, 0) to max(x, 0) over 15 or 31 levels, or |x|max over 31 for the
    symmetric Q6_K."""
    b = x.reshape(-1, 256)
    if kind == "Q6_K":
        return np.abs(b).max(axis=1) / 31
    levels = 15 if kind == "Q4_K" else 31
    return (np.maximum(b.max(axis=1), 0) - np.minimum(b.min(axis=1), 0)) / levels


def gaussian(*shape: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def uneven(seed: int = 0) -> np.ndarray:
    """Gaussian data whose 32-value sub-blocks differ in scale by up to e^6, so that small
    sub-blocks share a super-block with large ones: the case where scales and mins
    rounded to 6 bits are coarsest."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((8, 16, 32)) * np.exp(rng.uniform(-3, 3, (8, 16, 1)))
    return x.astype(np.float32).reshape(8, 512)


@pytest.mark.parametrize("kind", KINDS)
def test_error_is_within_half_a_step(kind):
    x = gaussian(8, 512)
    raw = quantize_k(x, kind)
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    assert raw.dtype == np.uint8 and raw.shape == (8, 512 // block * size)
    y = dequantize(raw, kind)
    assert y.shape == x.shape and np.isfinite(y).all()
    err = np.abs(y - x).reshape(-1, 256).max(axis=1)
    # half a step, plus room for the f16 rounding of the block scales
    assert (err <= 0.51 * step_per_super_block(x, kind)).all()
    # a wrong bit layout could still land inside the bound on some values, never on most
    assert np.sqrt(np.mean((y - x) ** 2)) < 0.35 * step_per_super_block(x, kind).mean()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("data", [gaussian(8, 512), uneven()], ids=["gaussian", "uneven"])
def test_requantizing_reproduces_the_same_blocks(kind, data):
    raw = quantize_k(data, kind)
    y = dequantize(raw, kind)
    again = quantize_k(y, kind)
    np.testing.assert_array_equal(again, raw)
    np.testing.assert_array_equal(dequantize(again, kind), y)


@pytest.mark.parametrize("kind", KINDS)
def test_zero_and_constant_rows(kind):
    rows = [np.zeros(512), np.full(512, 0.7), np.full(512, -2.5), gaussian(512)]
    x = np.stack(rows).astype(np.float32)
    y = dequantize(quantize_k(x, kind), kind)
    assert np.isfinite(y).all()
    np.testing.assert_array_equal(y[0], 0)
    # a constant is carried by the f16 scales alone: exact to their precision
    np.testing.assert_allclose(y[1:3], x[1:3], rtol=2e-3)
    assert np.abs(y[3] - x[3]).max() <= 0.51 * step_per_super_block(x[3], kind).max()


@pytest.mark.parametrize("kind", KINDS)
def test_expert_stack_round_trips_through_gguf(kind, tmp_path):
    x = gaussian(3, 4, 512, seed=2)  # [experts, rows, cols]
    raw = quantize_k(x, kind)
    assert raw.shape[:2] == (3, 4)
    path = tmp_path / "experts.gguf"
    writer = gguf.GGUFWriter(str(path), "test")
    writer.add_tensor("blk.0.ffn_up_exps.weight", raw, raw_dtype=GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    (tensor,) = gguf.GGUFReader(str(path)).tensors
    assert tensor.tensor_type == GGMLQuantizationType[kind]
    assert list(tensor.shape) == [512, 4, 3]  # ggml order: innermost first
    assert tensor.n_elements == x.size
    y = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    assert y.shape == x.shape
    np.testing.assert_array_equal(y, dequantize(raw, kind))


@pytest.mark.parametrize("x, kind", [
    (gaussian(2, 300), "Q4_K"),  # not whole super-blocks
    (np.full((1, 256), np.nan, np.float32), "Q5_K"),
    (np.full((1, 256), 1e9, np.float32), "Q6_K"),  # past what f16 scales reach
    (gaussian(1, 256), "Q8_K"),
])
def test_rejects_what_it_cannot_encode(x, kind):
    with pytest.raises(ValueError):
        quantize_k(x, kind)
