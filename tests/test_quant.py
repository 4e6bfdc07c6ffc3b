"""Quantized weights: GGUF's blocks repack without changing a value, the native kernel
agrees with the XLA path on every instruction set this CPU has, and the default model
computes from its quantized file what it computes from the same values in float32."""

import platform
import shutil
import subprocess
import sys
from dataclasses import replace

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import chosen_kernels
from gguf import GGMLQuantizationType as Q

from motet.model import native, quant
from motet.model.gguf_quants import REPACK
from motet.model.panels import kernels_read_panels
from motet.model.quant import (
    QRows,
    QTensor,
    as_q8,
    dequantize,
    join_rows,
    matmul,
    matmul_stacked,
    qmatmul,
    scales_of,
    stack,
    stack_rows,
)

# where each format keeps its f16 scales (random bytes there could be inf or NaN)
F16_FIELDS = {"Q4_0": [0], "Q4_1": [0, 2], "Q8_0": [0], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}


def dequantize_host(w: QTensor) -> np.ndarray:
    """The float matrix a QTensor stands for, in numpy: the reference the jitted paths
    are checked against."""
    lead = w.values.shape[:-1]
    values = np.asarray(w.values)
    if w.layout == "q4":
        v = values.reshape(*lead, -1, 16)
        q = np.concatenate([v & 15, v >> 4], axis=-1)
    else:
        q = values.reshape(*lead, -1, w.block)
    scale, mins = scales_of(jax.tree.map(np.asarray, w), np)
    out = q.astype(np.float32) * scale[..., None]
    if mins is not None:
        out += mins[..., None]
    return out.reshape(*lead, -1)


