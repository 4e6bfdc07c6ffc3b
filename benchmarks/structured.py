"""Decode speed with and without a JSON-schema constraint, side by side in one run: the
default model, 1 and 16 streams at once, each answer `--tokens` long.

    .venv/bin/python benchmarks/structured.py [--tokens 64] [--rounds 3]

Every answer runs to its length, with no bias to make it: the model's greedy answer to
the prompt is longer than 200 tokens, and the schema asks for more array items than fit
(the grammar allows no end-of-turn token before them). A constrained row's next bitmask
needs the token before it: the step ahead of the one the engine reads computes its
logits, and samples in a second call once the host has the mask; the table shows what
that and the masks cost. Also reports the host's mask time per token (llguidance,
measured over the constrained answers' own tokens).

Prints JSON, then a table: tokens/s (all streams together, best round) and the ratio.
"""

from __future__ import annotations

import argparse
import json
import time

SCHEMA = {"type": "object", "required": ["notes"], "additionalProperties": False,
          "properties": {"notes": {"type": "array", "minItems": 1000, "items": {"type": "string", "maxLength": 40}}}}
PROMPT = [{"role": "user", "content": "Write notes about the sea, as JSON."}]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)

    import trio

    from motet.engines.engine import Engine
    from motet.model import load_model
    from motet.runtime.api import Grammar

    model = load_model()
    grammar = Grammar("json_schema", json.dumps(SCHEMA))

    async def batch(engine, streams: int, constrained: bool) -> tuple[float, list]:
        answers = [None] * streams

        async def one(i: int):
            answers[i] = await engine.chat(PROMPT, max_tokens=args.tokens, grammar=grammar if constrained else None)

        started = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for i in range(streams):
                nursery.start_soon(one, i)
        elapsed = time.perf_counter() - started
        assert all(a.stats.finish_reason == "length" for a in answers)
        return sum(a.stats.emitted_tokens for a in answers) / elapsed, answers

    async def run() -> dict:
        results: dict = {}
        async with Engine(model, kv_slots=16, max_context=512, prefill_chunk=64) as engine:
            for streams in (1, 16):
                for constrained in (False, True):
                    results[f"{streams}:{constrained}"] = 0.0
                for _ in range(args.rounds):  # the forms alternate, round by round
                    for constrained in (False, True):
                        rate, answers = await batch(engine, streams, constrained)
                        key = f"{streams}:{constrained}"
                        results[key] = max(results[key], rate)
                        if constrained:
                            last_constrained = answers
        results["mask_ms_per_token"] = mask_ms(model, grammar, [a.token_ids for a in last_constrained])
        return results

    results = trio.run(run)
    rows = [{"streams": s, "free_tok_s": results[f"{s}:False"], "constrained_tok_s": results[f"{s}:True"],
             "ratio": results[f"{s}:True"] / results[f"{s}:False"]} for s in (1, 16)]
    print(json.dumps({"tokens": args.tokens, "rounds": args.rounds, "rows": rows,
                      "mask_ms_per_token": results["mask_ms_per_token"]}, indent=1))
    print(f"\n{'streams':>8} {'free tok/s':>11} {'json schema tok/s':>18} {'ratio':>6}")
    for r in rows:
        print(f"{r['streams']:>8} {r['free_tok_s']:>11.1f} {r['constrained_tok_s']:>18.1f} {r['ratio']:>6.2f}")
    print(f"mask time per token (host): {results['mask_ms_per_token']:.3f} ms")
    return 0


def mask_ms(model, grammar, answers) -> float:
    """The host's time for one token's bitmask, replaying each answer through a matcher."""
    total, count = 0.0, 0
    for ids in answers:
        constraint = model.grammars.compile(grammar)
        for token in ids:
            started = time.perf_counter()
            constraint.allowed()
            total += time.perf_counter() - started
            count += 1
            constraint.accept(token)
    return 1e3 * total / max(count, 1)


if __name__ == "__main__":
    raise SystemExit(main())
