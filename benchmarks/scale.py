"""The same decode workload on 1, 2 and 4 devices side by side: a synthetic MoE
(qwen3_moe geometry, 64 experts, 8 per token, random weights) decoding batches of 1 and
8 rows, one subprocess per layout (the device count is fixed when JAX is imported:
XLA_FLAGS=--xla_force_host_platform_device_count=N), with the communication volume per
decode step computed from the config and the layout (model/sharding.step_traffic).

    .venv/bin/python benchmarks/scale.py [--quick] [--steps N]

Prints one JSON object, then a short table.

On virtual CPU devices the numbers show overheads only: the "devices" are threads of
one CPU sharing its cores and its memory bandwidth, and a psum is a memory copy, so a
layout cannot run faster than one device here; what the table shows is the cost of
sharding (collectives, per-device dispatch) at each batch size. On GPUs, run the same
script with real devices (set SCALE_REAL_DEVICES=1 to skip the XLA flag).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LAYOUTS = ("1", "ep=2", "tp=2", "ep=4", "ep=2,tp=2", "tp=4")
QUICK_LAYOUTS = ("1", "ep=2", "ep=4")
ROWS = (1, 8)


def config():
    from motet.model import ModelConfig

    return ModelConfig(
        arch="qwen3_moe", vocab_size=32000, hidden_size=512, n_layers=4, n_heads=8, n_kv_heads=4,
        head_dim=64, intermediate_size=0, rope_theta=1e6, rms_eps=1e-6, max_context=4096,
        tie_embeddings=False, qk_norm="head", n_experts=64, n_experts_per_tok=8,
        moe_intermediate_size=256, norm_topk_prob=True,
    )


def host_weights(cfg, seed: int = 0) -> dict:
    """Random weights in weights.py's packed layout, as host arrays."""
    import numpy as np

    rng = np.random.default_rng(seed)
    d, hd, e, f = cfg.hidden_size, cfg.head_dim, cfg.n_experts, cfg.moe_intermediate_size

    def w(*shape, scale=0.05):
        return (rng.standard_normal(shape, np.float32) * scale).astype(np.float32)

    ones = lambda n: np.ones((n,), np.float32)  # noqa: E731
    layers = [
        {
            "attn_norm": ones(d), "ffn_norm": ones(d), "q_norm": ones(hd), "k_norm": ones(hd),
            "wqkv": w(d, (cfg.n_heads + 2 * cfg.n_kv_heads) * hd), "wo": w(cfg.n_heads * hd, d),
            "router": w(d, e, scale=1.0), "experts_gate_up": w(e, d, 2 * f), "experts_down": w(e, f, d),
        }
        for _ in range(cfg.n_layers)
    ]
    return {"embed": w(cfg.vocab_size, d), "lm_head": w(d, cfg.vocab_size), "final_norm": ones(d),
            "layers": layers}


def child(layout: str, steps: int) -> dict:
    """Runs in the subprocess: decode `steps` steps per batch size on this layout."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from motet.model.generate import decode_step, model_kv_sharding
    from motet.model.kv import KVGeometry, init_kv
    from motet.model.model import Model
    from motet.model.sharding import MeshSpec, model_mesh, place_weights, step_traffic

    cfg = config()
    spec = MeshSpec() if layout == "1" else MeshSpec.parse(layout)
    host = host_weights(cfg)
    if spec.size == 1:
        weights = jax.tree_util.tree_map(jnp.asarray, host)
    else:
        weights = place_weights(host, cfg, model_mesh(spec, cfg))
    model = Model(config=cfg, weights=weights, tokenizer=None, path=Path("synthetic"), dtype="float32")
    geo = KVGeometry(n_slots=max(ROWS), max_context=256, chunk=64)
    kv = init_kv(cfg, geo, sharding=model_kv_sharding(model))
    context = 128  # decode at positions 128.. (the cache before is zeros: same work as real history)
    out = []
    for rows in ROWS:
        tokens, slots = list(range(1, rows + 1)), list(range(rows))
        t0 = time.perf_counter()
        logits, kv = decode_step(model, kv, geo, tokens, slots, [context] * rows)
        jax.block_until_ready(logits)
        compile_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        for i in range(steps):
            logits, kv = decode_step(model, kv, geo, tokens, slots, [context + 1 + i] * rows)
        np.asarray(logits)
        step_s = (time.perf_counter() - t0) / steps
        traffic = step_traffic(cfg, spec, rows)
        out.append({
            "layout": str(spec) if spec.size > 1 else "1 device", "devices": spec.size, "rows": rows,
            "step_ms": step_s * 1e3, "tokens_per_s": rows / step_s, "first_call_s": compile_s,
            "comm_bytes_per_step": traffic["total"], "psums_per_step": traffic["psums_per_step"],
        })
    return {"devices_visible": len(jax.devices()), "backend": jax.default_backend(), "runs": out}


def run_layout(layout: str, steps: int) -> dict:
    devices = 1 if layout == "1" else layout_size(layout)
    env = dict(os.environ)
    if not os.environ.get("SCALE_REAL_DEVICES"):
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}").strip()
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run([sys.executable, __file__, "--child", layout, "--steps", str(steps)],
                          env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"layout {layout} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def layout_size(layout: str) -> int:
    size = 1
    for part in layout.split(","):
        size *= int(part.split("=")[1])
    return size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK_LAYOUTS)}")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.steps)))
        return
    runs, backend = [], None
    for layout in QUICK_LAYOUTS if args.quick else LAYOUTS:
        result = run_layout(layout, args.steps)
        backend = result["backend"]
        runs += result["runs"]
    cfg = config()
    print(json.dumps({"backend": backend, "virtual_devices": not os.environ.get("SCALE_REAL_DEVICES"),
                      "model": {"layers": cfg.n_layers, "d": cfg.hidden_size, "experts": cfg.n_experts,
                                "top_k": cfg.n_experts_per_tok, "expert_width": cfg.moe_intermediate_size},
                      "steps": args.steps, "runs": runs}))
    print(f"\n{'layout':<12}{'devices':>8}{'rows':>6}{'ms/step':>10}{'tok/s':>10}{'comm KB/step':>14}{'psums':>7}")
    for r in runs:
        print(f"{r['layout']:<12}{r['devices']:>8}{r['rows']:>6}{r['step_ms']:>10.2f}{r['tokens_per_s']:>10.1f}"
              f"{r['comm_bytes_per_step'] / 1e3:>14.1f}{r['psums_per_step']:>7}")


if __name__ == "__main__":
    main()