def random_blocks(kind: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """A tensor of `kind` as GGUF stores it: any bytes are valid blocks once the f16
    scales are finite. Returns uint8 [rows, bytes per row]."""
    rng = np.random.default_rng(seed)
    values, size = gguf.GGML_QUANT_SIZES[Q[kind]]
    raw = rng.integers(0, 256, (rows, cols // values, size), dtype=np.uint8)
    for at in F16_FIELDS[kind]:
        scales = rng.uniform(-0.05, 0.05, (rows, cols // values)).astype(np.float16)
        raw[..., at:at + 2] = scales[..., None].view(np.uint8)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("kind", sorted(REPACK))
def test_every_gguf_type_repacks_to_the_values_gguf_reads(kind):
    raw = random_blocks(kind, 6, 512)
    packed = REPACK[kind](raw)
    assert packed.shape == (6, 512) and packed.source == kind
    np.testing.assert_array_equal(dequantize_host(packed), gguf.quants.dequantize(raw, Q[kind]))
    # the jitted dequantization reads the same values
    np.testing.assert_array_equal(np.asarray(dequantize(jax.device_put(packed))), dequantize_host(packed))
    # scales as the file keeps them: the simple types' f16; the K types' integers, with
    # their super-block's f16 (as float32) per 256 values
    if kind in ("Q4_0", "Q4_1", "Q8_0"):
        assert packed.scale.dtype == np.float16 and packed.super_scale is None
    else:
        assert packed.scale.dtype == (np.int8 if kind == "Q6_K" else np.uint8)
        assert packed.super_scale.shape == (6, 2) and packed.super_scale.dtype == np.float32
        assert packed.group * packed.block == 256


def test_q4_0_mins_that_would_overflow_f16_fall_back_to_float32():
    raw = random_blocks("Q4_0", 2, 64)
    raw[0, 0:2] = np.array([10000.0], np.float16).view(np.uint8)  # -8 · d is past f16's range
    packed = REPACK["Q4_0"](raw)
    assert packed.scale.dtype == packed.min.dtype == np.float32
    np.testing.assert_array_equal(dequantize_host(packed), gguf.quants.dequantize(raw, Q.Q4_0))


def test_stacking_different_layouts_keeps_every_value():
    """Q, K and V (or gate and up) of a Q4_K_M file come in different types."""
    parts = [REPACK[k](random_blocks(k, 4, 256, seed=i)) for i, k in enumerate(("Q4_K", "Q6_K", "Q8_0"))]
    stacked = stack_rows(parts)
    assert (stacked.layout, stacked.block) == ("q8", 16)
    np.testing.assert_array_equal(dequantize_host(stacked), np.concatenate([dequantize_host(p) for p in parts]))
    same = stack_rows([parts[0], REPACK["Q4_K"](random_blocks("Q4_K", 2, 256, seed=9))])
    assert (same.layout, same.block) == ("q4", 32)  # alike parts stay compact


def test_a_matrix_of_parts_in_different_layouts_keeps_each_part_as_the_file_holds_it():
    """Q and K in Q4_K beside V in Q6_K (a Q4_K_M file's attention) are two pieces, Q and K
    stacked as q4 and V as q8, not one matrix widened to int8; the product of the pieces
    is the product of the whole, on the native kernel and on the XLA path."""
    q, k, v = (REPACK[kind](random_blocks(kind, rows, 256, seed=i))
               for i, (kind, rows) in enumerate((("Q4_K", 8), ("Q4_K", 4), ("Q6_K", 4))))
    joined = join_rows([q, k, v])
    assert isinstance(joined, QRows) and [(p.layout, p.source) for p in joined.pieces] == [("q4", "Q4_K"), ("q8", "Q6_K")]
    assert joined.shape == (16, 256) and joined.nbytes == q.nbytes + k.nbytes + v.nbytes
    assert joined.nbytes < stack_rows([q, k, v]).nbytes / 2
    assert join_rows([q, k]).layout == "q4"  # alike parts stay one matrix
    whole = np.concatenate([dequantize_host(p) for p in (q, k, v)])
    x = np.random.default_rng(3).standard_normal((5, 256)).astype(np.float32)
    want = x.astype(np.float64) @ whole.T.astype(np.float64)
    for use_native in ([None, False] if native.available() else [False]):
        pieces = [qmatmul(jnp.asarray(x), jax.device_put(p), use_native=use_native) for p in joined.pieces]
        got = np.asarray(jnp.concatenate(pieces, axis=-1))
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())
    np.testing.assert_allclose(np.asarray(matmul(jnp.asarray(x), jax.device_put(joined))), want, rtol=0,
                               atol=1e-4 * np.abs(want).max())


def test_the_native_kernel_is_built_where_a_compiler_is():
    if shutil.which("g++") is None or platform.system() != "Linux":
        pytest.skip("no C++ compiler here: the XLA path serves")
    assert native.available(), "the install should have built motet/model/_qmatmul*.so"
    assert native.instruction_set() in native.INSTRUCTION_SETS


def layouts():
    """Each layout with float16 scales (Q4_1, Q8_0, Q4_0) and the K types' packed ones."""
    yield REPACK["Q4_1"](random_blocks("Q4_1", 70, 576, seed=1))
    yield REPACK["Q4_0"](random_blocks("Q4_0", 65, 256, seed=7))
    yield REPACK["Q4_K"](random_blocks("Q4_K", 66, 512, seed=8))
    yield REPACK["Q8_0"](random_blocks("Q8_0", 33, 576, seed=2))
    yield REPACK["Q6_K"](random_blocks("Q6_K", 40, 512, seed=3))
    yield REPACK["Q5_K"](random_blocks("Q5_K", 9, 256, seed=4))
    # more panels of 16 rows than AVX-512 VNNI's integer pairs take a unit (8), the last
    # one short: each unit asks for its next panel's bytes while it widens one
    yield REPACK["Q4_K"](random_blocks("Q4_K", 200, 256, seed=10))
    # rows shorter than the AVX-512 one-row dots' 64-byte steps: all of them a tail
    yield REPACK["Q4_1"](random_blocks("Q4_1", 5, 96, seed=5))
    yield REPACK["Q8_0"](random_blocks("Q8_0", 6, 96, seed=6))
    # int8 by 16 with a last 32 values past the dots' steps of 64 (AVX2: a span of its own)
    yield as_q8(REPACK["Q8_0"](random_blocks("Q8_0", 7, 96, seed=9)), 16)


# The most rows of x each instruction set's one-row dots take (matvec_*.inc's ROWS_IN_DOTS).
INT16_ROWS = {"avx512": 3, "base": 1}


def kernel_tolerance(m: int, isa: str) -> float:
    """The kernel's error bound, relative to the largest output, for m rows of x: the
    one-row dots quantize x to int16 per 32 values (AVX-512's take up to three rows at
    once), and so do the integer pairs past them (AVX-512 VNNI's and AVX2's); more rows
    run in float32 elsewhere."""
    return 1e-4 if isa in native.FLOAT_ROWS_INSTEAD or m <= INT16_ROWS[isa] else 1e-5


@pytest.mark.skipif(not native.available(), reason="the native kernel was not built")
@pytest.mark.parametrize("isa", native.INSTRUCTION_SETS)
def test_the_kernel_equals_the_xla_path(isa):
    best = native.instruction_set()
    if not native.select_instruction_set(isa):
        pytest.skip(f"this CPU has no {isa}")
    try:
        rng = np.random.default_rng(0)
        for w in layouts():
            w = jax.device_put(w)
            reference = dequantize_host(w).astype(np.float64)
            # 1: decode (with AVX2, up to 6 rows of x at once);
            # then few rows (panels of w as floats, up to 159 with AVX-512); then
            # many (k-major panels); AVX2 and VNNI take more rows than their dots as
            # integer pairs: each its own loop
            for m in (1, 2, 3, 4, 5, 6, 7, 16, 31, 45, 63, 64, 170, 256):
                x = rng.standard_normal((m, w.shape[1])).astype(np.float32)
                want = x.astype(np.float64) @ reference.T
                scale = np.abs(want).max()
                xla = np.asarray(jax.jit(lambda x, w: qmatmul(x, w, use_native=False))(x, w))
                # the AVX-512 one-row dots take 1 or 4 weight rows a pass, by the CPU's
                # vendor: both, on any CPU
                for rows in (1, 4) if m == 1 else (0,):
                    native.rows_at_once(rows)
                    kernel = np.asarray(jax.jit(lambda x, w: qmatmul(x, w, use_native=True))(x, w))
                    tolerance = kernel_tolerance(m, isa)
                    assert np.abs(kernel - want).max() / scale < tolerance, (w.source, m, rows)
                    assert np.abs(kernel - xla).max() / scale < tolerance, (w.source, m, rows)
    finally:
        native.select_instruction_set(best)
        native.rows_at_once(0)


@pytest.fixture
def avx2():
    """The kernel's AVX2 build for the test (skipped where the CPU has none), the best
    one again after it."""
    yield from chosen_kernels("avx2")


def test_the_avx2_dots_give_packed_k_scales_the_bits_of_widened_ones(avx2):
    """The AVX2 dots read packed K-type scales as the same floats that widening them at
    load gives (one product of the integer and its super-block's float), so AVX2 keeping
    them packed changes no bit: in the one-row dots (up to six rows of x) and in the
    panels of more rows, which widen a unit's rows first."""
    rng = np.random.default_rng(3)
    for w in layouts():
        if w.super_scale is None:
            continue
        for m in (1, 4, 6, 16, 64):
            x = rng.standard_normal((m, w.shape[1])).astype(np.float32)
            packed = np.asarray(qmatmul(x, jax.device_put(w), use_native=True))
            widened = np.asarray(qmatmul(x, jax.device_put(quant.plain(w)), use_native=True))
            assert np.array_equal(packed, widened), (w.source, m)


def test_the_avx2_dots_give_a_row_the_same_bits_alone_or_among_six(avx2):
    """The AVX2 dots take up to six rows of x against each weight row's bytes, and add
    each row's float sums in one order whatever the count: a row's output is the same
    alone or beside others, so where an expert's rows land in a step (tiered or
    resident, one stream or several) changes no bit."""
    rng = np.random.default_rng(5)
    for w in layouts():
        w = jax.device_put(w)
        x = rng.standard_normal((6, w.shape[1])).astype(np.float32)
        alone = np.concatenate([np.asarray(qmatmul(x[i:i + 1], w, use_native=True)) for i in range(6)])
        for m in range(2, 7):
            together = np.asarray(qmatmul(x[:m], w, use_native=True))
            assert np.array_equal(together, alone[:m]), (w.source, m)


@pytest.mark.skipif(not native.available(), reason="the native kernel was not built")
def test_the_kernel_refuses_packed_scales_it_cannot_read_with_a_clear_error():
    w = REPACK["Q4_K"](random_blocks("Q4_K", 4, 256))  # a row: 8 blocks, one super-block
    x = np.ones((1, 256), np.float32)
    # as many super entries as the blocks need, but a row is half a group
    halved = replace(w, super_scale=w.super_scale.reshape(-1)[:2], super_min=w.super_min.reshape(-1)[:2], group=16)
    with pytest.raises(Exception, match="qmatmul: shapes do not agree"):
        np.asarray(qmatmul(x, jax.device_put(halved), use_native=True))
    wrong_type = replace(w, super_scale=w.super_scale.astype(np.float16))
    with pytest.raises(Exception, match="uint8 or int8 with float32 super entries"):
        np.asarray(qmatmul(x, jax.device_put(wrong_type), use_native=True))


@pytest.mark.skipif(not native.available(), reason="the native kernel was not built")
@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K", "Q5_K", "Q4_1", "Q8_0"])
def test_one_matrix_of_a_stack_is_read_in_place_and_equals_it_alone(kind):
    """An expert of a stack [E, N, K], picked by a traced index: the kernel (reading the
    stack in place), the XLA path (slicing it) and the matrix alone agree; an index
    outside the stack is clamped, as a dynamic slice clamps it."""
    experts = [REPACK[kind](random_blocks(kind, 24, 256, seed=e)) for e in range(4)]
    stacked = jax.device_put(stack(experts))
    pick = jax.jit(lambda x, w, e, native_: matmul_stacked(x, w, e) if native_ else
                   qmatmul(x, w, use_native=False, index=e), static_argnums=3)
    rng = np.random.default_rng(5)
    for m in (1, 5, 40):
        x = rng.standard_normal((m, 256)).astype(np.float32)
        for e in (0, 2, 3, 9):
            alone = np.asarray(qmatmul(x, jax.device_put(experts[min(e, 3)])))
            np.testing.assert_array_equal(np.asarray(pick(x, stacked, e, True)), alone)
            xla = np.asarray(pick(x, stacked, e, False))
            assert np.abs(xla - alone).max() / np.abs(alone).max() < kernel_tolerance(m, native.instruction_set())
    plain = jnp.asarray(np.stack([dequantize_host(w).T for w in experts]))  # [E, K, N]
    x = jnp.asarray(rng.standard_normal((3, 256)).astype(np.float32))
    np.testing.assert_allclose(np.asarray(matmul_stacked(x, plain, 1)), np.asarray(x @ plain[1]), rtol=1e-6)


def test_matmul_takes_plain_arrays_and_quantized_ones_alike():
    w = jax.device_put(REPACK["Q4_0"](random_blocks("Q4_0", 8, 64)))
    x = jnp.ones((3, 64), jnp.float32)
    dense = jnp.asarray(dequantize_host(w).T)
    np.testing.assert_allclose(np.asarray(matmul(x, w)), np.asarray(matmul(x, dense)), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="one \\[N, K\\] matrix, or a stack"):
        qmatmul(x, QTensor(np.zeros((2, 8, 32), np.uint8), np.zeros((2, 8, 2), np.float32), None, "q4", 32))


@pytest.fixture(scope="module")
def default_models(default_model_file):
    from motet.model.loader import load_model

    return load_model(default_model_file), load_model(default_model_file, dtype="float32")


def test_the_default_model_stays_quantized_and_computes_what_float32_computes(default_models):
    quantized, floats = default_models
    assert quantized.weight_format == "quantized" and floats.weight_format == "float32"
    formats = quantized.info()["tensor_formats"]
    q4_1 = "Q4_1 in panels of 16 rows" if kernels_read_panels() else "Q4_1"  # as the kernels read it
    assert formats["wqkv"]["formats"] == [q4_1] and formats["lm_head"]["formats"] == ["Q8_0"]
    # the file's 98 MB, against 538 MB of float32
    assert quantized.info()["weight_bytes"] < 130e6 < 500e6 < floats.info()["weight_bytes"]
    ids = quantized.tokenizer.encode(quantized.render_chat([{"role": "user", "content": "What is the capital of France?"}]))
    want, got = floats.logits(ids), quantized.logits(ids)
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-3
    assert (got.argmax(-1) == want.argmax(-1)).all()


def test_decode_steps_agree_too(default_models):
    """One token at a time runs the kernel's matrix-vector loop, not the prefill one."""
    from motet.model.generate import generate

    quantized, floats = default_models
    ids = quantized.tokenizer.encode(quantized.render_chat([{"role": "user", "content": "Name three colours."}]))
    assert list(generate(quantized, ids, max_tokens=12)) == list(generate(floats, ids, max_tokens=12))


def test_motet_info_shows_each_group_format_and_the_bytes_a_token_reads(default_model_file):
    out = subprocess.run([sys.executable, "-m", "motet", "info", "--model", str(default_model_file)],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    assert "Q4_1" in out and "Q8_0" in out and "bytes read per decode token" in out


@pytest.mark.parametrize("arch, key, renormalized", [
    ("qwen3moe", None, True),  # llama.cpp renormalizes Qwen3-MoE's top-k, with no key to say so
    ("olmoe", None, False),
    ("llama", None, True),  # Mixtral, stored under llama
    ("olmoe", True, True),  # the key, where a file has it, decides
    ("qwen3moe", False, False),
])
def test_gguf_routing_renormalizes_as_llama_cpp_does(arch, key, renormalized):
    from motet.model.config import config_from_gguf

    meta = {"general.architecture": arch, f"{arch}.attention.head_count": 4, f"{arch}.embedding_length": 64,
            f"{arch}.expert_count": 8, f"{arch}.expert_used_count": 2, f"{arch}.block_count": 2,
            f"{arch}.vocab_size": 100}
    if key is not None:
        meta[f"{arch}.expert_weights_norm"] = key
    assert config_from_gguf(meta, has_output_weight=True).norm_topk_prob is renormalized


def test_one_row_as_a_fused_reduction_equals_the_dequantized_dot():
    """The GPU's form of a decode token's product (quant._reduced_row): every layout,
    against the float32 dot over the same values."""
    rng = np.random.default_rng(0)
    for w in layouts():
        x = jnp.asarray(rng.standard_normal((1, w.shape[1])), jnp.float32)
        w = jax.tree.map(jnp.asarray, w)
        got, want = (np.asarray(jax.jit(f)(x, w)) for f in (quant._reduced_row, quant._dequantized_dot))
        assert got.shape == want.shape == (1, w.shape[0])
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
