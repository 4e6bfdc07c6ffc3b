"""Expert parallelism's two ways of reaching the experts, timed side by side on 4
virtual CPU devices: replicate-and-psum (every rank sees every token, a psum adds the
shares) against token dispatch (moe.experts_dispatched: all_to_all to the experts'
ranks and back, then an all-gather), forced one way and then the other for each batch
size, on scale.py's synthetic MoE (64 experts, 8 a token, d 512, 4 layers, float32).
What it measures sets moe.DISPATCH_MIN_TOKENS for this machine kind.

    .venv/bin/python benchmarks/ep_dispatch.py [--ep 4] [--tokens 16,64,256,512] [--calls 5]

Prints JSON, then a table. Virtual devices share one CPU's cores and memory, so a
collective is a memory copy here: this shows the compute and copies each way costs,
not an interconnect's speed: "bytes d/p" is what each way would put on a real link per
MoE layer and device (the padded pairs, there and back, and the all-gather, against the
psum).
"""

from __future__ import annotations

import os
import sys

DEVICES = 4
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           f" --xla_force_host_platform_device_count={DEVICES}").strip()

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from scale import config, host_weights  # noqa: E402

from motet.model import moe  # noqa: E402
from motet.model.forward import prefill  # noqa: E402
from motet.model.sharding import MeshSpec, model_mesh, moe_layer_traffic, place_weights  # noqa: E402


def sent_bytes(cfg, ep: int, tokens: int, itemsize: int = 4) -> float:
    """Bytes each device sends per MoE layer in experts_dispatched: the padded pairs
    there and back (all_to_all keeps (ep - 1)/ep of each buffer off the device), their
    expert ids, and its share of the tokens to every other rank (the all-gather)."""
    share = -(-tokens // ep)
    capacity = max(1, int(moe.DISPATCH_CAPACITY * share * cfg.n_experts_per_tok / ep))
    rows = (ep - 1) * capacity
    return 2 * rows * cfg.hidden_size * itemsize + rows * 4 + (ep - 1) * share * cfg.hidden_size * itemsize


def timed_prefill(weights, cfg, tokens: int, calls: int) -> float:
    """Best seconds of `calls` whole-batch prefills (after one that compiles)."""
    ids = jnp.asarray(np.arange(1, tokens + 1) % cfg.vocab_size, jnp.int32)

    def run():
        return prefill(weights, [], [], ids, 0, 0, tokens, cfg=cfg, with_history=False)[0]

    jax.block_until_ready(run())
    best = float("inf")
    for _ in range(calls):
        t0 = time.perf_counter()
        jax.block_until_ready(run())
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ep", type=int, default=DEVICES)
    parser.add_argument("--tokens", default="16,64,256,512")
    parser.add_argument("--calls", type=int, default=5)
    args = parser.parse_args(argv)
    cfg = config()
    weights = place_weights(host_weights(cfg), cfg, model_mesh(MeshSpec(ep=args.ep), cfg))
    rows = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        row = {"ep": args.ep, "tokens": tokens, "psum_bytes": moe_layer_traffic(cfg, args.ep, tokens)["psum"],
               "dispatch_bytes": sent_bytes(cfg, args.ep, tokens)}
        for way, threshold in (("psum", 1 << 30), ("dispatch", 1)):
            moe.DISPATCH_MIN_TOKENS, moe.DISPATCH_MIN_EP = {jax.default_backend(): threshold}, 2
            jax.clear_caches()  # the step reads the threshold when traced
            row[f"{way}_ms"] = round(timed_prefill(weights, cfg, tokens, args.calls) * 1e3, 2)
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(json.dumps({"model": "scale.py synthetic", "layers": cfg.n_layers, "rows": rows}))
    print(f"\n{'ep':>3} {'tokens':>7} {'psum ms':>9} {'dispatch ms':>12} {'dispatch / psum':>16} {'bytes d/p':>10}")
    for r in rows:
        print(f"{r['ep']:>3} {r['tokens']:>7} {r['psum_ms']:>9} {r['dispatch_ms']:>12} "
              f"{r['dispatch_ms'] / r['psum_ms']:>16.2f} {r['dispatch_bytes'] / r['psum_bytes']:>10.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
