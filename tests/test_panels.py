"""Q6_K, Q5_K, Q4_K, Q4_1 and Q4_0 matrices held as the integer kernels' panels of 16
rows (p8, p4: panel_layout.py, panels.py): the file's values, scales and mins reordered
in the same bytes, and products exact on x as rounded at any number of rows, x in int8
or on 16 bits (two planes of bytes up to 16 rows, int16 pairs past them), by AVX2's
kernels and by AVX-512 VNNI's, which give AVX2's bits."""

from __future__ import annotations

from dataclasses import replace

import jax
import numpy as np
import pytest
from test_expert_tiers import long_prompt, resident_run, tiered_run
from test_int8_activations import int8_reference, k_mix_file  # noqa: F401 (k_mix_file: a fixture)
from test_quant import dequantize_host, random_blocks

from motet.model import load_model, native
from motet.model.expert_pool import ExpertPool
from motet.model.gguf_quants import REPACK
from motet.model.panel_layout import as_panels, rows_of_panels
from motet.model.panels import takes_panels
from motet.model.quant import pick_rows, plain, qmatmul
from motet.model.tiered_model import TieredModel
from motet.model.weights import weight_formats


def q6_k(rows: int, cols: int, seed: int = 3):
    return REPACK["Q6_K"](random_blocks("Q6_K", rows, cols, seed=seed))


def q5_k(rows: int, cols: int, seed: int = 3):
    return REPACK["Q5_K"](random_blocks("Q5_K", rows, cols, seed=seed))


def q4_k(rows: int, cols: int, seed: int = 3):
    return REPACK["Q4_K"](random_blocks("Q4_K", rows, cols, seed=seed))


def q4_1(rows: int, cols: int, seed: int = 3):  # 576 columns: 18 blocks, as SmolLM2's
    return REPACK["Q4_1"](random_blocks("Q4_1", rows, cols + 64 if cols == 512 else cols, seed=seed))


def q4_0(rows: int, cols: int, seed: int = 3):
    return REPACK["Q4_0"](random_blocks("Q4_0", rows, cols, seed=seed))


def q8_0(rows: int, cols: int, seed: int = 3):
    return REPACK["Q8_0"](random_blocks("Q8_0", rows, cols, seed=seed))


def read_here(make, isa: str) -> None:
    """Skips a test of Q8_0's panels where the kernels are AVX2's, which do not read them."""
    if make is q8_0 and isa != "avx512vnni":
        pytest.skip("only AVX-512 VNNI's kernels read Q8_0's panels")


ARRAYS = ("values", "scale", "min", "super_scale", "super_min")
SPLIT_STEPS = 32639  # x_bits 16 over panels: kernels/quantize_x.inc's SPLIT_TOP
STEPS = {8: 127, 16: SPLIT_STEPS}


@pytest.mark.parametrize("make, layout",
                         [(q6_k, "p8"), (q5_k, "p8"), (q4_k, "p4"), (q4_1, "p4"), (q4_0, "p4"), (q8_0, "p8")])
def test_panels_hold_the_same_values_and_scales_in_the_same_bytes(make, layout):
    w = make(48, 512)
    panels = as_panels(w)
    assert (panels.layout, panels.x_bits, panels.values.dtype) == (layout, w.x_bits, np.uint8)
    assert panels.nbytes == w.nbytes and panels.shape == w.shape
    back = rows_of_panels(panels)
    for name in ARRAYS:
        if getattr(w, name) is not None:
            np.testing.assert_array_equal(np.asarray(getattr(back, name)), np.asarray(getattr(w, name)), name)
    np.testing.assert_array_equal(dequantize_host(back), dequantize_host(w))
    assert takes_panels(w, "avx512vnni") and not takes_panels(make(40, 512), "avx512vnni")  # whole panels only
    with pytest.raises(ValueError, match="holds its rows in panels of 16"):
        pick_rows(panels, np.array([0, 3]))


