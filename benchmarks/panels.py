"""Panels against rows, side by side in one process: a model as loaded (its Q6_K, Q5_K,
Q4_K, Q4_1 and Q4_0 matrices held as panels where the kernels are AVX2's or AVX-512
VNNI's, and its Q8_0 ones too where they are AVX-512 VNNI's: motet/model/panels.py)
against the same model with every panel put back in row order, x rounded alike in both
(`--activations`: int16, the default's 16 bits, or int8), each timed in turn, round
after round. Per round: a one-row and a 16-row decode step over 16 slots prefilled with
256 tokens each, and a 512-token prefill. Needs kernels that read panels (elsewhere
nothing is held in panels). Not part of CI.

    .venv/bin/python benchmarks/panels.py [--file moe-q4km|PATH] [--activations int16|int8] [--rounds 7]

Prints JSON, then a table of medians (ms) and the panels / rows ratio.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import jax
import numpy as np

from motet.model import generate, load_model
from motet.model.kv import KVGeometry, init_kv
from motet.model.panel_layout import PANELS
from motet.model.panels import in_rows
from motet.model.quant import QTensor

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peers import files  # noqa: E402  (the generated MoE files, built once and cached)


def timed_steps(model, kv, geo, rows: int, calls: int, first: int, rng) -> tuple[float, object]:
    vocab = model.config.vocab_size
    for i in range(calls + 2):
        if i == 2:
            started = time.perf_counter()
        tokens = rng.integers(100, vocab - 100, rows).tolist()
        logits, kv = generate.decode_step(model, kv, geo, tokens, list(range(rows)), [first + i] * rows)
        np.asarray(logits)
    return (time.perf_counter() - started) * 1e3 / calls, kv


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--file", default="moe-q4km", help="a benchmark file's name (peers.py) or a GGUF path")
    parser.add_argument("--activations", choices=("int16", "int8"), default="int16")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)
    path = Path(args.file) if Path(args.file).exists() else files([args.file])[args.file]
    panels = load_model(path, activations=args.activations)
    held = sorted({w.layout for w in jax.tree.leaves(panels.weights, is_leaf=lambda t: isinstance(t, QTensor))
                   if isinstance(w, QTensor)})
    if not set(held) & set(PANELS):
        print(f"nothing is held in panels here (layouts {held}): only the AVX2 and AVX-512 VNNI kernels read them",
              file=sys.stderr)
        return 1
    models = {"rows": replace(panels, weights=in_rows(panels.weights)), "panels": panels}
    cfg = panels.config
    geo = KVGeometry(n_slots=17, max_context=1024, chunk=512)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, cfg.vocab_size - 100, 256).tolist() for _ in range(16)]
    long_prompt = rng.integers(100, cfg.vocab_size - 100, 512).tolist()
    kvs = {}
    for name, model in models.items():
        kv = init_kv(cfg, geo, model.kv_dtype)
        for slot, prompt in enumerate(prompts):
            _, kv = generate.prefill_slot(model, kv, geo, slot, prompt, 0)
        kvs[name] = kv
    results = {name: {"1-row step": [], "16-row step": [], "512-token prefill": []} for name in models}
    for r in range(args.rounds):
        for name, model in models.items():
            for rows, calls in ((1, 40), (16, 12)):
                ms, kvs[name] = timed_steps(model, kvs[name], geo, rows, calls, 256 + r * 60, rng)
                results[name][f"{rows}-row step"].append(ms)
            logits, kvs[name] = generate.prefill_slot(model, kvs[name], geo, 16, long_prompt, 0)
            np.asarray(logits)  # the prefill's shapes compiled; the next one is timed
            started = time.perf_counter()
            logits, kvs[name] = generate.prefill_slot(model, kvs[name], geo, 16, long_prompt, 0)
            np.asarray(logits)
            results[name]["512-token prefill"].append((time.perf_counter() - started) * 1e3)
    medians = {name: {k: float(np.median(v)) for k, v in r.items()} for name, r in results.items()}
    print(json.dumps({"file": str(path), "activations": args.activations, "layouts": held, "rounds": args.rounds,
                      "ms": results,
                      "medians": medians}, indent=1))
    print(f"\n{path.name}, x {args.activations}, {args.rounds} rounds alternated (ms, medians)")
    print(f"{'':24} {'rows':>8} {'panels':>8} {'ratio':>6}")
    for what in results["rows"]:
        a, b = medians["rows"][what], medians["panels"][what]
        print(f"{what:24} {a:8.2f} {b:8.2f} {b / a:6.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
