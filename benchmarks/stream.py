"""How fast a one-row product streams its weights, against what the machine reads: the
native kernel's x · W for a head-sized matrix (49152 × 576, the default model's LM head)
in Q8_0 and Q4_1, on each instruction set this CPU has, once over one matrix again and
again (it stays in the cache) and once over eight different ones in turn (they stream
from memory, as a decode step's 100 MB of weights do), beside XLA's sum of a 200 MB
float32 array (the machine's own read bandwidth, every core XLA uses).

    .venv/bin/python benchmarks/stream.py [--repeats 4]

Prints JSON, then a table of GB/s of weight bytes (scales and mins included).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import numpy as np

from motet.model import native
from motet.model.gguf_quants import REPACK
from motet.model.quant import qmatmul

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from test_quant import random_blocks  # noqa: E402  (valid blocks of any type, from random bytes)

ROWS, COLS, MATRICES = 49152, 576, 8


def best_seconds(run, repeats: int) -> float:
    run()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - started)
    return best


def product_gb_s(kind: str, repeats: int) -> dict:
    matrices = [jax.device_put(REPACK[kind](random_blocks(kind, ROWS, COLS, seed=i))) for i in range(MATRICES)]
    x = jax.device_put(np.random.default_rng(0).standard_normal((1, COLS)).astype(np.float32))
    product = jax.jit(lambda x, w: qmatmul(x, w))
    size = matrices[0].nbytes

    def over(pool):
        def run():
            for w in pool:
                product(x, w).block_until_ready()
        return size * len(pool) / best_seconds(run, repeats) / 1e9

    return {"cached": over(matrices[:1] * MATRICES), "streamed": over(matrices)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=4)
    args = parser.parse_args(argv)
    if not native.available():
        print("the native kernel was not built here", file=sys.stderr)
        return 1
    array = jax.device_put(np.ones(50_000_000, np.float32))
    total = jax.jit(lambda a: a.sum())
    reference = array.nbytes / best_seconds(lambda: total(array).block_until_ready(), args.repeats) / 1e9
    best = native.instruction_set()
    result = {"xla_sum_gb_s": reference, "kernel": {}}
    try:
        for isa in native.INSTRUCTION_SETS[:2]:
            if native.select_instruction_set(isa):
                result["kernel"][isa] = {kind: product_gb_s(kind, args.repeats) for kind in ("Q8_0", "Q4_1")}
    finally:
        native.select_instruction_set(best)
    print(json.dumps(result, indent=1))
    print(f"\nGB/s; XLA's sum of a 200 MB array: {reference:.1f}")
    print(f"{'':<16}{'cached':>10}{'streamed':>10}")
    for isa, kinds in result["kernel"].items():
        for kind, figures in kinds.items():
            print(f"{isa + ' ' + kind:<16}{figures['cached']:>10.1f}{figures['streamed']:>10.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
