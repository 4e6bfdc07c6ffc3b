"""One MoE layer's routed experts (the native kernel, kernels/moe.cc) at the row counts a
decode step and a prefill give them: 1 token (4 assignments), 16 (a 16-stream step) and
512 (a prefill). The layer is the first of a MoE GGUF file (benchmarks/peers.py's
Q4_K_M file by default: 32 experts, top-4, d = 512, expert width 512), routed by its own
router over random activations. The same layer called again finds its experts in the
caches; so the last figure takes one token through every MoE layer of the file in turn, a
new token each call, as a decode step reads them: its experts come from memory, and the
bytes of the experts each token was routed to over the time give the rate they were read at.

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


def cold_token(cfg, layers, repeats: int, calls: int = 20) -> dict[str, float]:
    """One token through every MoE layer (routing and experts; a small residual keeps each
    layer's input its own): ms a layer, and the routed experts' bytes a token over that."""

    def chain(x):
        for layer in layers:
            x = x + 1e-3 * moe_ffn(cfg, layer, x)[0]
        return x

    call = jax.jit(chain)
    rng = np.random.default_rng(0)
    call(jnp.zeros((1, cfg.hidden_size), jnp.float32)).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        tokens = [jnp.asarray(rng.standard_normal((1, cfg.hidden_size)), jnp.float32) for _ in range(calls)]
        started = time.perf_counter()
        for x in tokens:
            out = call(x)
        out.block_until_ready()
        best = min(best, (time.perf_counter() - started) / calls)
    routed = sum(cfg.n_experts_per_tok * (layer["experts_gate_up"].nbytes + layer["experts_down"].nbytes)
                 / layer["experts_gate_up"].shape[0] for layer in layers)
    return {"ms_per_layer": best * 1e3 / len(layers), "routed_mb": routed / 1e6, "gb_per_s": routed / best / 1e9}


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
    layers = [layer for layer in model.weights["layers"] if "router" in layer]
    ms = {t: layer_ms(model.config, layers[0], t, args.repeats) for t in map(int, args.tokens.split(","))}
    cold = cold_token(model.config, layers, args.repeats)
    print(json.dumps({"file": args.file, "ms_per_layer": ms, "one_token_every_layer": cold}, indent=1))
    print(f"\n{'tokens':>8} {'ms a layer':>12}")
    for tokens, value in ms.items():
        print(f"{tokens:>8} {value:>12.3f}")
    print(f"{'1, cold':>8} {cold['ms_per_layer']:>12.3f}   ({cold['routed_mb']:.2f} MB of routed experts a token, "
          f"{cold['gb_per_s']:.1f} GB/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
