"""Where a jitted step's time goes: JAX's profiler traces a few decode steps (1 row, and
16 rows of 16 slots, at 300 cached positions in a cache of the engine's type) and
512-token prefills, and this sums the trace's events by kind: the native kernels' calls
(ffi_call) against XLA's own fused ops. The 16 rows feed 16 different tokens: rows fed
alike are routed alike, and their step reads a few experts from the cache where the
engine's reads most of them (24.5 against 31 ms a step on a Zen 4 EPYC, the MoE file).

    .venv/bin/python benchmarks/profile_step.py [--file default|moe-q4km|PATH] [--calls 5]

Prints one JSON object, then a table (ms per step: the whole step by the clock, its parts
from the trace, to which the profiler adds a little).
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import jax
import numpy as np

from motet.model import load_model
from motet.model.forward import _decode, _prefill, decode, prefill
from motet.model.kv import KVGeometry, init_kv


def native_targets(hlo: str) -> dict[str, str]:
    """The compiled module's native calls: instruction name -> custom-call target."""
    return {m.group(1): m.group(2) for m in re.finditer(r'%?([\w.-]+) = [^\n]*custom_call_target="(\w+)"', hlo)}


def traced_ms(call, calls: int, hlo: str = "") -> dict[str, float]:
    """ms per call of each kind of event the executor ran, from a perfetto trace; the
    native calls by target where the compiled module's text (hlo) names them. The whole
    step is timed by the clock, outside the trace: JAX 0.10's trace has no event that
    spans a step on the thread that runs it."""
    for _ in range(2):
        jax.block_until_ready(call())
    started = time.perf_counter()
    for _ in range(calls):
        jax.block_until_ready(call())
    step_ms = (time.perf_counter() - started) / calls * 1e3
    with tempfile.TemporaryDirectory() as folder:
        with jax.profiler.trace(folder, create_perfetto_trace=True):
            for _ in range(calls):
                jax.block_until_ready(call())
        trace = next(Path(folder).rglob("*perfetto_trace.json.gz"))
        events = json.load(gzip.open(trace))
    events = events["traceEvents"] if isinstance(events, dict) else events
    totals: Counter = Counter()
    by_target: Counter = Counter()
    targets = native_targets(hlo)
    for event in events:
        name = event.get("name", "")
        if event.get("ph") == "X" and not name.startswith(("end:", "$")):
            totals[name.split(".")[0]] += event.get("dur", 0)
            if name in targets:
                by_target[targets[name]] += event.get("dur", 0)
    native = totals.pop("ffi_call", 0)
    ops = {k: v for k, v in totals.items() if "fusion" in k or k.startswith("wrapped_") or k in ("dot", "copy")}
    top = dict(sorted(ops.items(), key=lambda kv: -kv[1])[:6])
    return {"step": step_ms, "native calls": native / calls / 1e3,
            **{f"  {k}": v / calls / 1e3 for k, v in by_target.most_common()},
            "xla ops": sum(ops.values()) / calls / 1e3, **{f"  {k}": v / calls / 1e3 for k, v in top.items()}}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--file", default="default")
    parser.add_argument("--calls", type=int, default=5)
    args = parser.parse_args(argv)
    from peers import files

    model = load_model(files([args.file])[args.file])
    cfg, weights = model.config, model.weights
    k, v = init_kv(cfg, KVGeometry(n_slots=16, max_context=1024, chunk=512), model.kv_dtype)  # the engine's cache
    tokens = jax.device_put(np.arange(512, dtype=np.int32) % 1000)
    result = {}
    for batch in (1, 16):
        fed = np.random.default_rng(0).integers(1, cfg.vocab_size, batch)
        rows = tuple(jax.device_put(np.asarray(a, np.int32)) for a in (fed, np.arange(batch), np.full(batch, 300)))
        hlo = _decode.lower(weights, k, v, *rows, cfg=cfg, moe_impl="auto", mesh=None).compile().as_text()
        result[f"decode {batch}"] = traced_ms(lambda: decode(weights, k, v, *rows, cfg=cfg), args.calls, hlo)
    prefill_hlo = _prefill.lower(weights, k, v, tokens, 0, 0, 512, cfg=cfg, with_history=True, all_logits=False,
                                 moe_impl="auto", mesh=None).compile().as_text()
    result["prefill 512"] = traced_ms(lambda: prefill(weights, k, v, tokens, 0, 0, 512, cfg=cfg)[0],
                                      max(1, args.calls // 3), prefill_hlo)
    print(json.dumps({"file": args.file, "ms": result}, indent=1))
    for name, parts in result.items():
        print(f"\n{name} (ms per step)")
        for part, ms in parts.items():
            print(f"  {part:<34}{ms:9.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
