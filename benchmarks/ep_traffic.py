"""Bytes per MoE layer per device, replicate-and-psum (motet's expert-parallel step)
against all-to-all token dispatch (with data-parallel attention), for a Qwen3-30B-A3B-
shaped model (d = 2048, 8 of 128 experts a token, bf16 activations) at ep = 2, 4, 8 and
batches of 1, 16 and 512 tokens. Computed from the config (model/sharding.moe_layer_traffic),
not run: a model of what each way sends, for docs/scaling.md.

    .venv/bin/python benchmarks/ep_traffic.py

Prints JSON, then a table.
"""

from __future__ import annotations

import json

from motet.model.config import ModelConfig
from motet.model.sharding import moe_layer_traffic

EPS = (2, 4, 8)
BATCHES = (1, 16, 512)


def qwen3_30b_a3b() -> ModelConfig:
    return ModelConfig(arch="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                       n_layers=48, n_heads=32, n_kv_heads=4, head_dim=128, rope_theta=1e6, rms_eps=1e-6,
                       max_context=32768, tie_embeddings=False, qk_norm="head", n_experts=128,
                       n_experts_per_tok=8, moe_intermediate_size=768)


def main() -> int:
    cfg = qwen3_30b_a3b()
    rows = [{"ep": ep, "batch": batch, **moe_layer_traffic(cfg, ep, batch, itemsize=2)}
            for ep in EPS for batch in BATCHES]
    print(json.dumps({"config": "Qwen3-30B-A3B shape", "itemsize": 2, "rows": rows}, indent=1))
    print(f"\n{'ep':>3} {'batch':>6} {'psum KB':>10} {'dispatch KB':>12} {'dispatch / psum':>16}")
    for r in rows:
        print(f"{r['ep']:>3} {r['batch']:>6} {r['psum'] / 1e3:>10.1f} {r['dispatch'] / 1e3:>12.1f} "
              f"{r['dispatch'] / r['psum']:>16.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
