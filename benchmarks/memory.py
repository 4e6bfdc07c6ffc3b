"""Where an engine's memory goes: resident set size after loading the default model, once
the Engine is ready, and after one request, with and without the warm-up, each start in
a fresh process (malloc set as the motet command sets it), side by side in one run.

    .venv/bin/python benchmarks/memory.py [--kv-slots 16] [--max-context 1024] [--dtype auto] [--kv-dtype auto]

Prints JSON, then a table in MB: `now` is the RSS at that moment, `peak` the process's
high-water mark so far (ru_maxrss).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys

STAGES = ("loaded", "ready", "after_request")


def child(args) -> None:
    import os

    import psutil
    import trio

    from motet.runtime.allocator import tune_malloc

    tune_malloc(os.environ)  # as the motet command sets its process, before JAX's threads
    from motet.engines.engine import Engine
    from motet.model import load_model

    def sample() -> dict:
        return {"now_mb": psutil.Process().memory_info().rss / 2**20,
                "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}

    async def main() -> dict:
        out = {}
        model = load_model(dtype=args.dtype, kv_dtype=args.kv_dtype)
        out["loaded"] = sample()
        async with Engine(model=model, kv_slots=args.kv_slots, max_context=args.max_context,
                          prefill_chunk=256, warm_up=args.warm_up == "on") as engine:
            out["ready"] = sample()
            await engine.complete(list(range(100, 400)), max_tokens=8)
            out["after_request"] = sample()
        return out

    print(json.dumps(trio.run(main)))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kv-slots", type=int, default=16)
    p.add_argument("--max-context", type=int, default=1024)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--kv-dtype", default="auto")
    p.add_argument("--warm-up", choices=("on", "off"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.warm_up:
        child(args)
        return 0
    results = {}
    for warm_up in ("on", "off"):
        proc = subprocess.run([sys.executable, __file__, "--warm-up", warm_up, "--kv-slots", str(args.kv_slots),
                               "--max-context", str(args.max_context), "--dtype", args.dtype,
                               "--kv-dtype", args.kv_dtype],
                              capture_output=True, text=True, check=True)
        results[f"warm_up_{warm_up}"] = json.loads(proc.stdout.strip().splitlines()[-1])
    print(json.dumps({"kv_slots": args.kv_slots, "max_context": args.max_context, "dtype": args.dtype,
                      "kv_dtype": args.kv_dtype, "results": results}, indent=1))
    print(f"\n{'MB (now / peak)':<16}" + "".join(f"{stage:>22}" for stage in STAGES))
    for name, stages in results.items():
        cells = "".join(f"{stages[s]['now_mb']:>12.0f} / {stages[s]['peak_mb']:<7.0f}" for s in STAGES)
        print(f"{name:<16}{cells}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