def test_where_panels_put_each_value():
    w, v = q6_k(48, 512), q4_k(48, 512)
    p8, p4 = as_panels(w).values, as_panels(v).values
    # p8: panel 1's first dwords are rows 16 and 17's first four values, plus 32
    np.testing.assert_array_equal(p8[16, :8], (w.values[16:18, :4].astype(np.int16) + 32).astype(np.uint8).ravel())
    # p4: a block's first 32 bytes are columns 0-7's values 0-3 (low nibbles) and 16-19
    # (high): a q4 block's bytes 0-3 hold both already
    np.testing.assert_array_equal(p4[0, :32], v.values[:8, :4].ravel())
    # Q8_0: its int8 values plus 128, in panels only for AVX-512 VNNI's kernels
    e = q8_0(48, 512)
    np.testing.assert_array_equal(as_panels(e).values[16, :8], (e.values[16:18, :4].astype(np.int16) + 128).ravel())
    assert takes_panels(e, "avx512vnni") and not takes_panels(e, "avx2")
    assert takes_panels(REPACK["Q4_1"](random_blocks("Q4_1", 48, 512)), "avx2")


@pytest.mark.parametrize("bits", [8, 16])
@pytest.mark.parametrize("make", [q6_k, q5_k, q4_k, q4_1, q4_0, q8_0])
def test_panel_products_are_exact_on_x_as_rounded_at_any_number_of_rows(panel_isa, make, bits):
    """One row (a decode step), a few, a 16-row step and a prefill's many: each the
    float64 product of x as the kernel rounds it (int8, or 16 bits: split into two bytes,
    or whole past 16 rows, where the panels are widened into int16 pairs);
    the XLA path (which reorders the panels back) computes the unrounded product, off by
    that rounding: about 1e-2 of the largest output for int8, under 1e-4 for 16 bits.
    Q8_0's bytes hold 128 over its values, taken off each plane's integer sums."""
    read_here(make, panel_isa)
    w = make(96, 512)
    panels = jax.device_put(replace(as_panels(w), x_bits=bits))
    rng = np.random.default_rng(5)
    for m in (1, 2, 5, 7, 16, 17, 45, 80):  # past 16 rows a panel is widened once for all
        x = rng.standard_normal((m, w.shape[1])).astype(np.float32)
        want = int8_reference(x, w, STEPS[bits])
        largest = np.abs(want).max()
        got = np.asarray(qmatmul(x, panels, use_native=True))
        assert np.abs(got - want).max() / largest < 1e-5, m
        exact = np.asarray(qmatmul(x, panels, use_native=False))
        off = np.abs(got - exact).max() / largest
        assert (1e-3 < off < 3e-2) if bits == 8 else (1e-7 < off < 1e-4), (m, off)


@pytest.mark.parametrize("make", [q6_k, q5_k, q4_k, q4_1, q4_0, q8_0])
def test_a_stack_of_experts_in_panels_gives_each_experts_product(panel_isa, make):
    """A MoE layer's experts, [E, N, K]: each expert's matrix in panels of its own, read
    in place by the stacked product (and likewise by the experts' kernel)."""
    read_here(make, panel_isa)
    experts = [make(32, 256, seed=e) for e in range(3)]
    stack = jax.tree.map(lambda *leaves: np.stack(leaves), *experts)
    panels = jax.device_put(as_panels(stack))
    np.testing.assert_array_equal(np.asarray(rows_of_panels(panels).values), stack.values)
    rng = np.random.default_rng(6)
    for bits in (8, 16):
        for e, expert in enumerate(experts):
            for m in (1, 16):
                x = rng.standard_normal((m, 256)).astype(np.float32)
                want = int8_reference(x, expert, STEPS[bits])
                got = np.asarray(qmatmul(x, replace(panels, x_bits=bits), use_native=True, index=np.int32(e)))
                assert np.abs(got - want).max() / np.abs(want).max() < 1e-5, (bits, e, m)


def test_the_kernels_refuse_panels_where_they_do_not_read_them(panel_isa):
    panels = jax.device_put(as_panels(q6_k(32, 256)))
    x = np.ones((1, 256), np.float32)
    with pytest.raises(Exception, match="in 16-row panels"):  # scales widened to float32 do not go in panels
        qmatmul(x, jax.device_put(replace(plain(q4_k(32, 256)), layout="p4")), use_native=True).block_until_ready()
    eight_bits = jax.device_put(as_panels(q8_0(32, 256)))
    if panel_isa == "avx2":  # its vpmaddubsw would saturate on Q8_0's bytes
        with pytest.raises(Exception, match="Q8_0 in panels is read by the AVX-512 VNNI kernels only"):
            qmatmul(x, eight_bits, use_native=True).block_until_ready()
    try:
        for other in ("avx512", "base"):  # the kernels that read rows
            if native.select_instruction_set(other):
                with pytest.raises(Exception, match="panels are read by the AVX2 and AVX-512 VNNI kernels only"):
                    qmatmul(x, panels, use_native=True).block_until_ready()
    finally:
        native.select_instruction_set(panel_isa)


