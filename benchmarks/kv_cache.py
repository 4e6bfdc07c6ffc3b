"""The KV cache's element types side by side: what an 8-bit cache (int8 or fp8, a float32
scale per position and KV head) costs in accuracy against a float one, and what it saves
in memory and in a long context's decode step. Not part of CI.

    .venv/bin/python benchmarks/kv_cache.py [--models default,qwen3_moe,PATH] [--tokens 48]

Per model (the default model as its file holds it; a tests/golden checkpoint by name,
such as the tiny Qwen3-MoE; any model file or folder by path, such as
benchmarks/moe_gguf.py's Q4_K_M file), every cache type runs the same ids: a prompt of
about 700 tokens (a chat turn holding a long text; shorter where the model's context
is), then the float32 cache's own greedy continuation, teacher-forced. The prompt is prefilled in chunks of 256 (each chunk reads the cache the
chunks before it wrote), each continuation token is one decode step, and each step's
logits are scored against the float32 cache's at the same position:
  max/median rel err  max |logit - ref| / max |ref| per position, then the max and median
  mean KL             KL(softmax(ref) || softmax(this)), nats, averaged over positions
  top-1               fraction of positions whose argmax is the reference's (the same
                      next token given the same past)
Then free-running greedy: `first diff`, the tokens each cache type generates before its
first token that differs from the float32 cache's (of --tokens).
Memory: the bytes one position takes (K and V, every layer), a slot of the model's whole
context, and the longest context each of 16 slots gets from 1 GiB. Time: one decode step
of 1 and of 16 rows over 2,000 cached positions each, best of 5 after a warm-up.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np
from activation_error import measures

KINDS = ("float32", "float16", "bfloat16", "int8", "fp8")
TEXT = ("The keeper climbed the spiral stairs each evening at dusk, trimmed the wick, polished the great "
        "lens and wound the clockwork that turned it. Ships far out at sea counted the flashes to know "
        "which light they saw and so where they were. In storms he stayed awake through the night, "
        "watching the beam sweep over the waves and listening for the horn of a ship in distress. ")
QUESTION = "Summarise the text above in three sentences, then say what the keeper feared most."
BUDGET = 1 << 30
HISTORY = 2000


def models(names: list[str]):
    from motet.model import default_model_path, load_model

    golden = Path(__file__).resolve().parent.parent / "tests" / "golden"
    for name in names:
        if name == "default":
            path = default_model_path()
        else:
            path = golden / name if (golden / name).is_dir() else Path(name).expanduser()
            name = path.name
        yield name, load_model(path)


def prompt_ids(model, room: int) -> list[int]:
    """The chat turn, its text repeated as often as `room` tokens allow (up to 9 times)."""
    for repeats in range(9, 0, -1):
        text = " ".join([TEXT] * repeats)
        ids = model.tokenizer.encode(model.render_chat([{"role": "user", "content": f"{text}\n\n{QUESTION}"}]))
        if len(ids) <= room:
            break
    return ids


def teacher_forced(model, ids: list[int], prompt: int) -> np.ndarray:
    """Logits after each of ids[prompt - 1:], the prompt prefilled, the rest decoded."""
    from motet.model.generate import decode_step, prefill_slot
    from motet.model.kv import KVGeometry, init_kv

    geo = KVGeometry(n_slots=1, max_context=len(ids) + 1, chunk=256)
    kv = init_kv(model.config, geo, model.kv_dtype)
    logits, kv = prefill_slot(model, kv, geo, 0, ids[:prompt], 0)
    out = [np.asarray(logits, np.float32)]
    for position in range(prompt, len(ids)):
        logits, kv = decode_step(model, kv, geo, [ids[position]], [0], [position])
        out.append(np.asarray(logits[0], np.float32))
    return np.stack(out[:-1])


def step_ms(model, rows: int) -> float:
    """One decode step of `rows` rows, each over HISTORY cached positions of its own slot."""
    from motet.model.generate import decode_step
    from motet.model.kv import KVGeometry, init_kv

    geo = KVGeometry(n_slots=rows, max_context=HISTORY + 64, chunk=256)
    kv = init_kv(model.config, geo, model.kv_dtype)
    args = ([1] * rows, list(range(rows)), [HISTORY] * rows)
    logits, kv = decode_step(model, kv, geo, *args)
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        logits, kv = decode_step(model, kv, geo, *args)
        np.asarray(logits)
        best = min(best, time.perf_counter() - started)
    return best * 1000


def first_difference(tokens: list[int], ref: list[int]) -> int:
    return next((i for i, (a, b) in enumerate(zip(tokens, ref)) if a != b), min(len(tokens), len(ref)))


def run_model(name: str, model, tokens: int) -> dict:
    from motet.model.generate import generate
    from motet.model.kv import kv_bytes_per_position

    prompt = prompt_ids(model, room=model.config.max_context - tokens - 2)
    of = {kind: dataclasses.replace(model, kv_dtype=kind) for kind in KINDS}
    greedy = {kind: list(generate(of[kind], prompt, max_tokens=tokens)) for kind in KINDS}
    ids = prompt + greedy["float32"]
    print(f"{name}: {len(prompt)} prompt + {len(greedy['float32'])} continuation ids", file=sys.stderr)
    logits = {kind: teacher_forced(of[kind], ids, len(prompt)) for kind in KINDS}
    cfg = model.config
    out = {}
    for kind in KINDS:
        per_position = kv_bytes_per_position(cfg, kind)
        out[kind] = {
            **measures(logits[kind], logits["float32"]),
            "greedy_first_difference": first_difference(greedy[kind], greedy["float32"]),
            "greedy_tokens": len(greedy[kind]),
            "bytes_per_position": per_position,
            "slot_mib_at_model_context": per_position * cfg.max_context / 2**20,
            "context_of_16_slots_in_1_gib": BUDGET // (16 * per_position),
            "decode_ms_1_row": step_ms(of[kind], 1),
            "decode_ms_16_rows": step_ms(of[kind], 16),
        }
        print(f"  {kind} done", file=sys.stderr)
    return {"prompt_tokens": len(prompt), "positions_scored": len(greedy["float32"]) + 1,
            "model_context": cfg.max_context, "kinds": out}


def table(name: str, result: dict) -> str:
    lines = [f"\n{name}: {result['positions_scored']} positions after a {result['prompt_tokens']}-token prompt, "
             f"against the float32 cache",
             f"{'cache':<9} {'max rel':>8} {'median':>8} {'mean KL':>9} {'top-1':>6} {'1st diff':>8} "
             f"{'B/pos':>7} {'16 slots in 1 GiB':>17} {'1 row ms':>8} {'16 rows ms':>10}"]
    for kind, m in result["kinds"].items():
        lines.append(f"{kind:<9} {m['max_rel_err']:>8.1e} {m['median_rel_err']:>8.1e} {m['mean_kl']:>9.1e} "
                     f"{m['top1_agreement']:>6.3f} {m['greedy_first_difference']:>4}/{m['greedy_tokens']:<3} "
                     f"{m['bytes_per_position']:>7,} {m['context_of_16_slots_in_1_gib']:>17,} "
                     f"{m['decode_ms_1_row']:>8.2f} {m['decode_ms_16_rows']:>10.2f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="default,qwen3_moe",
                        help="default (the embedded model), names of tests/golden checkpoints, paths")
    parser.add_argument("--tokens", type=int, default=48, help="greedy tokens generated per cache type")
    args = parser.parse_args(argv)
    results = {name: run_model(name, model, args.tokens) for name, model in models(args.models.split(","))}
    print(json.dumps(results, indent=1))
    for name, result in results.items():
        print(table(name, result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
