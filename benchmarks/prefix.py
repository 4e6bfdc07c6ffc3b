"""Many conversations, one long system prompt: 32 conversations that share a 2,000-token
prefix arrive one after another against 16 KV slots, on the default model, with
cross-slot prefix sharing on and off, and sharing on over an int8 KV cache (three
engines, one after the other, in one run).

    .venv/bin/python benchmarks/prefix.py [--conversations 32] [--prefix 2000] [--gap 0.25] [--kv-budget-gb 1]

Each conversation is the shared prefix, 40 tokens of its own and a 24-token greedy
answer; conversation i is sent at i × gap seconds. Prints JSON, then a table: time to
first token (p50, p99), aggregate tokens/s (answers' tokens over the wall time), prompt
tokens prefilled and tokens copied from another slot. Then the KV cache's memory for
each element type: bytes a position, a slot of this run's context, and the longest
context each of 16 slots gets from --kv-budget-gb (computed from the model's shape).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import trio

from motet import Engine
from motet.model import default_model_path, load_model
from motet.model.kv import kv_bytes_per_position
from motet.runtime.api import FinishEvent

MODES = ((True, "auto"), (False, "auto"), (True, "int8"))  # sharing, KV dtype (auto: float16 here)


async def run_mode(share: bool, kv_dtype: str, args, prompts: list[list[int]]) -> dict:
    ttfts, stats = [], []
    async with Engine(kv_slots=16, max_context=args.prefix + 256, share_prefixes=share, kv_dtype=kv_dtype) as engine:
        started = time.perf_counter()

        async def one(i: int):
            await trio.sleep(i * args.gap)
            sent = time.perf_counter()
            first = None
            async with engine.stream(prompts[i], max_tokens=24) as events:
                async for event in events:
                    first = first or time.perf_counter()
                    if isinstance(event, FinishEvent):
                        stats.append(event.stats)
            ttfts.append(first - sent)

        async with trio.open_nursery() as nursery:
            for i in range(len(prompts)):
                nursery.start_soon(one, i)
        wall = time.perf_counter() - started
    prompt_tokens = sum(s.prompt_tokens for s in stats)
    reused = sum(s.reused_tokens for s in stats)
    return {
        "share_prefixes": share, "kv_dtype": kv_dtype,
        "ttft_p50_s": float(np.percentile(ttfts, 50)), "ttft_p99_s": float(np.percentile(ttfts, 99)),
        "tokens_per_s": sum(s.emitted_tokens for s in stats) / wall, "wall_s": wall,
        "prefilled": prompt_tokens - reused, "reused": reused, "prompt_tokens": prompt_tokens,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--conversations", type=int, default=32)
    p.add_argument("--prefix", type=int, default=2000)
    p.add_argument("--gap", type=float, default=0.25)
    p.add_argument("--kv-budget-gb", type=float, default=1.0, help="the KV memory the longest-context column divides")
    args = p.parse_args(argv)
    rng = np.random.default_rng(0)
    system = rng.integers(1000, 40000, size=args.prefix).tolist()
    prompts = [system + rng.integers(1000, 40000, size=40).tolist() for _ in range(args.conversations)]
    results = [trio.run(run_mode, share, kv_dtype, args, prompts) for share, kv_dtype in MODES]
    memory = kv_memory(args)
    print(json.dumps({"args": vars(args), "modes": results, "kv_memory": memory}))
    print(f"\n{'sharing':8} {'KV':6} {'TTFT p50 s':>11} {'TTFT p99 s':>11} {'tokens/s':>9} {'prefilled':>10} {'reused':>8}")
    for r in results:
        print(f"{'on' if r['share_prefixes'] else 'off':8} {r['kv_dtype']:6} {r['ttft_p50_s']:11.2f} "
              f"{r['ttft_p99_s']:11.2f} {r['tokens_per_s']:9.1f} {r['prefilled']:10d} {r['reused']:8d}")
    context = args.prefix + 256
    print(f"\n{'KV cache':9} {'bytes/position':>15} {f'MiB a slot of {context}':>20} "
          f"{f'16 slots in {args.kv_budget_gb:g} GiB':>18}")
    for kind, m in memory.items():
        print(f"{kind:9} {m['bytes_per_position']:>15,} {m['slot_mib']:>20.1f} {m['context_of_16_slots']:>18,}")
    return 0


def kv_memory(args) -> dict:
    """Per KV element type: bytes a position, MiB a slot of this run's context, and the
    positions each of 16 slots gets from the budget."""
    cfg = load_model(default_model_path()).config
    out = {}
    for kind in ("float32", "float16", "int8", "fp8"):
        per_position = kv_bytes_per_position(cfg, kind)
        out[kind] = {"bytes_per_position": per_position,
                     "slot_mib": per_position * (args.prefix + 256) / 2**20,
                     "context_of_16_slots": int(args.kv_budget_gb * 2**30) // (16 * per_position)}
    return out


if __name__ == "__main__":
    raise SystemExit(main())