@pytest.mark.parametrize("make", [q6_k, q5_k, q4_k, q4_1, q4_0])
def test_avx512_vnni_gives_the_bits_avx2_gives_over_panels(make):
    """The same rounding of x and the same float sums in 512 bits: every output the same
    bits, for both widths of x, at every count of rows (the byte planes, the int16 pairs
    past 16 rows, and int8's other order of factors there)."""
    best = native.instruction_set()
    if not (native.available() and native.select_instruction_set("avx512vnni")):
        pytest.skip("this CPU has no avx512vnni")
    w = make(96, 512)
    rng = np.random.default_rng(8)
    try:
        for bits in (8, 16):
            panels = jax.device_put(replace(as_panels(w), x_bits=bits))
            for m in (1, 3, 6, 7, 16, 17, 40):
                x = rng.standard_normal((m, w.shape[1])).astype(np.float32)
                out = {}
                for isa in ("avx2", "avx512vnni"):
                    assert native.select_instruction_set(isa)
                    out[isa] = np.asarray(qmatmul(x, panels, use_native=True))
                np.testing.assert_array_equal(out["avx512vnni"], out["avx2"], f"{bits} bits, {m} rows")
    finally:
        native.select_instruction_set(best)


def test_a_load_holds_its_k_matrices_in_panels_for_either_x(panel_isa, k_mix_file):  # noqa: F811
    """The Q4_K_M-like file's Q6_K matrices (the head, V, layer 0's experts' down
    projections) and Q4_K ones (the rest but the embedding): in panels, x on 16 bits
    giving the prompt's logits within 1e-4 of the row-major layouts' (whose one-row dots
    take x in int16), and the same arrays when the model is set to int8."""
    path, vocab = k_mix_file
    prompt = long_prompt("qwen3_moe", vocab)
    model = load_model(path)
    head = model.weights["lm_head"]
    assert head.layout == "p8"
    layer = model.weights["layers"][0]
    assert [layer[name].layout for name in ("experts_down", "experts_gate_up", "wo")] == ["p8", "p4", "p4"]
    assert [p.layout for p in layer["wqkv"].pieces] == ["p4", "p8"]
    formats = weight_formats(model.weights)
    assert formats["lm_head"]["formats"] == ["Q6_K in panels of 16 rows"]
    assert "Q4_K in panels of 16 rows | Q6_K in panels of 16 rows" in formats["wqkv"]["formats"]
    assert formats["embed"]["formats"] == ["Q4_K (the file's blocks)"]
    rows = replace(model, weights={**model.weights, "lm_head": rows_of_panels(head)})
    got, want = resident_run(model, prompt)[1][0], resident_run(rows, prompt)[1][0]
    assert 0 < np.abs(got - want).max() / np.abs(want).max() < 1e-4
    int8 = model.with_settings(activations="int8")
    assert int8.config.x_bits == 8 and int8.weights is model.weights


@pytest.mark.parametrize("activations", ["int16", "int8"])
def test_a_tiered_pool_holds_its_experts_in_panels(panel_isa, k_mix_file, activations):  # noqa: F811
    """Experts read from the file one by one into RAM and a pool of 2 slots: Q4_K's and
    Q6_K's and Q5_K's in panels as the resident model holds them, the same bytes, and the
    resident model's greedy tokens."""
    path, vocab = k_mix_file
    prompt = long_prompt("qwen3_moe", vocab)
    resident = load_model(path, activations=activations)
    lazy = load_model(path, lazy_experts=True, activations=activations)
    pool = ExpertPool(lazy.expert_reader, sum(lazy.config.moe_layers), lazy.config.n_experts, 2, 2)
    assert [[w.layout for w in layer] for layer in pool.pools] == [["p4", "p8"], ["p4", "p8"]]
    tokens, logits, _ = tiered_run(TieredModel(lazy, pool), prompt)
    want_tokens, want, _ = resident_run(resident, prompt)
    assert tokens == want_tokens
    assert np.abs(logits - want).max() / np.abs(want).max() < 1e-4
