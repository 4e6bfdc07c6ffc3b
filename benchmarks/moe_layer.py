"""One MoE layer's routed experts (the native kernel, kernels/moe.cc) at the row counts a
decode step and a prefill give them: 1 token (4 assignments), 16 (a 16-stream step) and
512 (a prefill). The layer is the first of a MoE GGUF file (benchmarks/peers.py's
Q4_K_M file by default: 32 experts, top-4, d = 512, expert width 512), routed by its own
router over random activations.

    .venv/bin/python benchmarks/moe_layer.py [--file moe-q4km|moe-q8|PATH] [--tokens 1,16,512] [--repeats 5]

To compare two builds of the kernel, run it under each. Prints JSON, then a table of
milliseconds a layer (best of --repeats rounds).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from motet.model import load_model
from motet.model.moe import moe_ffn


def layer_ms(cfg, layer, tokens: int, repeats: int) -> float:
    x = jnp.asarray(np.random.default_rng(tokens).standard_normal((tokens, cfg.hidden_size)), jnp.float32)
    call = jax.jit(lambda x: moe_ffn(cfg, layer, x)[0])
    call(x).block_until_ready()
    calls = max(5, 2000 // tokens)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(calls):
            out = call(x)
        out.block_until_ready()
        best = min(best, (time.perf_counter() - started) / calls)
    return best * 1e3


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--file", default="moe-q4km")
    parser.add_argument("--tokens", default="1,16,512")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    from peers import files

    model = load_model(files([args.file])[args.file])
    if not model.config.is_moe:
        parser.error(f"{args.file} is not a MoE model")
    layer = next(layer for layer in model.weights["layers"] if "router" in layer)
    ms = {t: layer_ms(model.config, layer, t, args.repeats) for t in map(int, args.tokens.split(","))}
    print(json.dumps({"file": args.file, "ms_per_layer": ms}, indent=1))
    print(f"\n{'tokens':>8} {'ms a layer':>12}")
    for tokens, value in ms.items():
        print(f"{tokens:>8} {value:>12.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
