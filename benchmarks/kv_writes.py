"""A step's KV write, native (kernels/kv_write.cc) against XLA's (model/kv_writes.py),
on the default model's caches (float16, 16 slots of 768 positions and the scratch
slot): the memory the compiled writes of an engine's shapes hold, and each write's
time.

    .venv/bin/python benchmarks/kv_writes.py [--rounds 5]

Memory: every shape of one form (decode rows 1, 2, 4, 8 and 16; prefill chunks 16 to
256 tokens) compiled in a process of its own, after one write of another shape (the
compiler's first use, counted in no shape): the growth of RSS after glibc's malloc_trim
(what the executables hold, not the allocator's slack). No persistent compilation
cache: each compiles. Time: a write of
1 and 16 rows and of a 256-token chunk, the forms taking turns round after round, each
its best round. Prints JSON, then a table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from compiled_steps import resident_mb

from motet.model import kv_writes, load_model, native
from motet.model.kv import KVGeometry, init_kv

ROWS = (1, 2, 4, 8, 16)
CHUNKS = (16, 32, 64, 128, 256)
TIMED = (("rows 1", 1), ("rows 16", 16), ("chunk 256", 256))
CALLS = {1: 200, 16: 200, 256: 20}


def new_rows(cfg, shape: str, n: int):
    """A write's (new K, new V, slots, positions): n decode rows, or a chunk of n tokens."""
    layers, heads, dim = cfg.n_layers, cfg.n_kv_heads, cfg.head_dim
    if shape == "rows":
        rows = [jnp.ones((n, heads, dim), jnp.float32)] * layers
        return rows, rows, np.arange(n, dtype=np.int32), np.full(n, 300, np.int32)
    return ([jnp.ones((heads, dim, n), jnp.float32)] * layers, [jnp.ones((heads, n, dim), jnp.float32)] * layers,
            jnp.int32(3), jnp.int32(200))


def write_of(form: str, shape: str):
    """The jitted write of a form and shape, as (caches, rows...) -> caches."""
    if form == "native":
        return lambda k, v, *rows: kv_writes._write_native(k, v, *rows, chunk=shape == "chunk")
    return kv_writes._write_rows_xla if shape == "rows" else kv_writes._write_chunk_xla


def held_mb(form: str) -> float:
    """In a process of its own: what the compiled writes of every shape of `form` hold
    (RSS after malloc_trim with them, less before them)."""
    cfg, kv = caches()
    kv = write_of(form, "rows")(*kv, *new_rows(cfg, "rows", 3))  # the compiler's first use, counted in no shape
    jax.block_until_ready(kv)
    before = resident_mb()
    compiled = []
    for shape, sizes in (("rows", ROWS), ("chunk", CHUNKS)):
        for n in sizes:
            args = new_rows(cfg, shape, n)
            if form == "native":
                compiled.append(kv_writes._write_native.lower(*kv, *args, chunk=shape == "chunk").compile())
            else:
                compiled.append(write_of(form, shape).lower(*kv, *args).compile())
    return resident_mb() - before


def caches():
    model = load_model()
    return model.config, init_kv(model.config, KVGeometry(n_slots=16, max_context=768, chunk=256), model.kv_dtype)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--child", choices=("native", "xla"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not native.available():
        print("the native kernels were not built here", file=sys.stderr)
        return 1
    jax.config.update("jax_enable_compilation_cache", False)
    if args.child:
        print(json.dumps(held_mb(args.child)))
        return 0
    memory = {form: json.loads(subprocess.run([sys.executable, __file__, "--child", form], check=True,
                                              capture_output=True, text=True).stdout)
              for form in ("native", "xla")}
    cfg, kv = caches()

    best = {(form, name): float("inf") for form in ("native", "xla") for name, _ in TIMED}
    for _ in range(args.rounds):
        for form in ("native", "xla"):
            for name, n in TIMED:
                shape = name.split()[0]
                write, rows = write_of(form, shape), new_rows(cfg, shape, n)
                kv = write(*kv, *rows)  # compiled by now
                jax.block_until_ready(kv)
                started = time.perf_counter()
                for _ in range(CALLS[n]):
                    kv = write(*kv, *rows)
                jax.block_until_ready(kv)
                best[form, name] = min(best[form, name], (time.perf_counter() - started) / CALLS[n])
    us = {form: {name: best[form, name] * 1e6 for name, _ in TIMED} for form in ("native", "xla")}
    print(json.dumps({"held_mb": memory, "us": us}, indent=1))
    print(f"\n{'':8}{'held MB':>9}" + "".join(f"{name + ' µs':>16}" for name, _ in TIMED))
    for form in ("native", "xla"):
        print(f"{form:8}{memory[form]:>9.1f}" + "".join(f"{us[form][name]:>16.1f}" for name, _ in TIMED))
    return 0


if __name__ == "__main__":
    sys.exit(main())
