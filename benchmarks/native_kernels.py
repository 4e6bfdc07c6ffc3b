"""Each native CPU kernel against the XLA computation it replaces, inside the model's own
jitted steps, side by side in one process: a decode step of 1 and of 16 rows (300
cached positions each) and a 512-token prefill, with every kernel on, with attention
(decode and prefill) on XLA, with the MoE experts on XLA's grouped loop, and with the
norms and QKV heads on XLA; with AVX-512, also the one-row dots at 4 and at 1 weight
rows a pass (the CPU's vendor picks one for "native"); with AVX-512 VNNI, also every
kernel on plain AVX-512 (products of many rows on float panels, not integer pairs); where
the load keeps K-type scales packed (native.k_scales_packed), also the same weights with
them widened to float32, as the load leaves them elsewhere ("widened K scales"). The
variants take turns, round after round, and each reports its best round (the machine
is shared).

    .venv/bin/python benchmarks/native_kernels.py [--files default,moe-q4km] [--rounds 3]
        [--decode 1,16] [--prefill 512] [--variants native,...]

--variants native times a build's own steps alone (to compare builds, run it under each).

moe-q4km is the generated MoE of benchmarks/moe_gguf.py, made by llama.cpp's quantizer
(llama-cpp-python) on first use and cached. Prints one JSON object, then a table (ms).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from functools import partial

import jax
import numpy as np

from motet.model import forward, load_model, moe, native
from motet.model.kv import KVGeometry, init_kv
from motet.model.panels import in_rows
from motet.model.quant import QTensor, plain

POSITIONS = 300
PREFILL = 512


def on_xla(module, *names):
    """A variant with those kernels of `module` forced onto their XLA computation: a
    factory of (install, restore)."""
    def switch():
        kernels = {name: getattr(module, name) for name in names}

        def install():
            for name, kernel in kernels.items():
                setattr(module, name, partial(kernel, use_native=False))

        def restore():
            for name, kernel in kernels.items():
                setattr(module, name, kernel)

        return install, restore

    return switch


def rows_a_pass(rows: int):
    """The AVX-512 one-row dots at `rows` weight rows a pass (the CPU's vendor picks one
    otherwise: 1 on AMD, 4 elsewhere)."""
    return lambda: (lambda: native.rows_at_once(rows), lambda: native.rows_at_once(0))


def instruction_set(name: str):
    """Every kernel on the instruction set `name` (the CPU's best one otherwise)."""
    def switch():
        best = native.instruction_set()
        return (lambda: native.select_instruction_set(name), lambda: native.select_instruction_set(best))

    return switch


def has_packed_scales(leaf) -> bool:
    return isinstance(leaf, QTensor) and leaf.super_scale is not None


def widened(weights):
    """The weights with every K type's packed scales and mins widened to float32 (a
    copy of each such tensor's scales, on the device; panels, which only packed scales
    go with, back in rows)."""
    return jax.tree.map(lambda leaf: jax.device_put(plain(leaf)) if has_packed_scales(leaf) else leaf,
                        in_rows(weights), is_leaf=lambda leaf: isinstance(leaf, QTensor))


# The variants that time other weights than the loaded ones: name -> their form of them.
WEIGHTS = {"widened K scales": widened}

VARIANTS = {"native": None, "widened K scales": None,
            "xla attention": on_xla(forward, "attend_rows", "attend_chunk"),  # decode and prefill
            "xla experts": on_xla(moe, "experts_grouped"),
            # the norms, the residual add before the FFN's, the QKV heads
            "xla norms, heads": on_xla(forward, "rms_norm", "add_rms_norm", "qkv_heads"),
            "4 rows a pass": rows_a_pass(4), "1 row a pass": rows_a_pass(1),
            "plain avx512": instruction_set("avx512")}


def forget_compiled():
    for fn in (forward._decode, forward._rows_layer, forward._prefill, forward._chunk_layer):
        fn.clear_cache()


def mean_ms(call, calls: int) -> float:
    jax.block_until_ready(call())
    started = time.perf_counter()
    for _ in range(calls):
        out = call()
    jax.block_until_ready(out)
    return (time.perf_counter() - started) / calls * 1e3


def measure(model, rounds: int, variants: list[str], decode_rows=(1, 16),
            prefill=PREFILL) -> dict[str, dict[str, float]]:
    cfg, weights = model.config, model.weights
    forms = {name: WEIGHTS[name](weights) for name in variants if name in WEIGHTS}
    held = {"weights": weights}  # the steps read their weights here: a variant may swap them
    k, v = init_kv(cfg, KVGeometry(n_slots=16, max_context=1024, chunk=max(prefill, 16)))
    steps = {}
    for b in decode_rows:
        # a token of its own a row: the same token in every row sends them all to the
        # same experts, which no batch of conversations does
        tokens = (np.arange(b, dtype=np.int32) * 997 + 5) % cfg.vocab_size
        rows = tuple(jax.device_put(a) for a in (tokens, np.arange(b, dtype=np.int32),
                                                 np.full(b, POSITIONS, np.int32)))
        steps[f"decode {b}"] = (lambda rows=rows: forward.decode(held["weights"], k, v, *rows, cfg=cfg), 20)
    if prefill:
        tokens = jax.device_put(np.arange(prefill, dtype=np.int32) % 1000)
        steps[f"prefill {prefill}"] = (
            lambda: forward.prefill(held["weights"], k, v, tokens, 0, 0, prefill, cfg=cfg)[0], 2)
    best: dict[str, dict[str, float]] = {name: {} for name in variants}
    for _ in range(rounds):
        for name in variants:
            switch = VARIANTS[name]
            install, restore = switch() if switch else (lambda: None, lambda: None)
            install()
            held["weights"] = forms.get(name, weights)
            forget_compiled()
            try:
                for step, (call, calls) in steps.items():
                    ms = mean_ms(call, calls)
                    best[name][step] = min(best[name].get(step, float("inf")), ms)
            finally:
                restore()
                held["weights"] = weights
                forget_compiled()
    return best


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", default="default,moe-q4km")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--decode", default="1,16", help="rows of the decode steps timed")
    parser.add_argument("--prefill", type=int, default=PREFILL, help="tokens of the prefill timed (0: none)")
    parser.add_argument("--variants", default="", help="only these, comma-separated (default: all that apply)")
    args = parser.parse_args(argv)
    if not native.available():
        print("the native kernels were not built here: nothing to compare", file=sys.stderr)
        return 2
    from peers import files

    results = {}
    for name, path in files(args.files.split(",")).items():
        model = load_model(path)
        variants = ["native", "xla attention"] + (["xla experts"] if model.config.is_moe else [])
        isa = native.instruction_set() or ""
        variants += ["xla norms, heads"] + (["4 rows a pass", "1 row a pass"] if isa.startswith("avx512") else [])
        variants += ["plain avx512"] if isa == "avx512vnni" else []
        packed = jax.tree.leaves(model.weights, is_leaf=lambda leaf: isinstance(leaf, QTensor))
        variants += ["widened K scales"] if any(map(has_packed_scales, packed)) else []
        if args.variants:
            variants = [v for v in variants if v in args.variants.split(",")]
        results[name] = measure(model, args.rounds, variants, tuple(int(b) for b in args.decode.split(",")),
                                args.prefill)
    print(json.dumps({"isa": native.instruction_set(), "positions": POSITIONS, "rounds": args.rounds,
                      "ms": results}, indent=1))
    for name, table in results.items():
        steps = list(next(iter(table.values())))
        print(f"\n{name} (ms)" + "".join(f"{s:>14}" for s in steps))
        for variant, row in table.items():
            print(f"{variant:<18}" + "".join(f"{row[s]:14.2f}" for s in steps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
