"""Aggregate decode throughput at 16 concurrent streams through `motet mux` driven by a
MuxEngine (a child process, the mux protocol on its pipes), side by side with the
in-process Engine on the same model, geometry and prompts, in one run.

    .venv/bin/python benchmarks/mux_throughput.py [--tokens N] [--rounds R]

Both engines are started and warmed up first; then each round measures both, the order
alternating from round to round so neither always runs second. Greedy, a different prompt
per stream, stream i on slot i. Aggregate throughput counts the tokens every stream
emits while all of them are decoding (from the last stream's first token to the first
stream's end), per second, as benchmarks/engine_throughput.py does. The target: mux at
least 0.95 of in-process.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import jax
import trio
from engine_throughput import prompt_for

from motet.engines.engine import Engine
from motet.engines.mux_engine import MuxEngine
from motet.model import default_model_path, load_model
from motet.runtime.api import TokenEvent

STREAMS = 16
CONTEXT = 1024  # the Engine's default prefill chunk (256) is also `motet mux`'s


async def run_streams(engine, prompts: list[str], max_tokens: int) -> dict:
    firsts, ends, stamps, texts = [], [], [], [""] * len(prompts)

    async def one(i):
        times = []
        async with engine.stream(prompts[i], max_tokens=max_tokens, slot=i) as events:
            async for event in events:
                times.append(time.perf_counter())
                texts[i] += event.text if isinstance(event, TokenEvent) else event.text_tail
        firsts.append(times[0])
        ends.append(times[-1])
        stamps.append(times)

    async with trio.open_nursery() as nursery:
        for i in range(len(prompts)):
            nursery.start_soon(one, i)
    start, stop = max(firsts), min(ends)
    inside = sum(sum(1 for t in ts if start < t <= stop) for ts in stamps)
    return {"aggregate_tok_s": inside / (stop - start) if stop > start else 0.0,
            "window_s": stop - start, "tokens_in_window": inside, "texts": texts}


async def bench(model, max_tokens: int, rounds: int) -> dict:
    prompts = [model.render_chat(prompt_for(i)) for i in range(STREAMS)]
    command = [sys.executable, "-m", "motet", "mux"]
    env = {"SNAP": str(default_model_path()), "CTX": str(CONTEXT)}
    runs = {"engine": [], "mux": []}
    async with (
        Engine(model, kv_slots=STREAMS, max_context=CONTEXT) as engine,
        MuxEngine(command, env=env, kv_slots=STREAMS) as mux_engine,
    ):
        engines = {"engine": engine, "mux": mux_engine}
        for name in engines:  # warm: compile every shape the measured runs meet
            for _ in range(2):
                await run_streams(engines[name], prompts, max_tokens)
        for r in range(rounds):
            order = ["engine", "mux"] if r % 2 == 0 else ["mux", "engine"]
            for name in order:
                runs[name].append(await run_streams(engines[name], prompts, max_tokens))
    return runs


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=64, help="max tokens per stream")
    parser.add_argument("--rounds", type=int, default=3, help="measured rounds per engine")
    args = parser.parse_args(argv)
    model = load_model()
    runs = trio.run(bench, model, args.tokens, args.rounds)
    tok_s = {name: [r["aggregate_tok_s"] for r in rs] for name, rs in runs.items()}
    median = {name: statistics.median(v) for name, v in tok_s.items()}
    result = {
        "backend": jax.default_backend(),
        "streams": STREAMS,
        "max_tokens": args.tokens,
        "aggregate_tok_s": tok_s,
        "median_tok_s": median,
        "mux_over_engine": median["mux"] / median["engine"],
        # Greedy: the two must write the same texts, stream by stream.
        "same_texts": all(a["texts"] == b["texts"] for a, b in zip(runs["engine"], runs["mux"])),
    }
    print(json.dumps(result, indent=1))
    print(f"\n{'':>10} {'median tok/s':>12}  rounds")
    for name in ("engine", "mux"):
        print(f"{name:>10} {median[name]:>12.1f}  " + " ".join(f"{x:.1f}" for x in tok_s[name]))
    print(f"mux / engine = {result['mux_over_engine']:.3f} (target >= 0.95); "
          f"same texts: {result['same_texts']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
