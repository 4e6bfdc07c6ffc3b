"""How fast the native products stream their weights, against what the machine reads:
x · W for a head-sized matrix (49152 × 512), on AVX-512 and AVX2 where this CPU has
them (AVX-512 VNNI from 4 rows of x on and AVX2 from 7 take them as integer pairs),
once over one matrix again and again (it stays in the cache) and once over eight
different ones in turn (they stream from memory, as a decode step's 100 MB of weights
do), beside XLA's sum of a 200 MB float32 array (the machine's own read bandwidth,
every core XLA uses). The types: Q8_0 and Q4_1 (f16 scales), and Q4_K and Q6_K twice,
with their scales packed as the file has them and widened to float32 (quant.plain).
With AVX-512, one-row products are measured twice on the same matrices: four weight
rows a pass ("4 a pass"), and one ("1 a pass", what AMD's CPUs run). Where the kernels
read panels (AVX-512 VNNI's, AVX2's: panels.py), the types a load holds in panels are
measured so too ("in panels", at every count of rows), as a model's products read them.

    .venv/bin/python benchmarks/stream.py [--rows 1,4,16] [--repeats 4]

Prints JSON, then a table of microseconds a product and GB/s of weight bytes (scales and
mins included).
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
from motet.model.native import READ_PANELS
from motet.model.panel_layout import as_panels
from motet.model.panels import takes_panels
from motet.model.quant import plain, qmatmul

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from test_quant import random_blocks  # noqa: E402  (valid blocks of any type, from random bytes)

ROWS, COLS, MATRICES = 49152, 512, 8
# (label, type, scales widened to float32)
FORMS = [("Q8_0", "Q8_0", False), ("Q4_1", "Q4_1", False), ("Q4_K", "Q4_K", False),
         ("Q4_K float32 scales", "Q4_K", True), ("Q6_K", "Q6_K", False), ("Q6_K float32 scales", "Q6_K", True)]
PANEL_TYPES = ("Q8_0", "Q4_1", "Q4_K", "Q6_K")  # where the instruction set takes them in panels


def best_seconds(run, repeats: int) -> float:
    run()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - started)
    return best


def product_figures(kind: str, widened: bool, rows: int, repeats: int, passes: tuple[int, ...],
                    panels: bool = False) -> dict:
    """Per number of weight rows the AVX-512 one-row dots take a pass (`passes`, measured
    in turn on the same matrices; 0: as the CPU's vendor says), cached and streamed."""
    matrices = [REPACK[kind](random_blocks(kind, ROWS, COLS, seed=i)) for i in range(MATRICES)]
    matrices = [jax.device_put(plain(w) if widened else as_panels(w) if panels else w) for w in matrices]
    x = jax.device_put(np.random.default_rng(0).standard_normal((rows, COLS)).astype(np.float32))
    product = jax.jit(lambda x, w: qmatmul(x, w))
    size = matrices[0].nbytes

    def over(pool):
        def run():
            for w in pool:
                product(x, w).block_until_ready()
        seconds = best_seconds(run, repeats) / len(pool)
        return {"us": seconds * 1e6, "gb_s": size / seconds / 1e9}

    figures = {}
    try:
        for rows_a_pass in passes:
            native.rows_at_once(rows_a_pass)
            figures[rows_a_pass] = {"cached": over(matrices[:1] * MATRICES), "streamed": over(matrices)}
    finally:
        native.rows_at_once(0)
    return figures


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1", help="rows of x, comma-separated")
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
        for isa in ("avx512vnni", "avx512", "avx2"):
            if not native.select_instruction_set(isa):
                continue
            # avx512vnni's dots are avx512's: it differs from 4 rows on (its integer pairs)
            row_counts = [r for r in map(int, args.rows.split(",")) if isa != "avx512vnni" or r > 3]
            # AVX-512's one-row dots: 4 weight rows a pass, and 1 (AMD's choice), side by side
            passes = (4, 1) if isa == "avx512" else (0,)
            for rows in row_counts:
                for label, kind, widened in FORMS:
                    figures = product_figures(kind, widened, rows, args.repeats, passes if rows == 1 else (0,))
                    for rows_a_pass, f in figures.items():
                        name = isa + (f" {rows_a_pass} a pass" if rows_a_pass else "")
                        result["kernel"].setdefault(name, {})[f"{label}, {rows} rows"] = f
            if isa not in READ_PANELS:
                continue
            for rows in map(int, args.rows.split(",")):
                for kind in PANEL_TYPES:
                    if takes_panels(REPACK[kind](random_blocks(kind, 16, COLS)), isa):
                        f = product_figures(kind, False, rows, args.repeats, (0,), panels=True)[0]
                        result["kernel"].setdefault(isa, {})[f"{kind} in panels, {rows} rows"] = f
    finally:
        native.select_instruction_set(best)
    print(json.dumps(result, indent=1))
    print(f"\nXLA's sum of a 200 MB array: {reference:.1f} GB/s")
    print(f"{'':<46}{'cached µs':>10}{'GB/s':>7}{'streamed µs':>13}{'GB/s':>7}")
    for isa, forms in result["kernel"].items():
        for name, f in forms.items():
            print(f"{isa + ' ' + name:<46}{f['cached']['us']:>10.0f}{f['cached']['gb_s']:>7.1f}"
                  f"{f['streamed']['us']:>13.0f}{f['streamed']['gb_s']:>7.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
