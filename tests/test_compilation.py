"""model/compilation.py: compiling ahead says when every compile is done; once an engine
is warm, JAX's lowered modules are let go, and the executables they were compiled to
still serve every call."""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp

from motet.model.compilation import CompileCounter, compiling_ahead, drop_lowerings


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


class Held:
    """A lowered module whose compile waits for `release`."""

    def __init__(self, release: threading.Event):
        self.release = release

    def compile(self):
        assert self.release.wait(timeout=60)


def test_waiting_on_a_compile_says_whether_every_compile_is_done():
    release, finished = threading.Event(), []
    lowerings = [("quick", lambda: jax.jit(lambda v: v + 2).lower(jnp.arange(4.0))), ("held", lambda: Held(release))]
    with compiling_ahead(lowerings, workers=2, done=finished.append) as wait:
        assert wait("quick") is False  # "held" still compiles
        release.set()
        assert wait("held") is True
        assert wait("unknown") is True
    assert sorted(finished) == ["held", "quick"]
