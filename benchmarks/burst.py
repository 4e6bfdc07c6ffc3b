"""One stream through the Engine with decode bursts of several sizes (model/burst.py),
side by side in one process: an engine for each size, the same request on each in
turn, round after round (the machine is shared), alternating which goes first.

    .venv/bin/python benchmarks/burst.py [--files default,moe-q4km,moe-q8] [--bursts 1,4,8]
                                         [--rounds 5] [--tokens 256]

Each round times the tokens of one greedy request (from its first token to its last, so
the prompt's prefill is left out) and the process's CPU time over it; then what a burst
costs a request that arrives while one stream decodes: the time to its first token (a
prompt of 64 tokens, sent at a random moment of the stream's decode). The engines have
peers.py's geometry (16 slots of 768, prefill chunks of 256). Prints JSON, then a table:
ms a token (median, and the range over the rounds), CPU ms a token, the median of each
round's ratio to the first size's tokens a second, and the median time to first token
of an arrival.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from contextlib import AsyncExitStack
from pathlib import Path

import numpy as np
import trio

from motet.engines.engine import Engine
from motet.model import load_model
from motet.runtime.api import TokenEvent


async def one_request(engine: Engine, prompt: list[int], tokens: int) -> dict:
    stamps = []
    cpu = time.process_time()
    async with engine.stream(prompt, max_tokens=tokens, stop_token_ids=[]) as events:
        async for event in events:
            if isinstance(event, TokenEvent):
                if not stamps:
                    cpu = time.process_time()
                stamps.append(time.perf_counter())
    steps = len(stamps) - 1
    return {"tokens": len(stamps), "ms_per_token": (stamps[-1] - stamps[0]) / steps * 1e3,
            "cpu_ms_per_token": (time.process_time() - cpu) / steps * 1e3}


async def arrival_ttft(engine: Engine, stream_prompt: list[int], prompt: list[int], delay_s: float) -> float:
    """The time to first token of `prompt`, sent `delay_s` into another stream's decode."""
    async with trio.open_nursery() as nursery:
        nursery.start_soon(one_request, engine, stream_prompt, 200)
        await trio.sleep(delay_s)
        sent = time.perf_counter()
        async with engine.stream(prompt, max_tokens=1) as events:
            async for event in events:
                if isinstance(event, TokenEvent):
                    return time.perf_counter() - sent
    raise RuntimeError("the arrival drew no token")


async def measure(model, bursts: list[int], rounds: int, tokens: int) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = {b: [] for b in bursts}
    async with AsyncExitStack() as stack:
        engines = {b: await stack.enter_async_context(Engine(model=model, kv_slots=16, max_context=768,
                                                              prefill_chunk=256, decode_burst=b)) for b in bursts}
        vocab = model.config.vocab_size
        for r in range(-1, rounds):  # round -1 warms the caches and is not kept
            prompt = [1] + [(97 * (r + 2) + 31 * i) % (vocab - 10) + 5 for i in range(40)]
            for b in (bursts if r % 2 == 0 else bursts[::-1]):
                result = await one_request(engines[b], prompt, tokens)
                arrival = [(r * 17 + i * 7) % (vocab - 10) + 5 for i in range(64)]
                delay = 0.3 + 0.2 * np.random.default_rng(r + 1).random()
                result["arrival_ttft_ms"] = await arrival_ttft(engines[b], prompt, arrival, delay) * 1e3
                if r >= 0:
                    out[b].append(result)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", default="default,moe-q4km,moe-q8", help="as benchmarks/peers.py names them")
    parser.add_argument("--bursts", default="1,4,8", help="decode_burst sizes, the first the baseline")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=256, help="max_tokens of each request")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from peers import files

    bursts = [int(b) for b in args.bursts.split(",")]
    results = {}
    for name, path in files(args.files.split(",")).items():
        model = load_model(path)
        results[name] = trio.run(measure, model, bursts, args.rounds, args.tokens)
    print(json.dumps(results, indent=1))
    print(f"\n{'file':<10} {'burst':>5} {'ms a token':>20} {'CPU ms a token':>15} {'tok/s vs first':>15} "
          f"{'arrival TTFT ms':>16}")
    for name, by_burst in results.items():
        base = [r["ms_per_token"] for r in by_burst[bursts[0]]]
        for b, runs in by_burst.items():
            ms = [r["ms_per_token"] for r in runs]
            ratio = np.median([first / mine for first, mine in zip(base, ms)])
            print(f"{name:<10} {b:>5} {np.median(ms):>7.2f} ({min(ms):.2f}-{max(ms):.2f}) "
                  f"{np.median([r['cpu_ms_per_token'] for r in runs]):>15.2f} {ratio:>14.2f}x "
                  f"{np.median([r['arrival_ttft_ms'] for r in runs]):>16.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
