"""n answers to one prompt on the default model, side by side in one engine: as n
choices (`engine.choices`: the prompt prefilled once, its KV copied to the other
choices' slots) and as n separate requests sent together (each prefills the prompt).

    .venv/bin/python benchmarks/choices.py [--n 4] [--prompt-tokens 600] [--max-tokens 16] [--rounds 3]

Each round takes a fresh prompt (so no slot holds it already) and runs both forms, in
alternating order. Prints JSON, then a table of the median seconds until every choice
has its first token, until all are done, and the prompt tokens prefilled.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import trio

from motet import Engine
from motet.runtime.api import FinishEvent


async def as_choices(engine, prompt, n, max_tokens, seed):
    started, firsts, finishes = time.perf_counter(), {}, []
    async with engine.choices(prompt, n, max_tokens=max_tokens, temperature=0.8, seed=seed) as choices:
        async for index, event in choices:
            firsts.setdefault(index, time.perf_counter() - started)
            if isinstance(event, FinishEvent):
                finishes.append(event.stats)
    return max(firsts.values()), time.perf_counter() - started, finishes


async def as_separate(engine, prompt, n, max_tokens, seed):
    started, firsts, finishes = time.perf_counter(), {}, []

    async def one(i):
        async with engine.stream(prompt, max_tokens=max_tokens, temperature=0.8, seed=seed + i) as events:
            async for event in events:
                firsts.setdefault(i, time.perf_counter() - started)
                if isinstance(event, FinishEvent):
                    finishes.append(event.stats)

    async with trio.open_nursery() as nursery:
        for i in range(n):
            nursery.start_soon(one, i)
    return max(firsts.values()), time.perf_counter() - started, finishes


async def run(args) -> dict:
    rng = np.random.default_rng(0)
    results: dict[str, list[dict]] = {"choices": [], "separate": []}
    async with Engine(kv_slots=2 * args.n, max_context=2048) as engine:
        vocab = engine.model.config.vocab_size
        for r in range(args.rounds + 1):  # round 0 warms the paths up, unrecorded
            order = [as_choices, as_separate] if r % 2 else [as_separate, as_choices]
            for form in order:
                prompt = rng.integers(1000, vocab, size=args.prompt_tokens).tolist()
                first_all, total, stats = await form(engine, prompt, args.n, args.max_tokens, r)
                prefilled = sum(s.prompt_tokens - s.reused_tokens for s in stats)
                if r:
                    name = "choices" if form is as_choices else "separate"
                    results[name].append({"every_first_token_s": first_all, "total_s": total, "prefilled": prefilled})
    return results


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--prompt-tokens", type=int, default=600)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    results = trio.run(run, args)
    print(json.dumps({"args": vars(args), "rounds": results}))
    print(f"\n{'form':10} {'every first token s':>20} {'all done s':>11} {'prefilled':>10}")
    for name, rounds in results.items():
        med = {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
        print(f"{name:10} {med['every_first_token_s']:20.2f} {med['total_s']:11.2f} {med['prefilled']:10.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
