"""The quantized matrix products side by side, on the default model's shapes: one token
(or a batch, or a prefill chunk) through a SmolLM2-shaped stack of 30 layers (576→960,
576→576, 576→3072 and 1536→576, the products a layer runs) plus the 576×49152 head.

    .venv/bin/python benchmarks/qmatmul.py [--rows 1,16,512] [--repeats 7]

Formulations, each jitted over the whole stack, in one process:
  float32   x @ W with float32 weights (XLA's own dot): what motet ran before
  xla-q     the XLA fallback: each Q4_1 / Q8_0 block dequantized inside the jit, then dot
  kernel    the native kernel (motet/model/kernels) through jax.ffi, on the best
            instruction set this CPU has
  kernel-avx2  the same kernel on AVX2, where the best one is AVX-512
Prints JSON, then a table of milliseconds per pass and the weight bytes each reads.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from motet.model import native
from motet.model.quant import QTensor, qmatmul

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in) of a layer's products
LAYERS, VOCAB, D = 30, 49152, 576


def random_q4(rng, n: int, k: int) -> QTensor:
    return jax.device_put(QTensor(rng.integers(0, 256, (n, k // 2), dtype=np.uint8),
                                  (rng.standard_normal((n, k // 32)) * 0.01).astype(np.float32),
                                  (rng.standard_normal((n, k // 32)) * 0.01).astype(np.float32), "q4", 32, "Q4_1"))


def random_q8(rng, n: int, k: int) -> QTensor:
    return jax.device_put(QTensor(rng.integers(-128, 128, (n, k), dtype=np.int8),
                                  (rng.standard_normal((n, k // 32)) * 0.01).astype(np.float32), None, "q8", 32, "Q8_0"))


def stack(product):
    def run(x, layers, head):
        for ws in layers:
            h = product(x, ws[0])[..., :D]
            h = product(h, ws[1])
            g = product(h, ws[2])[..., :1536]
            x = x + product(g, ws[3])
        return product(x, head)

    return jax.jit(run)


def timed(fn, args, repeats: int) -> float:
    fn(*args).block_until_ready()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(*args).block_until_ready()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,16,512")
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args(argv)
    rng = np.random.default_rng(0)
    quantized = ([[random_q4(rng, n, k) for n, k in SHAPES] for _ in range(LAYERS)], random_q8(rng, VOCAB, D))
    floats = ([[jnp.asarray(rng.standard_normal((k, n)).astype(np.float32)) for n, k in SHAPES]
               for _ in range(LAYERS)], jnp.asarray(rng.standard_normal((D, VOCAB)).astype(np.float32)))
    forms = {"float32": (stack(jnp.dot), floats),
             "xla-q": (stack(lambda x, w: qmatmul(x, w, use_native=False)), quantized)}
    isas = {}  # form -> the instruction set it runs on
    if native.available():
        kernel = stack(lambda x, w: qmatmul(x, w, use_native=True))
        forms["kernel"] = (kernel, quantized)
        isas["kernel"] = native.instruction_set()
        if isas["kernel"].startswith("avx512"):
            forms["kernel-avx2"] = (kernel, quantized)
            isas["kernel-avx2"] = "avx2"
    weight_bytes = {name: sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(w)) for name, (_, w) in forms.items()}
    results = []
    for rows in (int(r) for r in args.rows.split(",")):
        x = jnp.asarray(rng.standard_normal((rows, D)).astype(np.float32))
        for name, (fn, weights) in forms.items():
            if name in isas:
                native.select_instruction_set(isas[name])
            repeats = args.repeats if rows < 100 else max(2, args.repeats // 3)
            ms = timed(fn, (x, *weights), repeats) * 1e3
            results.append({"rows": rows, "form": name, "ms": round(ms, 2), "weight_mb": round(weight_bytes[name] / 1e6, 1)})
    if isas:
        native.select_instruction_set(isas["kernel"])
    print(json.dumps({"instruction_set": native.instruction_set(), "results": results}, indent=1))
    print(f"\nkernel instruction set: {native.instruction_set()}")
    print("| rows | " + " | ".join(forms) + " | float32 time / kernel time |")
    print("|---|" + "---|" * (len(forms) + 1))
    for rows in sorted({r["rows"] for r in results}):
        ms = {r["form"]: r["ms"] for r in results if r["rows"] == rows}
        ratio = f"{ms['float32'] / ms['kernel']:.2f}" if "kernel" in ms else "—"
        print(f"| {rows} | " + " | ".join(f"{ms[f]:.1f} ms" for f in forms) + f" | {ratio} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
