"""The model's steps over a long history: a decode step of 1 and of 16 rows, each row at
--positions cached positions of a slot of its own, and a prefill chunk of --chunk tokens
after that many, every cache position written first (a cache no conversation wrote
reads its zero page, which stays in the processor's cache and flatters a long read).
Attention's share of a step grows with the history; this shows the whole step.

    .venv/bin/python benchmarks/long_context.py [--files default,moe-q4km] [--positions 4000]
        [--chunk 256] [--rounds 5]

To compare builds, run it under each (the same files, the builds taking turns). Prints
one JSON object, then a table (ms a step, the best round of 10 steps, 3 for a prefill;
step_parts.best_ms).
"""

from __future__ import annotations

import argparse
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from step_parts import best_ms

from motet.model import load_model
from motet.model.forward import decode, prefill
from motet.model.kv import KVGeometry, init_kv


def steps(path, positions: int, chunk: int, rounds: int) -> dict[str, float]:
    model = load_model(path)
    cfg, weights = model.config, model.weights
    geo = KVGeometry(n_slots=16, max_context=positions + chunk + 1, chunk=chunk)
    k, v = jax.tree.map(lambda a: jnp.full_like(a, 0.01), init_kv(cfg, geo, model.kv_dtype))
    out = {}
    for rows in (1, 16):
        fed, slots, at = (jax.device_put(np.asarray(a, np.int32))
                          for a in (np.arange(rows) + 7, np.arange(rows), np.full(rows, positions)))
        out[f"decode {rows}"] = best_ms(lambda: decode(weights, k, v, fed, slots, at, cfg=cfg), 10, rounds)
    tokens = jax.device_put(np.arange(chunk, dtype=np.int32) % 1000 + 7)
    out[f"prefill {chunk}"] = best_ms(lambda: prefill(weights, k, v, tokens, 0, positions, chunk, cfg=cfg)[0],
                                      3, rounds)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", default="default,moe-q4km")
    parser.add_argument("--positions", type=int, default=4000)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    from peers import files

    names = args.files.split(",")
    paths = files(names)
    result = {name: steps(paths[name], args.positions, args.chunk, args.rounds) for name in names}
    print(json.dumps({"positions": args.positions, "ms": result}, indent=1))
    for name, parts in result.items():
        print(f"\n{name}, {args.positions} cached positions (ms a step)")
        for part, ms in parts.items():
            print(f"  {part:<14}{ms:9.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
