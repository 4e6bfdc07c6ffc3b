"""The sampler's two forms side by side in one process: the native kernel
(kernels/sample.cc) and XLA's (sampling.py), alone over the default model's vocabulary
and inside its decode step, for greedy rows and for sampled ones with each cut.

    .venv/bin/python benchmarks/sampler.py [--rounds 7]

The forms alternate round by round; prints JSON, then a table of the median ms a call.
"""

from __future__ import annotations

import argparse
import json
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from motet.model import load_model
from motet.model.forward import _decode
from motet.model.kv import KVGeometry, init_kv
from motet.model.sampling import request_key, sample

# (temperature, top_p, top_k, min_p)
SETTINGS = {
    "greedy": (0.0, 1.0, 0, 0.0),
    "temperature 0.8": (0.8, 1.0, 0, 0.0),
    "top_p 0.9": (0.8, 0.9, 0, 0.0),
    "top_k 40": (0.8, 1.0, 40, 0.0),
    "llama.cpp's defaults": (0.8, 0.95, 40, 0.05),  # its server's temperature, top_p, top_k, min_p
}
STEP_SETTINGS = ("greedy", "llama.cpp's defaults")


def cuts(rows: int, setting) -> tuple:
    t, p, k, m = setting
    return (jnp.full(rows, t, jnp.float32), jnp.full(rows, p, jnp.float32), jnp.full(rows, k, jnp.int32),
            jnp.full(rows, m, jnp.float32), jnp.stack([request_key(r) for r in range(rows)]))


@partial(jax.jit, static_argnames=("cfg", "use_native"))
def _step(weights, k, v, tokens, slots, positions, sampling, *, cfg, use_native):
    logits, _, _, _ = _decode(weights, k, v, tokens, slots, positions, cfg=cfg, moe_impl="auto", mesh=None)
    return sample(logits, *sampling, use_native=use_native)[0]


def timed(forms: dict, rounds: int, calls: int) -> dict:
    for form in forms.values():  # compiles, and a first run
        form()
        form()
    times: dict[str, list[float]] = {name: [] for name in forms}
    for _ in range(rounds):
        for name, form in forms.items():
            started = time.perf_counter()
            for _ in range(calls):
                form()
            times[name].append((time.perf_counter() - started) / calls * 1e3)
    return {name: float(np.median(t)) for name, t in times.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args(argv)
    model = load_model()
    cfg = model.config
    geo = KVGeometry(n_slots=16, max_context=512, chunk=64)
    k, v = init_kv(cfg, geo, model.kv_dtype)
    rng = np.random.default_rng(0)
    # a language model's logits: a few likely tokens over a long tail
    logits = rng.standard_normal((16, cfg.vocab_size)).astype(np.float32) * 2
    logits[:, :8] += rng.uniform(6, 12, size=(16, 8)).astype(np.float32)
    result: dict = {"vocab": cfg.vocab_size, "rounds": args.rounds, "alone": {}, "step": {}}
    for rows in (1, 16):
        x = jnp.asarray(logits[:rows])
        forms = {}
        for name, setting in SETTINGS.items():
            c = cuts(rows, setting)
            for form, flag in (("native", True), ("xla", False)):
                forms[(name, form)] = partial(lambda c, flag: np.asarray(sample(x, *c, use_native=flag)[0]), c, flag)
        result["alone"][rows] = timed(forms, args.rounds, 10)
        tokens = np.arange(1, rows + 1, dtype=np.int32)
        slots = np.arange(rows, dtype=np.int32)
        positions = np.full(rows, 100, np.int32)
        forms = {}
        for name in STEP_SETTINGS:
            c = cuts(rows, SETTINGS[name])
            for form, flag in (("native", True), ("xla", False)):
                forms[(name, form)] = partial(
                    lambda c, flag: np.asarray(_step(model.weights, k, v, tokens, slots, positions, c, cfg=cfg,
                                                     use_native=flag)), c, flag)
        result["step"][rows] = timed(forms, args.rounds, 5)
    table = {part: {rows: {f"{n} | {f}": ms for (n, f), ms in r.items()} for rows, r in by_rows.items()}
             for part, by_rows in (("alone", result["alone"]), ("step", result["step"]))}
    print(json.dumps({**result, "alone": table["alone"], "step": table["step"]}, indent=1))
    print(f"\nms a call (median of {args.rounds} rounds), vocabulary {cfg.vocab_size}")
    print(f"{'':<34} {'rows':>4} {'native':>8} {'XLA':>8} {'XLA / native':>12}")
    for part in ("alone", "step"):
        for rows, r in result[part].items():
            for name in SETTINGS if part == "alone" else STEP_SETTINGS:
                a, b = r[(name, "native")], r[(name, "xla")]
                label = f"{'sampler' if part == 'alone' else 'decode step +'} {name}"
                print(f"{label:<34} {rows:>4} {a:>8.2f} {b:>8.2f} {b / a:>12.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
