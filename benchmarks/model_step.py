"""The bare jitted loop, no runtime around it: decode and prefill speed of the default
model and of a synthetic MoE, against the machine's memory bandwidth measured in the
same run.

    .venv/bin/python benchmarks/model_step.py [--quick] [--only default|moe]

Prints one JSON object, then a short table. Roofline: bytes of weights one decode step
must read ÷ step time, as a fraction of the read-only bandwidth measured here.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from motet.model import ModelConfig, load_model
from motet.model.generate import decode_step, prefill_slot
from motet.model.kv import KVGeometry, init_kv
from motet.model.model import Model

THREADS = 2


def memory_bandwidth(size_mb: int = 512, repeats: int = 5) -> dict:
    """Read-only and copy bandwidth in GB/s, numpy over THREADS threads (ufuncs drop the GIL)."""
    a = np.ones(size_mb * 2**20 // 4, np.float32)
    b = np.empty_like(a)
    halves = np.array_split(np.arange(a.size), THREADS)
    bounds = [(h[0], h[-1] + 1) for h in halves]
    with ThreadPoolExecutor(THREADS) as pool:
        def timed(fn):
            best = float("inf")
            for _ in range(repeats):
                t = time.perf_counter()
                list(pool.map(fn, bounds))
                best = min(best, time.perf_counter() - t)
            return best

        read = timed(lambda r: np.add.reduce(a[r[0]:r[1]]))
        copy = timed(lambda r: np.copyto(b[r[0]:r[1]], a[r[0]:r[1]]))
    return {"read_gbps": a.nbytes / read / 1e9, "copy_gbps": 2 * a.nbytes / copy / 1e9}


def synthetic_moe_config() -> ModelConfig:
    """A small model of realistic MoE geometry: 64 experts, 8 per token."""
    return ModelConfig(
        arch="qwen3_moe", vocab_size=32000, hidden_size=512, n_layers=8, n_heads=8, n_kv_heads=4,
        head_dim=64, intermediate_size=0, rope_theta=1e6, rms_eps=1e-6, max_context=4096,
        tie_embeddings=False, qk_norm="head", n_experts=64, n_experts_per_tok=8,
        moe_intermediate_size=256, norm_topk_prob=True,
    )


def random_weights(cfg: ModelConfig, seed: int = 0) -> dict:
    """Random weights in the packed layout of motet/model/weights.py."""
    rng = np.random.default_rng(seed)
    d, hd, e, f = cfg.hidden_size, cfg.head_dim, cfg.n_experts, cfg.moe_intermediate_size

    def w(*shape, scale=0.05):
        return jnp.asarray(rng.standard_normal(shape, np.float32) * scale)

    ones = lambda n: jnp.ones((n,), jnp.float32)  # noqa: E731
    layers = [
        {
            "attn_norm": ones(d), "ffn_norm": ones(d), "q_norm": ones(hd), "k_norm": ones(hd),
            "wqkv": w(d, (cfg.n_heads + 2 * cfg.n_kv_heads) * hd), "wo": w(cfg.n_heads * hd, d),
            "router": w(d, e, scale=1.0), "experts_gate_up": w(e, d, 2 * f), "experts_down": w(e, f, d),
        }
        for _ in range(cfg.n_layers)
    ]
    return {"embed": w(cfg.vocab_size, d), "lm_head": w(d, cfg.vocab_size),
            "final_norm": ones(d), "layers": layers}


def decode_weight_bytes(model: Model, rows: int) -> int:
    """Weight bytes one decode step reads (experts: at most rows·k distinct per layer)."""
    total = 0
    for name, leaf in jax.tree_util.tree_leaves_with_path(model.weights):
        key = jax.tree_util.keystr(name)
        if "'embed'" in key:
            continue  # one row per token
        if "experts_" in key:
            per_expert = leaf.nbytes // leaf.shape[0]
            total += per_expert * min(leaf.shape[0], rows * model.config.n_experts_per_tok)
        else:
            total += leaf.nbytes
    return total


def median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def bench_model(name: str, model: Model, quick: bool, read_gbps: float) -> dict:
    steps = 8 if quick else 24
    geo = KVGeometry(n_slots=16, max_context=2048, chunk=512)
    kv = init_kv(model.config, geo, model.weights["lm_head"].dtype)
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, model.config.vocab_size, 512).tolist()
    out: dict = {"model": name, "parameters": model.info()["parameters"], "compile_s": {}}

    state = {"kv": kv}

    def run_prefill():
        logits, state["kv"] = prefill_slot(model, state["kv"], geo, 0, prompt, 0)
        return logits

    t = time.perf_counter()
    jax.block_until_ready(run_prefill())
    out["compile_s"]["prefill_512"] = time.perf_counter() - t
    prefill_s = median_time(run_prefill, 3 if quick else 5)
    out["prefill_512_tok_s"] = 512 / prefill_s

    position = 300  # rows decode after a few hundred cached tokens
    out["decode"] = {}
    for rows in (1, 4, 16):
        args = ([7] * rows, list(range(rows)), [position] * rows)

        def step():
            logits, state["kv"] = decode_step(model, state["kv"], geo, *args)
            return logits

        t = time.perf_counter()
        jax.block_until_ready(step())
        out["compile_s"][f"decode_b{rows}"] = time.perf_counter() - t
        dt = median_time(step, steps)
        weight_bytes = decode_weight_bytes(model, rows)
        out["decode"][rows] = {
            "step_ms": dt * 1e3,
            "tok_s": rows / dt,
            "weight_mb_per_step": weight_bytes / 1e6,
            "weight_gbps": weight_bytes / dt / 1e9,
            "roofline_fraction": weight_bytes / dt / 1e9 / read_gbps,
        }
    out["batch16_over_batch1"] = out["decode"][16]["tok_s"] / out["decode"][1]["tok_s"]
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--only", choices=("default", "moe"), default=None)
    args = parser.parse_args(argv)
    bandwidth = memory_bandwidth()
    result = {"backend": jax.default_backend(), "devices": [str(d) for d in jax.devices()],
              "bandwidth": bandwidth, "models": []}
    if args.only in (None, "default"):
        model = load_model()
        label = "SmolLM2-135M " + ("Q4_1" if model.weight_format == "quantized" else model.weight_format)
        result["models"].append(bench_model(label, model, args.quick, bandwidth["read_gbps"]))
        del model
    if args.only in (None, "moe"):
        cfg = synthetic_moe_config()
        moe = Model(config=cfg, weights=random_weights(cfg), tokenizer=None,
                    path=Path("synthetic"), dtype="float32")
        result["models"].append(bench_model("synthetic MoE 64x top-8 f32", moe, args.quick, bandwidth["read_gbps"]))
    print(json.dumps(result, indent=1))
    print(f"\nbandwidth: read {bandwidth['read_gbps']:.1f} GB/s, copy {bandwidth['copy_gbps']:.1f} GB/s", file=sys.stdout)
    print(f"{'model':<30} {'b':>3} {'tok/s':>8} {'ms/step':>8} {'GB/s':>6} {'roofline':>8}")
    for m in result["models"]:
        for rows, d in m["decode"].items():
            print(f"{m['model']:<30} {rows:>3} {d['tok_s']:>8.1f} {d['step_ms']:>8.1f} "
                  f"{d['weight_gbps']:>6.1f} {d['roofline_fraction']:>8.0%}")
        print(f"{m['model']:<30} prefill 512: {m['prefill_512_tok_s']:.0f} tok/s; "
              f"b16/b1 = {m['batch16_over_batch1']:.1f}x; compile "
              + ", ".join(f"{k} {v:.1f}s" for k, v in m["compile_s"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
