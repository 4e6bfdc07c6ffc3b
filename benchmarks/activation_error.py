"""How far each engine path that quantizes activations lands from the float32 reference,
on the same GGUF and the same token ids: motet's one-row kernel (x as int16 per 32; with
AVX-512 VNNI or AVX2, its prefill's products too, as integer pairs; with --activations int8, AVX2's
products over 4-bit and six-bit weights take x as int8 per 32, a decode token's and a
prefill's) and
llama.cpp's CPU dot products (x as Q8_0/Q8_1/Q8_K), with the float-activation paths beside
them. Not part of CI.

    .venv/bin/python benchmarks/activation_error.py [--model PATH] [--tokens N] [--threads T]

The reference: load_model(path, dtype="float32"), every weight dequantized exactly (the
file's own values) and computed in float32 by XLA. The ids: a chat prompt plus the
reference's own greedy continuation, teacher-forced, so every engine is scored at the same
positions. Per path, over all positions (prompt and continuation):
  max/median rel err  max |logit - ref| / max |ref| per position, then the max and median
  mean KL             KL(softmax(ref) || softmax(engine)), nats, averaged over positions
  top-1               fraction of positions whose argmax is the reference's argmax
                      (the greedy-agreement measure: same next token given the same past)
motet's paths are also scored against motet in float32 down the same path (decode one
token at a time / one prefill), which is what tests/test_quant.py checks: that isolates
the kernel from the order a prefill and a decode sum attention in. llama.cpp runs twice:
with its defaults (what its users get: an f16 KV cache, flash attention on, which casts K
and V to f16 even from an f32 cache), and with an f32 KV cache and flash attention off, so
what is left of its error is its matrix products, i.e. its activation quantization.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import numpy as np

PROMPT = "Explain in a few paragraphs how a lighthouse works and why lighthouses were built."
# llama.cpp's settings: name -> (type_k = type_v as enum ggml_type, flash_attn_type)
LLAMA_SETTINGS = {"defaults": (1, -1), "f32 KV, no FA": (0, 0)}


# ---- motet ----------------------------------------------------------------------------

def motet_decode_logits(model, ids: list[int]) -> np.ndarray:
    """Every id through decode_step, one row per step from position 0, so every product
    is a one-row product (the first too: prefill_slot would pad it to 16 rows)."""
    from motet.model.generate import decode_step
    from motet.model.kv import KVGeometry, init_kv

    geo = KVGeometry(n_slots=1, max_context=len(ids) + 1, chunk=16)
    kv = init_kv(model.config, geo)
    out = []
    for pos, token in enumerate(ids):
        logits, kv = decode_step(model, kv, geo, [token], [0], [pos])
        out.append(np.asarray(logits[0], np.float32))
    return np.stack(out)


# ---- llama.cpp (in a child process: a build that crashes on this CPU must not take the run down)

def llama_child(workdir: Path, path: str, threads: int) -> None:
    import llama_cpp as L

    quiet = L.llama_log_callback(lambda level, text, user: None)  # keep a reference
    L.llama_log_set(quiet, ctypes.c_void_p(0))
    L.llama_backend_init()
    model = L.llama_model_load_from_file(path.encode(), L.llama_model_default_params())
    if not model:
        raise RuntimeError(f"llama.cpp could not load {path}")
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    ids = np.load(workdir / "ids.npy").tolist()
    n_batch = max(512, len(ids))  # the whole sequence in one ubatch
    batch = L.llama_batch_init(n_batch, 0, 1)

    def context(kv: int, flash: int):
        cp = L.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch = -(-len(ids) // 256) * 256, n_batch, n_batch
        cp.n_seq_max, cp.n_threads, cp.n_threads_batch, cp.no_perf = 1, threads, threads, True
        cp.type_k = cp.type_v = kv
        cp.flash_attn_type = flash
        if not (ctx := L.llama_init_from_model(model, cp)):
            raise RuntimeError("llama.cpp could not create a context")
        return ctx

    def run(ctx, rows: list[tuple[int, int]]) -> np.ndarray:
        """rows (token, position) as one llama_decode, logits for every row."""
        batch.n_tokens = len(rows)
        for i, (token, pos) in enumerate(rows):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.seq_id[i][0], batch.logits[i] = token, pos, 1, 0, True
        if (rc := L.llama_decode(ctx, batch)) != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        return np.stack([np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, i), shape=(n_vocab,)).copy()
                         for i in range(len(rows))])

    for i, (kv, flash) in enumerate(LLAMA_SETTINGS.values()):
        ctx = context(kv, flash)
        decode = np.concatenate([run(ctx, [(t, p)]) for p, t in enumerate(ids)])  # its decode path
        L.llama_memory_clear(L.llama_get_memory(ctx), True)
        np.save(workdir / f"decode{i}.npy", decode)
        np.save(workdir / f"batch{i}.npy", run(ctx, list(zip(ids, range(len(ids))))))  # its batch path
        L.llama_free(ctx)


def llama_logits(path: Path, ids: list[int], threads: int) -> list[dict[str, np.ndarray]] | None:
    """Per LLAMA_SETTINGS entry, {"decode": [T, vocab], "batch": [T, vocab]}."""
    with tempfile.TemporaryDirectory() as tmp:
        np.save(Path(tmp) / "ids.npy", np.asarray(ids, np.int32))
        proc = subprocess.run([sys.executable, __file__, "--child", tmp, "--model", str(path),
                               "--threads", str(threads)], capture_output=True, text=True)
        if proc.returncode != 0:
            sys.stderr.write(proc.stderr[-4000:])
            print(f"llama.cpp's child exited with {proc.returncode} (-4: SIGILL, a build for another CPU; "
                  "see benchmarks/peers.py install_hint)", file=sys.stderr)
            return None
        return [{name: np.load(Path(tmp) / f"{name}{i}.npy") for name in ("decode", "batch")}
                for i in range(len(LLAMA_SETTINGS))]


# ---- measures ---------------------------------------------------------------------------

def log_softmax(z: np.ndarray) -> np.ndarray:
    z = z.astype(np.float64)
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def measures(got: np.ndarray, ref: np.ndarray) -> dict:
    rel = np.abs(got - ref).max(-1) / np.abs(ref).max(-1)
    lp, lq = log_softmax(ref), log_softmax(got)
    kl = (np.exp(lp) * (lp - lq)).sum(-1)
    return {"max_rel_err": float(rel.max()), "median_rel_err": float(np.median(rel)),
            "mean_kl": float(kl.mean()), "top1_agreement": float((got.argmax(-1) == ref.argmax(-1)).mean()),
            "top1_disagree_positions": np.flatnonzero(got.argmax(-1) != ref.argmax(-1)).tolist()}


def table(title: str, rows: dict[str, dict]) -> str:
    lines = [title, f"{'':<52} {'max rel err':>11} {'median rel':>10} {'mean KL':>9} {'top-1':>7}"]
    for label, m in rows.items():
        lines.append(f"{label:<52} {m['max_rel_err']:>11.2e} {m['median_rel_err']:>10.2e} "
                     f"{m['mean_kl']:>9.2e} {m['top1_agreement']:>7.3f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="a GGUF file (default: motet's default model)")
    parser.add_argument("--tokens", type=int, default=64, help="greedy continuation of the reference")
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp threads")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        llama_child(Path(args.child), str(args.model), args.threads)
        return 0

    from motet.model import default_model_path, load_model, native
    from motet.model.generate import generate
    from motet.model.panels import in_rows

    path = args.model or default_model_path()
    ref_model, model = load_model(path, dtype="float32"), load_model(path)
    int8_model = load_model(path, activations="int8")
    prompt = model.tokenizer.encode(model.render_chat([{"role": "user", "content": PROMPT}]))
    continuation = list(generate(ref_model, prompt, max_tokens=args.tokens))
    # The last generated token is fed too: its logits are scored, nothing after it.
    ids = prompt + continuation
    print(f"{len(prompt)} prompt + {len(continuation)} continuation ids; running motet", file=sys.stderr)

    ref = ref_model.logits(ids)  # the float32 reference: one full causal forward
    ref_decode = motet_decode_logits(ref_model, ids)  # motet float32, one token at a time
    ours = {"decode": motet_decode_logits(model, ids), "prefill": model.logits(ids),
            "int8 decode": motet_decode_logits(int8_model, ids), "int8 prefill": int8_model.logits(ids)}
    # With AVX-512 VNNI or AVX2 a prefill's products take x as int16 pairs; float panels
    # (plain AVX-512's, or the baseline's) are scored beside them.
    isa = native.instruction_set()
    floats_isa = native.FLOAT_ROWS_INSTEAD.get(isa)
    pairs = floats_isa is not None
    prefill_label = f"motet prefill (x on 16 bits, integers, {isa})" if pairs else "motet prefill (float x)"
    if pairs:  # the other instruction set reads rows, not AVX2's panels
        in_rows_model = replace(model, weights=in_rows(model.weights))
        native.select_instruction_set(floats_isa)
        ours["float prefill"] = in_rows_model.logits(ids)
        native.select_instruction_set(isa)
    print("running llama.cpp", file=sys.stderr)
    peer = llama_logits(path, ids, args.threads)

    vs_ref = {"motet decode (1-row kernel, int16 x)": measures(ours["decode"], ref),
              prefill_label: measures(ours["prefill"], ref),
              f"motet decode, --activations int8 ({isa})": measures(ours["int8 decode"], ref),
              f"motet prefill, --activations int8 ({isa})": measures(ours["int8 prefill"], ref)}
    if pairs:
        vs_ref[f"motet prefill (float x, {floats_isa})"] = measures(ours["float prefill"], ref)
    for setting, logits in zip(LLAMA_SETTINGS, peer or []):
        tail = "" if setting == "defaults" else f" [{setting}]"
        vs_ref[f"llama.cpp decode (1 token per call){tail}"] = measures(logits["decode"], ref)
        vs_ref[f"llama.cpp batch ({len(ids)} tokens, 1 call){tail}"] = measures(logits["batch"], ref)
    vs_own = {"motet decode vs float32 decode": measures(ours["decode"], ref_decode),
              "motet prefill vs float32 prefill": vs_ref[prefill_label],
              "float32 decode vs float32 prefill": measures(ref_decode, ref)}
    result = {"model": str(path), "prompt_tokens": len(prompt), "continuation_tokens": len(continuation),
              "positions": len(ids), "llama_cpp_threads": args.threads,
              "llama_cpp_settings": {k: {"type_kv": v[0], "flash_attn_type": v[1]} for k, v in LLAMA_SETTINGS.items()},
              "reference": "motet, every weight dequantized to float32, one float32 causal forward",
              "against_reference": vs_ref, "against_own_float32_path": vs_own}
    print(json.dumps(result, indent=1))
    print(table(f"\n{path.name}, {len(ids)} positions, against the float32 reference", vs_ref))
    print(table("\nmotet against itself in float32, the same path", vs_own))
    return 0 if peer is not None else 3


if __name__ == "__main__":
    sys.exit(main())
