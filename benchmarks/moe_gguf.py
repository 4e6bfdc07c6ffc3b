"""MoE GGUF files of a realistic shape, in the formats users hold (Q4_K_M and Q8_0), made
by llama.cpp's own quantizer, for benchmarks (not CI).

    .venv/bin/python benchmarks/moe_gguf.py [--cache-dir DIR] [--check]

The model is a random Qwen3-MoE ("qwen3moe" to llama.cpp): 12 layers, every one MoE, 32
experts with 4 used per token, hidden 512, expert width 512, 8 query / 4 KV heads of 64,
per-head q/k norms, an untied output head, and SmolLM2's tokenizer and chat template,
copied from the default model's GGUF. tests/gguf_fixtures.py writes the F16 source the
way llama.cpp's converter would; llama-cpp-python's llama_model_quantize (a
benchmark-only dependency) makes the quantized files, in a child process so a crash in
it is reported rather than taking the caller down. Files are built once per cache
directory and reused. --check loads each file in llama.cpp and in motet, compares their
next-token logits on a chat prompt, and lists the types llama.cpp chose per tensor group.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

import gguf
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from gguf_fixtures import write_tensors

DEFAULT_CACHE = Path.home() / ".cache" / "motet" / "bench"
SEED = 0
STD = 0.02  # matrices; norms are ones. Keeps each block's output and the logits moderate.
# Token embeddings: with 0.02 too, attention's context average (shared by every position)
# outweighs each token's own embedding, and by layer 12 positions collapse to one hidden
# state (cosine ~0.9), so a prompt routes to a handful of experts and every position has the
# same argmax. At 0.5 positions stay distinct and every layer uses all 32 experts.
EMBED_STD = 0.5

# config.json of the model, as Hugging Face's Qwen3MoeConfig spells it.
CONFIG = {
    "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"],
    "num_hidden_layers": 12, "hidden_size": 512, "intermediate_size": 1536,
    "num_experts": 32, "num_experts_per_tok": 4, "moe_intermediate_size": 512,
    "norm_topk_prob": True,  # llama.cpp renormalizes qwen3moe's top-k unconditionally
    "decoder_sparse_step": 1, "mlp_only_layers": [],
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64,
    "rope_theta": 1e6, "rms_norm_eps": 1e-6, "max_position_embeddings": 4096,
    "vocab_size": 49152, "tie_word_embeddings": False,
}
# llama-cpp-python's ftype constants, by the name of the file they make.
FTYPES = {"Q4_K_M": "LLAMA_FTYPE_MOSTLY_Q4_K_M", "Q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0"}


def shape_name(c: dict = CONFIG) -> str:
    return (f"qwen3moe-{c['num_hidden_layers']}L-{c['num_experts']}E-"
            f"top{c['num_experts_per_tok']}-d{c['hidden_size']}")


# ---- the F16 source ---------------------------------------------------------------------

def random_tensors(c: dict = CONFIG, seed: int = SEED) -> dict[str, np.ndarray]:
    """Hugging Face name -> float16 weight ([out, in]) or float32 norm (ones). Each matrix
    is drawn in float32 and halved at once, so peak memory stays near the F16 size."""
    rng = np.random.default_rng(seed)
    h, d, e, f = c["hidden_size"], c["head_dim"], c["num_experts"], c["moe_intermediate_size"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d

    def mat(rows: int, cols: int, std: float = STD) -> np.ndarray:
        return (rng.standard_normal((rows, cols), dtype=np.float32) * std).astype(np.float16)

    def ones(n: int) -> np.ndarray:
        return np.ones(n, np.float32)

    out = {"model.embed_tokens.weight": mat(c["vocab_size"], h, EMBED_STD), "model.norm.weight": ones(h),
           "lm_head.weight": mat(c["vocab_size"], h)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out |= {p + "input_layernorm.weight": ones(h), p + "post_attention_layernorm.weight": ones(h),
                p + "self_attn.q_proj.weight": mat(q, h), p + "self_attn.k_proj.weight": mat(kv, h),
                p + "self_attn.v_proj.weight": mat(kv, h), p + "self_attn.o_proj.weight": mat(h, q),
                p + "self_attn.q_norm.weight": ones(d), p + "self_attn.k_norm.weight": ones(d),
                p + "mlp.gate.weight": mat(e, h).astype(np.float32)}  # the router stays F32
        for j in range(e):
            x = f"{p}mlp.experts.{j}."
            out |= {x + "gate_proj.weight": mat(f, h), x + "up_proj.weight": mat(f, h),
                    x + "down_proj.weight": mat(h, f)}
    return out


def copy_tokenizer(source: Path):
    """A writer callback adding every tokenizer.* key of the GGUF file at source, each with
    its own value type (arrays with their element type), and a general.name."""
    fields = [f for name, f in gguf.GGUFReader(source).fields.items() if name.startswith("tokenizer.")]

    def add(writer: gguf.GGUFWriter) -> None:
        writer.add_name(f"{shape_name()} (random weights)")
        for f in fields:
            kind = f.types[0]
            sub = f.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(f.name, f.contents(), kind, sub_type=sub)

    return add


def write_f16(out: Path) -> Path:
    from motet.model.loader import default_model_path

    tmp = out.with_suffix(".tmp")
    write_tensors(tmp, CONFIG, random_tensors(), copy_tokenizer(default_model_path()))
    return tmp.replace(out)  # whole files only: a killed build leaves no half file to reuse


# ---- llama.cpp, in a child process --------------------------------------------------------

def child(task: dict) -> dict:
    import ctypes

    import llama_cpp as L

    if task["do"] == "quantize":  # llama.cpp's own log goes to stderr, shown on failure
        params = L.llama_model_quantize_default_params()
        params.ftype = getattr(L, FTYPES[task["format"]])
        rc = L.llama_model_quantize(task["src"].encode(), task["dst"].encode(), ctypes.byref(params))
        if rc != 0:
            raise RuntimeError(f"llama_model_quantize returned {rc}")
        return {}
    # "decode": the prompt, then greedy tokens; the prompt's next-token logits for comparison.
    L.llama_backend_init()
    model = L.llama_model_load_from_file(task["path"].encode(), L.llama_model_default_params())
    if not model:
        raise RuntimeError(f"llama.cpp could not load {task['path']}")
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    cp = L.llama_context_default_params()
    cp.n_ctx, cp.n_threads, cp.n_threads_batch = 512, 2, 2
    ctx = L.llama_init_from_model(model, cp)
    ids, tokens, first = list(task["ids"]), [], None
    for _ in range(task["new_tokens"]):
        held = (L.llama_token * len(ids))(*ids)  # the batch only points at it: keep it alive
        batch = L.llama_batch_get_one(held, len(ids))
        if (rc := L.llama_decode(ctx, batch)) != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        logits = np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, -1), shape=(n_vocab,)).copy()
        first = logits if first is None else first
        ids = [int(logits.argmax())]
        tokens += ids
    return {"tokens": tokens, "logits": first.tolist()}


def run_child(task: dict) -> dict:
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child"],
                          input=json.dumps(task), capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-4000:])
        raise RuntimeError(f"llama.cpp child ({task['do']}) exited with {proc.returncode}")
    return json.loads(proc.stdout.splitlines()[-1])


# ---- the files ------------------------------------------------------------------------------

def moe_files(cache_dir: Path = DEFAULT_CACHE) -> dict[str, Path]:
    """{"F16": source, "Q4_K_M": ..., "Q8_0": ...}: built where missing, else reused."""
    cache_dir = Path(cache_dir).expanduser()
    cache_dir.mkdir(parents=True, exist_ok=True)
    files = {fmt: cache_dir / f"{shape_name()}.{fmt}.gguf" for fmt in ("F16", *FTYPES)}
    if not files["F16"].exists():
        write_f16(files["F16"])
    for fmt in FTYPES:
        if not files[fmt].exists():
            tmp = files[fmt].with_suffix(".tmp")
            run_child({"do": "quantize", "format": fmt, "src": str(files["F16"]), "dst": str(tmp)})
            tmp.replace(files[fmt])
    return files


def tensor_types(path: Path) -> dict[str, dict[str, int]]:
    """Tensor group (the name without its block number) -> {GGML type: how many}."""
    groups: dict[str, Counter] = defaultdict(Counter)
    for t in gguf.GGUFReader(path).tensors:
        groups[re.sub(r"^blk\.\d+\.", "blk.N.", t.name)][t.tensor_type.name] += 1
    return {g: dict(c) for g, c in sorted(groups.items())}


def check(path: Path) -> dict:
    """motet and llama.cpp on the same chat prompt: motet's hidden-state sanity (finite,
    varied logits) and how closely the two engines' next-token logits agree."""
    from motet.model import load_model

    m = load_model(path)
    prompt = m.render_chat([{"role": "user", "content": "Write a poem about the sea."}])
    ids = m.tokenizer.encode(prompt)
    ours = np.asarray(m.logits(ids)[-1], np.float64)
    peer = run_child({"do": "decode", "path": str(path), "ids": ids, "new_tokens": 4})
    theirs = np.asarray(peer["logits"], np.float64)
    return {"prompt_tokens": len(ids), "motet_logit_std": float(ours.std()),
            "motet_finite": bool(np.isfinite(ours).all()), "llama_cpp_tokens": peer["tokens"],
            "top1_agree": int(ours.argmax()) == int(theirs.argmax()),  # random logits: near ties
            "top5_overlap": len(set(np.argsort(-ours)[:5]) & set(np.argsort(-theirs)[:5])),
            "logit_corr": float(np.corrcoef(ours, theirs)[0, 1]),
            "max_abs_diff": float(np.abs(ours - theirs).max())}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    parser.add_argument("--check", action="store_true", help="load and compare each file in both engines")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(json.load(sys.stdin))))
        return 0
    started = time.perf_counter()
    files = moe_files(args.cache_dir)
    print(f"files ready in {time.perf_counter() - started:.1f} s", file=sys.stderr)
    report = {fmt: {"path": str(p), "bytes": p.stat().st_size} for fmt, p in files.items()}
    if args.check:
        report["Q4_K_M"]["tensor_types"] = tensor_types(files["Q4_K_M"])
        for fmt in FTYPES:
            report[fmt]["check"] = check(files[fmt])
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
