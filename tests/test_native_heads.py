"""The native QKV heads (kernels/norm_rope.cc: split, q and k normed, rotary embeddings)
give what XLA computes (model/heads.py), for every head norm motet's models use, at
positions up to a long context; and the kernel refuses operands that do not fit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from motet.model import native
from motet.model.config import ModelConfig
from motet.model.heads import HEAD_NORMS, qkv_heads

pytestmark = pytest.mark.skipif(not native.available(), reason="the native kernels were not built")

# (query heads, KV heads, head dim, theta, norm): the default model's, the Qwen3-MoE
# benchmark file's (per-head q/k norms), OLMoE's kind (over all heads), a tiny model's
CASES = [(9, 3, 64, 1e5, "none"), (8, 4, 64, 1e6, "head"), (4, 2, 16, 1e4, "full"), (2, 1, 8, 1e4, "none")]


def config(q_heads, kv_heads, head_dim, theta, norm) -> ModelConfig:
    return ModelConfig(arch="llama", vocab_size=64, hidden_size=q_heads * head_dim, n_layers=1, n_heads=q_heads,
                       n_kv_heads=kv_heads, head_dim=head_dim, intermediate_size=32, rope_theta=theta,
                       rms_eps=1e-6, max_context=8192, tie_embeddings=True, qk_norm=norm)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("tokens", (1, 37))
def test_the_native_heads_equal_xla(case, tokens):
    cfg = config(*case)
    q_heads, kv_heads, d, _, norm = case
    rng = np.random.default_rng(1)
    proj = rng.standard_normal((tokens, (q_heads + 2 * kv_heads) * d)).astype(np.float32) * 2
    widths = {"none": (0, 0), "head": (d, d), "full": (q_heads * d, kv_heads * d)}[norm]
    q_norm, k_norm = (rng.standard_normal(w).astype(np.float32) for w in widths)
    for positions in (np.arange(tokens), 8191 - np.arange(tokens)):  # a context's start and a long one's end
        args = (proj, positions.astype(np.int32), q_norm, k_norm)
        native_out = jax.jit(lambda *a: qkv_heads(cfg, *a, use_native=True))(*args)
        xla_out = jax.jit(lambda *a: qkv_heads(cfg, *a, use_native=False))(*args)
        for got, want, heads in zip(native_out, xla_out, (q_heads, kv_heads, kv_heads)):
            assert got.shape == want.shape == (tokens, heads, d)
            # the two round the same float32 angles; their sines differ in the last bits,
            # which at angles near 8000 radians is a few 1e-5 of a value
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-4, rtol=1e-5)
        np.testing.assert_array_equal(np.asarray(native_out[2]), proj[:, (q_heads + kv_heads) * d:].reshape(tokens, -1, d))


def test_a_norm_split_over_tp_takes_the_xla_path():
    cfg = config(4, 2, 16, 1e4, "full")
    with pytest.raises(RuntimeError, match="QKV heads"):
        qkv_heads(cfg, jnp.ones((1, 128)), jnp.zeros(1, jnp.int32), jnp.ones(64), jnp.ones(32),
                  split_over_tp=True, use_native=True)


def test_the_kernel_refuses_what_does_not_fit():
    def call(width, q_norm=0, norm="none"):
        shapes = [jax.ShapeDtypeStruct((2, n, 16), jnp.float32) for n in (3, 1, 1)]
        out = jax.ffi.ffi_call(native.QKV_HEADS, shapes)(
            jnp.ones((2, width)), jnp.zeros(2, jnp.int32), jnp.ones(8), jnp.ones(q_norm), jnp.ones(q_norm),
            q_heads=np.int64(3), kv_heads=np.int64(1), norm=np.int64(HEAD_NORMS[norm]), eps=np.float32(1e-6))
        jax.block_until_ready(out)

    call(5 * 16)  # fits
    with pytest.raises(Exception, match=r"qkv_heads: proj must be \[tokens, \(q_heads \+ 2 \* kv_heads\)"):
        call(4 * 16)
    with pytest.raises(Exception, match="qkv_heads: the norms' weights do not fit the norm asked for"):
        call(5 * 16, q_norm=16, norm="full")
