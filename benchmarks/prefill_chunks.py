"""A 512-token prefill's chunking and its attention, on the benchmark files: the whole
prefill (`forward.prefill`) as one chunk of 512 against two of 256, alternated in this
process; and the native chunk attention alone, one layer's shape, 512 tokens without
history and 256 after 256 cached (the engine's cache type). To compare two builds of
the kernels, run it under each, in turn.

    .venv/bin/python benchmarks/prefill_chunks.py [--files default,moe-q4km] [--rounds 6]

Prints one JSON object, then a table (ms: the prefill's medians over the rounds, the
attention's best of 7 × 10 calls).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from step_parts import best_ms

from motet.model import load_model
from motet.model.attention import attend_chunk
from motet.model.forward import prefill
from motet.model.kv import KVGeometry, init_kv

TOKENS = 512


def prefill_ms(model, kv, ids: np.ndarray, chunk: int) -> float:
    started = time.perf_counter()
    out = None
    for start in range(0, len(ids), chunk):
        out = prefill(model.weights, *kv, jax.device_put(ids[start:start + chunk]), 1, start, chunk, cfg=model.config)
    jax.block_until_ready(out)
    return (time.perf_counter() - started) * 1e3


def attention_ms(model, kv) -> dict[str, float]:
    cfg, rng = model.config, np.random.default_rng(0)

    def rows(t, heads):
        return jnp.asarray(rng.standard_normal((t, heads, cfg.head_dim)).astype(np.float32))

    fresh = jax.jit(lambda q, k, v: attend_chunk(cfg, q, k, v, None, None, 0, 0))
    after = jax.jit(lambda q, k, v, kc, vc: attend_chunk(cfg, q, k, v, kc, vc, 1, TOKENS // 2))
    whole = (rows(TOKENS, cfg.n_heads), rows(TOKENS, cfg.n_kv_heads), rows(TOKENS, cfg.n_kv_heads))
    half = (rows(TOKENS // 2, cfg.n_heads), rows(TOKENS // 2, cfg.n_kv_heads), rows(TOKENS // 2, cfg.n_kv_heads))
    return {f"attention {TOKENS}, no history": best_ms(lambda: fresh(*whole), calls=10, rounds=7),
            f"attention {TOKENS // 2} after {TOKENS // 2}": best_ms(lambda: after(*half, kv[0][0], kv[1][0]), calls=10, rounds=7)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", default="default,moe-q4km")
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args(argv)
    from peers import files

    names = args.files.split(",")
    result = {}
    for name, path in files(names).items():
        model = load_model(path)
        kv = init_kv(model.config, KVGeometry(n_slots=4, max_context=2 * TOKENS, chunk=TOKENS), model.kv_dtype)
        ids = np.random.default_rng(0).integers(1, model.config.vocab_size, TOKENS).astype(np.int32)
        times: dict[int, list[float]] = {TOKENS: [], TOKENS // 2: []}
        for chunk in times:  # compiled before the rounds
            prefill_ms(model, kv, ids, chunk)
        for r in range(args.rounds):
            for chunk in (list(times) if r % 2 == 0 else list(times)[::-1]):
                times[chunk].append(prefill_ms(model, kv, ids, chunk))
        result[name] = {f"prefill as chunks of {c}": float(np.median(t)) for c, t in times.items()}
        result[name]["one chunk over two"] = result[name][f"prefill as chunks of {TOKENS}"] / result[name][
            f"prefill as chunks of {TOKENS // 2}"]
        result[name].update(attention_ms(model, kv))
    print(json.dumps(result, indent=1))
    for name, figures in result.items():
        print(f"\n{name}")
        for what, value in figures.items():
            print(f"  {what:<32}{value:9.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
