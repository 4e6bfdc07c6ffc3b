"""What a warm engine's executables hold: an Engine with peers.py's geometry (16 slots of
768 positions, prefill chunks of 256) is started and made ready, then each jitted
function's compiled executables are dropped in turn, and the resident set given back
after each (RSS after gc and malloc_trim) is what they held. Last, JAX's every cache.

    .venv/bin/python benchmarks/warm_memory.py [--file PATH]   (default: the default model)

Prints JSON, then a table in MB. Measures one process; the figures move by a few MB
between runs. What the warm-up lets go of itself (JAX's lowered modules) is gone by
then: `lowerings_left` says how many remain.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os

KINDS = (  # (module, function, what the table calls it)
    ("forward", "_prefill", "prefill steps"),
    ("forward", "_decode_sampled_written", "decode steps"),
    ("forward", "_decode_sampled", "decode steps, written apart"),
    ("burst", "_burst", "decode bursts"),
    ("kv_writes", "_write_native", "KV writes"),
    ("logit_history", "resample", "penalized resamplings"),
    ("kv", "_take_layer", "slot reads"),
    ("kv", "_put_layer", "slot writes"),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--file", default=None, help="a model file or folder (default: the default model)")
    args = parser.parse_args()

    from motet.runtime.allocator import tune_malloc

    tune_malloc(os.environ)  # as the motet command sets its process
    import jax
    import psutil
    import trio

    from motet.engines.engine import Engine
    from motet.model import burst, forward, kv, kv_writes, load_model, logit_history
    from motet.model.compilation import drop_lowerings

    modules = {"burst": burst, "forward": forward, "kv": kv, "kv_writes": kv_writes, "logit_history": logit_history}

    def resident() -> float:
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        return psutil.Process().memory_info().rss / 2**20

    model = load_model(args.file)
    out: dict = {"model": args.file or "default", "loaded_mb": resident()}

    async def measure() -> None:
        async with Engine(model=model, kv_slots=16, max_context=768, prefill_chunk=256):
            out["ready_mb"] = before = resident()
            out["lowerings_left"] = drop_lowerings()
            held = {}
            for module, name, what in KINDS:
                function = getattr(modules[module], name)
                count = function._cache_size()
                function.clear_cache()
                now = resident()
                held[what] = {"executables": count, "mb": before - now}
                before = now
            jax.clear_caches()
            now = resident()
            held["everything else JAX keeps"] = {"executables": None, "mb": before - now}
            out["held"] = held

    trio.run(measure)
    print(json.dumps(out, indent=2))
    print(f"\n{out['model']}: loaded {out['loaded_mb']:.0f} MB, ready {out['ready_mb']:.0f} MB")
    print(f"{'what':28} {'executables':>11} {'MB':>7}")
    for what, row in out["held"].items():
        count = "" if row["executables"] is None else row["executables"]
        print(f"{what:28} {count:>11} {row['mb']:7.1f}")


if __name__ == "__main__":
    main()
