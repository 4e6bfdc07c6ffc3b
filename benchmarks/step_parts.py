"""Where a one-row decode step of the default model goes, quantized: its layer products
alone (one jitted chain), its LM head, the whole step; and the memory of the weights,
of a 16-slot KV cache and of one compiled step. Every figure is measured in this one process.

    .venv/bin/python benchmarks/step_parts.py
    XLA_FLAGS=--xla_cpu_multi_thread_eigen=false .venv/bin/python benchmarks/step_parts.py   # one thread

Prints one JSON object, then a short table (ms: the best of 5 rounds of 30 calls).
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import psutil

from motet.model import load_model
from motet.model.forward import decode, lower_decode
from motet.model.kv import KVGeometry, init_kv
from motet.model.quant import matmul


def best_ms(call, calls: int = 30, rounds: int = 5) -> float:
    jax.block_until_ready(call())
    best = float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        for _ in range(calls):
            out = call()
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - started) / calls)
    return best * 1e3


def rss_mb() -> float:
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # count what is held, not what malloc kept
    return psutil.Process().memory_info().rss / 2**20


def main() -> int:
    model = load_model()
    cfg, weights = model.config, model.weights
    q_width, ff = cfg.n_heads * cfg.head_dim, cfg.intermediate_size

    @jax.jit
    def products(weights, x):
        """Every layer's four products in sequence, each feeding the next (as in a step)."""
        for layer in weights["layers"]:
            x = x + matmul(matmul(x, layer["wqkv"])[:, :q_width], layer["wo"])
            x = x + matmul(matmul(x, layer["w_gate_up"])[:, :ff], layer["w_down"])
        return x

    head = jax.jit(lambda weights, x: matmul(x, weights["lm_head"]))
    x = jnp.ones((1, cfg.hidden_size), jnp.float32)
    geo = KVGeometry(n_slots=16, max_context=1024, chunk=256)
    k, v = init_kv(cfg, geo)
    rows = [jax.device_put(np.array([a], np.int32)) for a in (5, 0, 300)]  # token, slot, position
    layer_bytes = sum(leaf.nbytes for layer in weights["layers"] for name, leaf in layer.items()
                      if name in ("wqkv", "wo", "w_gate_up", "w_down"))
    times = {"layer_products_ms": best_ms(lambda: products(weights, x)),
             "lm_head_ms": best_ms(lambda: head(weights, x)),
             "decode_step_ms": best_ms(lambda: decode(weights, k, v, *rows, cfg=cfg))}
    before = rss_mb()
    compiled = [lower_decode(weights, k, v, b, cfg=cfg).compile() for b in (1, 2, 4)]
    per_executable = (rss_mb() - before) / len(compiled)
    result = {"xla_flags": os.environ.get("XLA_FLAGS", ""), **times,
              "layer_products_gb_s": layer_bytes / times["layer_products_ms"] / 1e6,
              "layer_product_bytes": layer_bytes, "rss_per_compiled_decode_step_mb": per_executable,
              "weights_mb": sum(leaf.nbytes for leaf in jax.tree.leaves(weights)) / 2**20,
              "kv_cache_mb": sum(a.nbytes for a in (*k, *v)) / 2**20}
    print(json.dumps(result, indent=1))
    print(f"\nlayer products ({cfg.n_layers * 4}, one chain)  {times['layer_products_ms']:6.2f} ms "
          f"({result['layer_products_gb_s']:.1f} GB/s)")
    print(f"LM head                          {times['lm_head_ms']:6.2f} ms")
    print(f"whole decode step, 1 row         {times['decode_step_ms']:6.2f} ms")
    print(f"RSS of one compiled decode step  {per_executable:6.1f} MB")
    print(f"weights {result['weights_mb']:.0f} MB, KV cache (16 slots of 1024) {result['kv_cache_mb']:.0f} MB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
