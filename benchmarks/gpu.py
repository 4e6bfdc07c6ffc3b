"""motet on a GPU: the MoE file of benchmarks/moe_gguf.py's shape in bfloat16, Q8_0 and a
Q4_K_M-like mix; decode at 1 and 16 streams and a 512-token prefill, each against the
roofline of the device memory's bandwidth for the bytes a token (or a step) reads.

    python benchmarks/gpu.py [--formats bf16,q8_0,q4_k_m] [--repeats N] [--hbm-tbps 4.8]
                             [--cache-dir DIR] [--small] [--json FILE]

It runs on JAX's default backend: benchmarks/gpu.sh sets up the device machine and runs
it there; on a CPU it runs too (--small, a 2-layer model: a check of the script, not a
measure). The files are written here, not fetched and not made by llama.cpp (the device
machine reaches no network and has no llama.cpp): random weights of moe_gguf.py's shape,
the golden Qwen3-MoE checkpoint's small BPE tokenizer (tests/golden/qwen3_moe, its 512
tokens padded to the 49,152 ids of the embedding), Q8_0 from gguf-py's quantizer and the K
types from tests/kquants.py, mixed as llama.cpp's Q4_K_M mixes them (Q6_K for the output
head and, in some layers, attn_v and ffn_down; Q4_K elsewhere).

The measures are peers.py's (the same prompts and the Engine's streams): one stream's
decode tokens/s, 16 streams' aggregate, prefill tokens/s, best of --repeats after an
untimed run. The roofline fraction: bytes read per second over --hbm-tbps (the H200's
4.8 TB/s by default). One stream reads Model.info()'s decode_bytes a token (every matrix,
the k routed experts of each MoE layer, one embedding row); a step of 16 rows reads the
shared matrices once and the experts any row routes to, taken as uniform routing's
expected share, 1 - (1 - k/E)^16. KV reads are left out: at these contexts they are a few
percent of the weights.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

import gguf  # noqa: E402
import moe_gguf  # noqa: E402
import peers  # noqa: E402
from gguf_fixtures import add_tokenizer, mix, simple, write_tensors  # noqa: E402
from kquants import quantize_k  # noqa: E402

TOKENIZER_DIR = HERE.parent / "tests" / "golden" / "qwen3_moe"  # a 512-token BPE, padded to the vocab
FORMATS = ("bf16", "q8_0", "q4_k_m")
SMALL = {"num_hidden_layers": 2, "num_experts": 8}  # --small: a check of the script on a CPU


def q4_k_m(layers: int):
    """llama.cpp's Q4_K_M choice by tensor name (its use_more_bits rule for attn_v and
    ffn_down; Q6_K for the output head), quantized by tests/kquants.py."""
    def more_bits(i: int) -> bool:
        return i < layers // 8 or i >= 7 * layers // 8 or (i - layers // 8) % 3 == 2

    def pick(name: str, array: np.ndarray):
        if name == "output.weight":
            return gguf.GGMLQuantizationType.Q6_K
        if (".attn_v." in name or ".ffn_down" in name) and more_bits(int(name.split(".")[1])):
            return gguf.GGMLQuantizationType.Q6_K
        return gguf.GGMLQuantizationType.Q4_K

    return mix(pick, lambda array, kind: quantize_k(array, kind.name))


def model_file(fmt: str, config: dict, cache: Path) -> Path:
    """The file of this format and shape, written once per cache folder."""
    out = cache / f"{moe_gguf.shape_name(config)}-{fmt}.gguf"
    if out.exists():
        return out
    cache.mkdir(parents=True, exist_ok=True)
    policy = {"bf16": None, "q8_0": simple("Q8_0"), "q4_k_m": q4_k_m(config["num_hidden_layers"])}[fmt]
    started = time.perf_counter()
    tmp = out.with_suffix(".tmp")
    write_tensors(tmp, config, moe_gguf.random_tensors(config),
                  lambda w: add_tokenizer(w, TOKENIZER_DIR, config["vocab_size"]), policy)
    tmp.replace(out)  # whole files only: a killed build leaves no half file to reuse
    print(f"wrote {out.name} ({out.stat().st_size / 1e6:.0f} MB) in {time.perf_counter() - started:.0f} s",
          file=sys.stderr)
    return out


def step_bytes(model, rows: int) -> float:
    """The weight bytes one decode step of `rows` rows reads (uniform routing)."""
    cfg = model.config
    one = model.info()["decode_bytes"]
    experts = sum(leaf.nbytes for layer in model.weights["layers"] for name, leaf in layer.items()
                  if name.startswith("experts_"))
    share = cfg.n_experts_per_tok / max(cfg.n_experts, 1)
    routed = experts * share
    return one - routed + experts * (1 - (1 - share) ** rows)


def measure(fmt: str, path: Path, repeats: int, bandwidth: float) -> dict:
    import jax
    import trio

    from motet.model import load_model
    from motet.model.loader import load_chat

    started = time.perf_counter()
    model = load_model(path, dtype="bfloat16" if fmt == "bf16" else "auto")
    load_s = time.perf_counter() - started
    chat = load_chat(path)
    runs = [peers.workload(chat, run) for run in range(repeats + 1)]
    context = peers.PREFILL_PROMPT + peers.NEW_TOKENS + 64
    timed = trio.run(peers.motet_runs, model, runs, context)[1:]
    one = max(r["single"]["decode_tok_s"] for r in timed)
    many = max(r["streams"]["aggregate_decode_tok_s"] for r in timed)
    prefill = max(r["prefill"]["tok_s"] for r in timed)
    token_bytes = step_bytes(model, 1)
    streams_bytes = step_bytes(model, peers.STREAMS)
    return {
        "format": fmt, "file": path.name, "backend": jax.default_backend(), "device": str(jax.devices()[0]),
        "load_s": round(load_s, 1), "weights_gb": round(model.info().get("weight_bytes", 0) / 1e9, 3),
        "token_mb": round(token_bytes / 1e6, 2), "step16_mb": round(streams_bytes / 1e6, 2),
        "decode_1_tok_s": round(one, 1), "decode_16_tok_s": round(many, 1), "prefill_tok_s": round(prefill, 1),
        "roofline_1": round(one * token_bytes / bandwidth, 3),
        "roofline_16": round(many / peers.STREAMS * streams_bytes / bandwidth, 3),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--hbm-tbps", type=float, default=4.8, help="the roofline: device memory TB/s")
    parser.add_argument("--cache-dir", type=Path, default=moe_gguf.DEFAULT_CACHE / "gpu")
    parser.add_argument("--small", action="store_true", help="a 2-layer, 8-expert model: a check of the script")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args(argv)
    config = moe_gguf.CONFIG | (SMALL if args.small else {})
    results = []
    for fmt in args.formats.split(","):
        if fmt not in FORMATS:
            parser.error(f"formats are {', '.join(FORMATS)}, not {fmt!r}")
        results.append(measure(fmt, model_file(fmt, config, args.cache_dir), args.repeats, args.hbm_tbps * 1e12))
        print(json.dumps(results[-1]), flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1))
    print("\n| format | token MB | 1 stream tok/s | roofline | 16 streams tok/s | roofline | prefill tok/s |"
          "\n|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['format']} | {r['token_mb']} | {r['decode_1_tok_s']} | {r['roofline_1']:.1%} | "
              f"{r['decode_16_tok_s']} | {r['roofline_16']:.1%} | {r['prefill_tok_s']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
