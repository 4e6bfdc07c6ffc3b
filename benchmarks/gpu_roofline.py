"""The jitted decode step alone, on a model large enough for a GPU's memory bandwidth to
matter: Qwen3-30B-A3B's layer shape (d 2048, 32 query and 4 KV heads of 128, 128
experts of width 768, top-8, a 151,936-token vocabulary) with fewer layers, its weights
random and made on the device (no file: 48 layers would be 61 GB in bfloat16). Each
format (bf16; Q8_0 and Q4_K as gguf_quants.py repacks them) and each expert path of
moe.py side by side, at 1 and 16 rows, against the roofline of the device memory for
the weight bytes a step reads.

    python benchmarks/gpu_roofline.py [--layers 12] [--formats bf16,q4_k,q8_0]
        [--impls ragged,gather,grouped] [--rows 1,16] [--steps 30] [--prefill 512]
        [--prefill-impls ragged,grouped] [--hbm-tbps 4.8]
        [--small] [--json FILE]

benchmarks/gpu.py measures the Engine end to end on a real file (tokenizer, sampling,
Trio); this measures what the device does with one step, where the roofline is reached
or not. Bytes a step reads: every matrix once, the routed experts' share (uniform
routing: 1 - (1 - k/E)^rows of each expert stack), one embedding row per row; the KV
(a slot's 512 positions a row, read whole off the CPU) is left out, under 1% here. The
steps are dispatched back to back: the device's time, not the Engine's round trip. --small: a 2-layer, 16-expert, d 256
model, a check of the script on a CPU, not a measure.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

FORMATS = ("bf16", "q4_k", "q8_0")
IMPLS = ("ragged", "gather", "grouped")
CONTEXT = 128  # decode at positions 128.. (zeros before: the same work as a real history)


def config(layers: int, small: bool):
    from motet.model import ModelConfig

    if small:
        return ModelConfig(
            arch="qwen3_moe", vocab_size=4096, hidden_size=256, n_layers=2, n_heads=4, n_kv_heads=2,
            head_dim=64, intermediate_size=0, rope_theta=1e6, rms_eps=1e-6, max_context=4096,
            tie_embeddings=False, qk_norm="head", n_experts=16, n_experts_per_tok=4,
            moe_intermediate_size=256, norm_topk_prob=True)
    return ModelConfig(
        arch="qwen3_moe", vocab_size=151936, hidden_size=2048, n_layers=layers, n_heads=32, n_kv_heads=4,
        head_dim=128, intermediate_size=0, rope_theta=1e6, rms_eps=1e-6, max_context=4096,
        tie_embeddings=False, qk_norm="head", n_experts=128, n_experts_per_tok=8,
        moe_intermediate_size=768, norm_topk_prob=True)


def random_matrix(key, fmt: str, lead: tuple, n: int, k: int):
    """A weight standing for [*lead, n, k] (rows are outputs): bf16 as x @ W [*lead, k, n],
    or a QTensor in the layout the file's type repacks into (gguf_quants.py)."""
    import jax
    import jax.numpy as jnp

    from motet.model.quant import QTensor

    ka, kb, kc = jax.random.split(key, 3)
    if fmt == "bf16":
        return (jax.random.normal(ka, (*lead, k, n), jnp.float32) * 0.02).astype(jnp.bfloat16)
    blocks = (*lead, n, k // 32)
    if fmt == "q8_0":
        values = jax.random.randint(ka, (*lead, n, k), -127, 128, jnp.int8)
        return QTensor(values, jnp.full(blocks, 2e-4, jnp.float16), None, "q8", 32, "Q8_0")
    values = jax.random.bits(ka, (*lead, n, k // 2), jnp.uint8)
    sc = jax.random.randint(kb, blocks, 0, 64, jnp.uint8)
    mn = jax.random.randint(kc, blocks, 0, 64, jnp.uint8)
    supers = (*lead, n, k // 256)
    return QTensor(values, sc, mn, "q4", 32, "Q4_K", jnp.full(supers, 1e-4, jnp.float32),
                   jnp.full(supers, -1e-4, jnp.float32), 8)


def random_weights(cfg, fmt: str, seed: int = 0) -> dict:
    """weights.py's packed layout, made on the default device."""
    import jax
    import jax.numpy as jnp

    d, hd, e, f = cfg.hidden_size, cfg.head_dim, cfg.n_experts, cfg.moe_intermediate_size
    keys = iter(jax.random.split(jax.random.key(seed), 8 * cfg.n_layers + 8))
    mat = lambda lead, n, k: random_matrix(next(keys), fmt, lead, n, k)  # noqa: E731
    ones = lambda n: jnp.ones((n,), jnp.float32)  # noqa: E731
    layers = [{
        "attn_norm": ones(d), "ffn_norm": ones(d), "q_norm": ones(hd), "k_norm": ones(hd),
        "wqkv": mat((), (cfg.n_heads + 2 * cfg.n_kv_heads) * hd, d), "wo": mat((), d, cfg.n_heads * hd),
        "router": jax.random.normal(next(keys), (d, e), jnp.float32),
        "experts_gate_up": mat((e,), 2 * f, d), "experts_down": mat((e,), d, f),
    } for _ in range(cfg.n_layers)]
    embed = mat((), cfg.vocab_size, d)
    if fmt == "bf16":
        embed = embed.T  # the embedding keeps rows [vocab, d]
    return {"embed": embed, "lm_head": mat((), cfg.vocab_size, d), "final_norm": ones(d), "layers": layers}


def step_bytes(cfg, weights, rows: int) -> float:
    from motet.model.weights import decode_bytes

    one = decode_bytes(cfg, weights)
    experts = sum(leaf.nbytes for layer in weights["layers"] for name, leaf in layer.items()
                  if name.startswith("experts_"))
    share = cfg.n_experts_per_tok / cfg.n_experts
    embed_row = weights["embed"].nbytes / cfg.vocab_size
    return one - experts * share + experts * (1 - (1 - share) ** rows) + embed_row * (rows - 1)


def _timed(call, steps: int) -> dict:
    """The first call (compile) and the mean of `steps` more, dispatched back to back
    (the device's time, not a round trip's), or the error of a path XLA cannot compile."""
    import jax

    t0 = time.perf_counter()
    try:
        jax.block_until_ready(call(0))
    except (jax.errors.JaxRuntimeError, ValueError, NotImplementedError) as error:  # say so, go on
        return {"error": str(error)[:300]}
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i in range(steps):
        out = call(1 + i)
    jax.block_until_ready(out)
    return {"first_call_s": round(first, 1), "step_s": (time.perf_counter() - t0) / steps}


def _row(fmt, impl, work, cfg, made_s, timed) -> dict:
    row = {"format": fmt, "impl": impl, "work": work, "layers": cfg.n_layers, "made_s": round(made_s, 1)} | timed
    if "step_s" in row:
        row["ms"] = round(row.pop("step_s") * 1e3, 3)
    print(json.dumps(row), flush=True)
    return row


def measure(cfg, fmt: str, impls, rows_list, steps: int, bandwidth: float, prefill_tokens: int,
            prefill_impls) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from motet.model.forward import decode, prefill
    from motet.model.kv import KVGeometry, init_kv

    started = time.perf_counter()
    weights = random_weights(cfg, fmt)
    jax.block_until_ready(weights)
    made_s = time.perf_counter() - started
    kv_dtype = "bfloat16" if fmt == "bf16" else "float16"
    geo = KVGeometry(n_slots=max(rows_list), max_context=512, chunk=64)
    out = []
    for impl in impls:
        k, v = init_kv(cfg, geo, kv_dtype)
        for rows in rows_list:
            args = [jax.device_put(np.asarray(a, np.int32)) for a in
                    (np.arange(1, rows + 1), np.arange(rows), np.full(rows, CONTEXT))]

            def step(i, args=args):
                return decode(weights, k, v, *args, cfg=cfg, moe_impl=impl)[0]

            timed = _timed(step, steps)
            if "error" not in timed:
                read = step_bytes(cfg, weights, rows)
                timed |= {"tok_s": round(rows / timed["step_s"], 1), "step_gb": round(read / 1e9, 3),
                          "roofline": round(read / timed["step_s"] / bandwidth, 3)}
            out.append(_row(fmt, impl, f"decode {rows}", cfg, made_s, timed))
        if prefill_tokens and impl in prefill_impls:
            ids = jnp.arange(1, prefill_tokens + 1, dtype=jnp.int32)

            def whole(i):
                return prefill(weights, [], [], ids, 0, 0, prefill_tokens, cfg=cfg, with_history=False,
                               moe_impl=impl)

            timed = _timed(whole, max(2, steps // 5))
            if "error" not in timed:
                timed["tok_s"] = round(prefill_tokens / timed["step_s"], 1)
            out.append(_row(fmt, impl, f"prefill {prefill_tokens}", cfg, made_s, timed))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--impls", default=",".join(IMPLS))
    parser.add_argument("--rows", default="1,16")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--prefill", type=int, default=512, help="tokens of one prefill (0: none)")
    # gather copies each pair's matrices: 512 tokens x 8 would be 26 GB in bf16
    parser.add_argument("--prefill-impls", default="ragged,grouped")
    parser.add_argument("--hbm-tbps", type=float, default=4.8, help="the roofline: device memory TB/s")
    parser.add_argument("--small", action="store_true", help="a 2-layer model: a check of the script")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args(argv)
    import jax

    cfg = config(args.layers, args.small)
    rows = [int(r) for r in args.rows.split(",")]
    print(f"backend {jax.default_backend()}, {jax.devices()[0]}", file=sys.stderr)
    results = []
    for fmt in args.formats.split(","):
        if fmt not in FORMATS:
            parser.error(f"formats are {', '.join(FORMATS)}, not {fmt!r}")
        results += measure(cfg, fmt, args.impls.split(","), rows, args.steps, args.hbm_tbps * 1e12, args.prefill,
                           args.prefill_impls.split(","))
        jax.clear_caches()
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1))
    print("\n| format | expert path | work | step GB | ms | tok/s | roofline | first call s |\n"
          "|---|---|---|---|---|---|---|---|")
    for r in results:
        if "error" in r:
            print(f"| {r['format']} | {r['impl']} | {r['work']} | failed: {r['error'][:60]} |")
            continue
        roofline = f"{r['roofline']:.1%}" if "roofline" in r else ""
        print(f"| {r['format']} | {r['impl']} | {r['work']} | {r.get('step_gb', '')} | {r['ms']} | {r['tok_s']} | "
              f"{roofline} | {r['first_call_s']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
