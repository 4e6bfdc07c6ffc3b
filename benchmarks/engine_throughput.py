"""Decode throughput through the whole actor system (Engine → Scheduler → runner
thread) at 1, 4 and 16 concurrent streams, side by side with the bare jitted loop in the
same process; and time to first token of a 512-token prompt while 15 streams decode.

    .venv/bin/python benchmarks/engine_throughput.py [--tokens N]

Aggregate throughput counts the tokens every stream emits while all of them are
decoding (from the last stream's first token to the first stream's end), per second.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import jax
import numpy as np
import trio

from motet.engines.engine import Engine
from motet.model import load_model
from motet.model.generate import decode_step
from motet.model.kv import KVGeometry, init_kv
from motet.model.sampling import request_key, sample

# Open-ended prompts, so greedy answers run long rather than stopping early.
TOPICS = ["the sea", "a city at night", "winter in the mountains", "an old library",
          "a train journey", "the history of bread", "a thunderstorm", "a small garden",
          "the moon", "a lighthouse", "a river", "a busy market", "the desert",
          "a violin maker", "a forest in autumn", "the first snow"]


def prompt_for(i: int) -> list[dict]:
    return [{"role": "user", "content": f"Write a long, detailed essay about {TOPICS[i % 16]}."}]


def bare_loop(model, rows: int, steps: int) -> float:
    """Tokens/s of decode_step + sample alone, the runner's two calls, at `rows` rows."""
    geo = KVGeometry(n_slots=16, max_context=1024, chunk=256)
    kv = init_kv(model.config, geo)
    keys = np.stack([np.asarray(request_key(i)) for i in range(rows)])
    temps, tops, top_ks, min_ps = (np.zeros(rows, np.float32), np.ones(rows, np.float32),
                                   np.zeros(rows, np.int32), np.zeros(rows, np.float32))
    tokens, slots = [7] * rows, list(range(rows))

    def step(kv, pos):
        logits, kv = decode_step(model, kv, geo, tokens, slots, [pos] * rows)
        out = sample(logits, temps, tops, top_ks, min_ps, keys)
        return np.asarray(out[0]), kv

    _, kv = step(kv, 100)  # compile
    t = time.perf_counter()
    for i in range(steps):
        _, kv = step(kv, 101 + i)
    return rows * steps / (time.perf_counter() - t)


async def run_streams(engine: Engine, n: int, max_tokens: int) -> dict:
    firsts, ends, stamps = [], [], []

    async def one(i):
        times = []
        async with engine.stream_chat(prompt_for(i), max_tokens=max_tokens) as events:
            async for event in events:
                times.append(time.perf_counter())
        firsts.append(times[0])
        ends.append(times[-1])
        stamps.append(times)

    async with trio.open_nursery() as nursery:
        for i in range(n):
            nursery.start_soon(one, i)
    start, stop = max(firsts), min(ends)
    inside = sum(sum(1 for t in ts if start < t <= stop) for ts in stamps)
    return {"streams": n, "aggregate_tok_s": inside / (stop - start) if stop > start else 0.0,
            "window_s": stop - start, "tokens_in_window": inside}


async def ttft_under_load(engine: Engine, long_prompt: list[int], others: int) -> float:
    """Time to first token of `long_prompt` once `others` streams are all decoding."""
    all_decoding = trio.Event()
    decoding = 0

    async def background(i):
        nonlocal decoding
        first = True
        async with engine.stream_chat(prompt_for(i), max_tokens=400) as events:
            async for _ in events:
                if first:
                    first = False
                    decoding += 1
                    if decoding == others:
                        all_decoding.set()

    ttft = None
    async with trio.open_nursery() as nursery:
        for i in range(others):
            nursery.start_soon(background, i)
        if others:
            await all_decoding.wait()
        t = time.perf_counter()
        async with engine.stream(long_prompt, max_tokens=1) as events:
            async for _ in events:
                ttft = ttft if ttft is not None else time.perf_counter() - t
        nursery.cancel_scope.cancel()
    return ttft


async def bench_engine(model, max_tokens: int) -> dict:
    out = {}
    async with Engine(model=model, kv_slots=16, max_context=1024) as engine:
        for n in (1, 4, 16):  # warm: compile every shape the measured runs meet
            await run_streams(engine, n, max_tokens)
        out["streams"] = [await run_streams(engine, n, max_tokens) for n in (1, 4, 16)]
        rng = np.random.default_rng(0)

        def long_prompt():  # a fresh one each time, so no slot holds its prefix
            return rng.integers(100, model.config.vocab_size, 512).tolist()

        await ttft_under_load(engine, long_prompt(), 0)  # compile the long prefill
        out["ttft_512_alone_s"] = await ttft_under_load(engine, long_prompt(), 0)
        out["ttft_512_with_15_decoding_s"] = await ttft_under_load(engine, long_prompt(), 15)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=96, help="max tokens per stream")
    args = parser.parse_args(argv)
    model = load_model()
    bare = {rows: bare_loop(model, rows, 24) for rows in (1, 4, 16)}
    engine = trio.run(bench_engine, model, args.tokens)
    by_n = {s["streams"]: s["aggregate_tok_s"] for s in engine["streams"]}
    result = {
        "backend": jax.default_backend(),
        "bare_loop_tok_s": bare,
        "engine": engine,
        "engine16_over_bare16": by_n[16] / bare[16],
        "engine16_over_engine1": by_n[16] / by_n[1],
    }
    print(json.dumps(result, indent=1))
    print(f"\n{'streams':>7} {'bare tok/s':>10} {'engine tok/s':>12} {'ratio':>6}")
    for n in (1, 4, 16):
        print(f"{n:>7} {bare[n]:>10.1f} {by_n[n]:>12.1f} {by_n[n] / bare[n]:>6.0%}")
    print(f"engine 16 / engine 1 = {result['engine16_over_engine1']:.1f}x; TTFT of a 512-token prompt: "
          f"{engine['ttft_512_alone_s']:.2f} s alone, {engine['ttft_512_with_15_decoding_s']:.2f} s "
          "with 15 streams decoding")
    return 0


if __name__ == "__main__":
    sys.exit(main())
