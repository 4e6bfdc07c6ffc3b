"""The native norm (kernels/norm.cc) computes what XLA computes, alone and after a
residual add, over the row shapes motet's models use; and refuses operands that do not
fit together."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from motet.model import native
from motet.model.norm import add_rms_norm, rms_norm

pytestmark = pytest.mark.skipif(not native.available(), reason="the native kernels were not built")

# a decode row of the default model, a prefill chunk, per-head q/k norms [t, heads, d],
# and a width that is no multiple of eight
SHAPES = [(1, 576), (37, 512), (5, 8, 64), (3, 13)]


@pytest.mark.parametrize("shape", SHAPES)
def test_the_native_norm_equals_xla(shape):
    rng = np.random.default_rng(0)
    x, y = (rng.standard_normal(shape).astype(np.float32) * 3 for _ in range(2))
    w = rng.standard_normal(shape[-1]).astype(np.float32)
    for eps in (1e-5, 1e-6):
        native_out = jax.jit(lambda x, w: rms_norm(x, w, eps, use_native=True))(x, w)
        xla_out = jax.jit(lambda x, w: rms_norm(x, w, eps, use_native=False))(x, w)
        np.testing.assert_allclose(np.asarray(native_out), np.asarray(xla_out), rtol=2e-6, atol=2e-6)
        (total, normed) = jax.jit(lambda x, y, w: add_rms_norm(x, y, w, eps, use_native=True))(x, y, w)
        (xla_total, xla_normed) = jax.jit(lambda x, y, w: add_rms_norm(x, y, w, eps, use_native=False))(x, y, w)
        np.testing.assert_array_equal(np.asarray(total), x + y)
        np.testing.assert_array_equal(np.asarray(xla_total), x + y)
        np.testing.assert_allclose(np.asarray(normed), np.asarray(xla_normed), rtol=2e-6, atol=2e-6)


def test_other_dtypes_take_the_xla_path():
    x = jnp.ones((2, 16), jnp.bfloat16)
    out = rms_norm(x, jnp.full((16,), 2.0, jnp.bfloat16), 1e-6)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out, np.float32), 2.0, rtol=1e-2)
    with pytest.raises(RuntimeError, match="rms norm"):
        rms_norm(x, jnp.ones((16,), jnp.bfloat16), 1e-6, use_native=True)


def test_the_kernel_refuses_a_weight_of_another_width():
    call = jax.ffi.ffi_call(native.RMS_NORM, (jax.ShapeDtypeStruct((0,), jnp.float32),
                                              jax.ShapeDtypeStruct((2, 16), jnp.float32)))
    for width in (5, 8):  # 8 divides x's 32 values, but is not its last axis
        with pytest.raises(Exception, match="rms_norm: x's last axis is not the weight's length"):
            jax.block_until_ready(call(jnp.ones((2, 16)), jnp.zeros((0,)), jnp.ones((width,)), eps=np.float32(1e-6)))
