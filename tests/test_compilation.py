"""model/compilation.py: once an engine is warm, JAX's lowered modules are let go, and
the executables they were compiled to still serve every call."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from motet.model.compilation import CompileCounter, drop_lowerings


def test_the_lowered_modules_are_let_go_and_the_executable_kept():
    step = jax.jit(lambda x: x * 3 + 1)
    x = jnp.arange(4.0)
    step(x)
    kept = step.lower(x)._lowering
    assert step.lower(x)._lowering is kept  # JAX holds what it lowered

    assert drop_lowerings() >= 1
    assert step.lower(x)._lowering is not kept  # lowered afresh: the cache was emptied
    drop_lowerings()

    counter = CompileCounter().start()
    try:
        assert step(x).tolist() == [1.0, 4.0, 7.0, 10.0]
    finally:
        counter.stop()
    assert counter.now().requests == 0  # the call found its executable
