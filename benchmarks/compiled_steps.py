"""What a compiled step holds: the default model's decode steps (1, 2 and 4 rows) and
prefill chunks (16 and 256 tokens) compiled in one process, with the norms and QKV heads
as native calls and on XLA, each counted in kernels (XLA's fusions and the native
calls of its HLO) and in the resident memory the compiled executables hold (RSS after
glibc's malloc_trim, with them and after dropping them).

    .venv/bin/python benchmarks/compiled_steps.py

XLA:CPU holds memory per kernel of a compiled program (docs/performance.md), so a step
of 30 unrolled layers holds more the more kernels each layer has. No persistent
compilation cache is used: every variant compiles. Prints JSON, then a table.
"""

from __future__ import annotations

import ctypes
import gc
import json
import re
import sys
from functools import partial

import jax
import psutil

from motet.model import default_model_path, forward, load_model, native
from motet.model.kv import KVGeometry, init_kv

DECODE_ROWS = (1, 2, 4)
PREFILL_TOKENS = (16, 256)
SWITCHED = ("rms_norm", "add_rms_norm", "qkv_heads")  # forward's names for the native calls


def resident_mb() -> float:
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed memory back first: what is held, not the allocator's slack
    return psutil.Process().memory_info().rss / 2**20


def kernels(text: str) -> dict[str, int]:
    entry = text[text.index("ENTRY"):]
    return {"fusions": len(re.findall(r"= \S+ fusion\(", entry)),
            "native calls": len(re.findall(r'custom_call_target="motet_', entry))}


def compile_steps(model, k, v) -> tuple[dict, list]:
    cfg, weights = model.config, model.weights
    lowered = {f"decode {b}": forward.lower_decode(weights, k, v, b, cfg=cfg) for b in DECODE_ROWS}
    lowered |= {f"prefill {t}": forward.lower_prefill(weights, k, v, t, cfg=cfg) for t in PREFILL_TOKENS}
    compiled = {name: low.compile() for name, low in lowered.items()}
    return {name: kernels(c.as_text()) for name, c in compiled.items()}, list(compiled.values())


def variant(model, k, v, on_xla: bool) -> dict:
    originals = {name: getattr(forward, name) for name in SWITCHED}
    if on_xla:
        for name, fn in originals.items():
            setattr(forward, name, partial(fn, use_native=False))
    try:
        jax.clear_caches()
        before = resident_mb()
        counts, executables = compile_steps(model, k, v)
        held = resident_mb()
        del executables
        jax.clear_caches()
        gc.collect()
        after = resident_mb()
    finally:
        for name, fn in originals.items():
            setattr(forward, name, fn)
    return {"kernels": counts, "held_mb": held - before, "left_after_dropping_mb": after - before}


def main() -> int:
    if not native.available():
        print("the native kernels were not built here: nothing to compare", file=sys.stderr)
        return 2
    model = load_model(default_model_path())
    k, v = init_kv(model.config, KVGeometry(n_slots=16, max_context=768, chunk=256), model.kv_dtype)
    variant(model, k, v, on_xla=False)  # the first compiles in a process also grow XLA's own state
    result = {"native norms and heads": variant(model, k, v, on_xla=False),
              "norms and heads on XLA": variant(model, k, v, on_xla=True)}
    print(json.dumps(result, indent=1))
    steps = list(next(iter(result.values()))["kernels"])
    print(f"\n{'fusions / native calls':<26}" + "".join(f"{s:>14}" for s in steps) + f"{'held MB':>10}")
    for name, r in result.items():
        cells = "".join(f"{r['kernels'][s]['fusions']:>8} / {r['kernels'][s]['native calls']:<3}" for s in steps)
        print(f"{name:<26}{cells}{r['held_mb']:>10.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
