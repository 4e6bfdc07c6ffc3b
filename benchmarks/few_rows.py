"""One quantized product of a MoE expert's shape at a few to many rows of x: where the
CPU kernel hands rows from one loop to the next (the one-row dots, then the few-rows loop on
dequantized panels and the k-major loop, or, with AVX2 and VNNI, the integer pairs), which is what a MoE step's experts get at 16
streams (1-6 rows) and in a 256-token prefill chunk (about 32).

    .venv/bin/python benchmarks/few_rows.py [--rows 1,2,3,4,6,8,32,64,96,256] [--repeats 5]

Each call takes 16 different matrices of one stack (random weights in the file's own
layouts: Q4_K, Q6_K and Q8_0; benchmarks/moe_gguf.py's expert: d = 512, width 512, so
gate and up stacked are 1024 x 512), as a MoE layer's experts come, one product each:
a jitted call of its own per product timed the call's dispatch as much as the product
(one row of Q4_K: 32-42 us a call, about 21 among 16 in one). The figure is the best
of --repeats rounds, per product. To compare two builds of the kernel, run it under
each. Prints JSON, then a table of microseconds a product.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from test_quant import random_blocks  # noqa: E402  (the tests' own GGUF block maker)

from motet.model import native  # noqa: E402
from motet.model.gguf_quants import REPACK  # noqa: E402
from motet.model.quant import qmatmul, stack  # noqa: E402

MATRICES = [("Q4_K", 1024, 512), ("Q6_K", 512, 512), ("Q8_0", 1024, 512)]  # (type, out, in)
STACKED = 16  # matrices a call, each one product
CALLS = 6


@partial(jax.jit, static_argnames="count")
def products(x, stacked, count):
    """Each matrix of the stack times x; a slice of each output is summed, so every
    product is computed and little else is."""
    return sum(qmatmul(x, stacked, index=jnp.int32(i))[:, :8] for i in range(count))


def product_us(stacked, m: int, repeats: int) -> float:
    x = jnp.asarray(np.random.default_rng(m).standard_normal((m, stacked.shape[-1])), jnp.float32)
    jax.block_until_ready(products(x, stacked, STACKED))
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(CALLS):
            out = products(x, stacked, STACKED)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - started) / CALLS / STACKED * 1e6)
    return best


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,2,3,4,6,8,32,64,96,256")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",")]
    results = {}
    for kind, n, k in MATRICES:
        stacked = jax.device_put(stack([REPACK[kind](random_blocks(kind, n, k, seed=s)) for s in range(STACKED)]))
        results[f"{kind} {n}x{k}"] = {m: product_us(stacked, m, args.repeats) for m in rows}
    print(json.dumps({"isa": native.instruction_set(), "us": results}, indent=1))
    print(f"\n{'rows':<18}" + "".join(f"{m:>9}" for m in rows))
    for name, row in results.items():
        print(f"{name:<18}" + "".join(f"{row[m]:9.1f}" for m in rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
