"""What sampling adds to the default model's batched decode step, side by side in one
process: the step with the sampler as it was before penalties existed (argmax or draw
on the logits, no history, no mask), the step as the engine runs it now, and the step
followed by logit_history.resample, as a batch with 16 penalized rows runs it.

    .venv/bin/python benchmarks/sampling_step.py [--rows 16] [--rounds 8]

The forms alternate round by round (10 steps a round); prints JSON, then a table of the
median and best ms a step.
"""

from __future__ import annotations

import argparse
import json
import time
from functools import partial

import jax
import numpy as np

from motet.model import load_model
from motet.model.forward import _decode, _decode_sampled, empty_carry, greedy_sampling
from motet.model.kv import KVGeometry, init_kv
from motet.model.logit_history import empty_history, resample
from motet.model.sampling import CARRY_WIDTH, open_mask, pack_sampled, sample


@partial(jax.jit, static_argnames=("cfg",))
def _before(weights, k, v, tokens, slots, positions, cuts, carry, *, cfg):
    logits, _, _, _ = _decode(weights, k, v, tokens, slots, positions, cfg=cfg, moe_impl="auto", mesh=None)
    drawn = pack_sampled(sample(logits, *cuts, False))
    return drawn, carry.at[slots].set(drawn[:, :CARRY_WIDTH])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--rounds", type=int, default=8)
    args = p.parse_args(argv)
    model = load_model()
    cfg, rows = model.config, args.rows
    geo = KVGeometry(n_slots=16, max_context=512, chunk=64)
    k, v = init_kv(cfg, geo, model.kv_dtype)
    tokens = np.arange(1, rows + 1, dtype=np.int32)
    slots = np.arange(rows, dtype=np.int32) % geo.n_slots
    positions = np.full(rows, 100, np.int32)
    cuts = greedy_sampling(rows)
    state = {"carry": empty_carry(geo.scratch_slot + 1), "history": empty_history(geo.scratch_slot + 1, cfg.vocab_size)}
    penalties = (np.zeros(rows, np.float32), np.full(rows, 0.5, np.float32), np.ones(rows, np.float32),
                 np.ones(rows, np.bool_))
    mask = jax.device_put(open_mask(rows, cfg.vocab_size))

    def before():
        packed, state["carry"] = _before(model.weights, k, v, tokens, slots, positions, cuts, state["carry"], cfg=cfg)
        np.asarray(packed)

    def now(penalized: bool = False):
        _, _, packed, state["carry"], logits, fed = _decode_sampled(
            model.weights, k, v, tokens, slots, positions, cuts, np.bool_(False), state["carry"],
            np.zeros(rows, np.bool_), cfg=cfg, moe_impl="auto", mesh=None)
        if penalized:
            packed, state["carry"], state["history"] = resample(
                logits, fed, packed, state["carry"], state["history"], slots, cuts[:4], np.bool_(False), penalties,
                mask)
        np.asarray(packed)

    forms = {"before penalties": before, "now": now, "now + resample": partial(now, True)}
    for form in forms.values():  # compiles, and a first run
        form()
        form()
    times: dict[str, list[float]] = {name: [] for name in forms}
    for _ in range(args.rounds):
        for name, form in forms.items():
            started = time.perf_counter()
            for _ in range(10):
                form()
            times[name].append((time.perf_counter() - started) / 10 * 1e3)
    result = {name: {"median_ms": float(np.median(t)), "best_ms": min(t)} for name, t in times.items()}
    print(json.dumps({"rows": rows, "rounds": args.rounds, "forms": result}, indent=1))
    print(f"\n{'form':>18} {'median ms':>10} {'best ms':>8}")
    for name, r in result.items():
        print(f"{name:>18} {r['median_ms']:>10.2f} {r['best_ms']:>8.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
