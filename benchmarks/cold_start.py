"""Time to ready and the first requests' wait, side by side in one run: an engine started
in a fresh process with the compilation cache cold, the same again with it warm, and,
for comparison, an engine that does not warm up (compiles on first use, as motet did).

    .venv/bin/python benchmarks/cold_start.py [--model PATH] [--kv-slots 16] [--max-context 4096]
                                              [--requests 16] [--tokens 48]

Each start runs in a process of its own (the compiled functions of one must not help the
next) and then serves two bursts of `requests` concurrent requests, greedy, `tokens`
tokens each, with prompts of several lengths (so several prefill sizes and every decode
batch size run); the second burst's prompts are other words of the same lengths, so no
prefix is reused. The target: the first burst within 1.2x of the second.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORDS = ("river stone lantern harbor meadow violin glacier orchard compass ember quarry "
         "tundra falcon cedar marble thistle canyon beacon saffron willow").split()


def prompt(i: int, burst: int) -> str:
    """A prompt of roughly 12 + 24·i words, different in every burst."""
    words = [WORDS[(i * 7 + j * (burst + 3)) % len(WORDS)] for j in range(12 + 24 * i)]
    return "Continue this list of words for a long while: " + " ".join(words)


async def burst(engine, requests: int, tokens: int, number: int) -> dict:
    import trio

    emitted = []

    async def one(i: int):
        answer = await engine.complete(prompt(i, number), max_tokens=tokens)
        emitted.append(answer.stats.emitted_tokens)

    started = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for i in range(requests):
            nursery.start_soon(one, i)
    return {"seconds": time.perf_counter() - started, "tokens": sum(emitted)}


def child(args) -> None:
    """One start and its two bursts; one JSON line on stdout."""
    import trio

    from motet.engines.engine import Engine

    async def main():
        started = time.perf_counter()
        async with Engine(args.model, kv_slots=args.kv_slots, max_context=args.max_context,
                          compile_cache=args.cache, warm_up=not args.no_warm_up) as engine:
            ready_s = time.perf_counter() - started
            first = await burst(engine, args.requests, args.tokens, 1)
            second = await burst(engine, args.requests, args.tokens, 2)
            report = engine.startup()
        print(json.dumps({"ready_s": ready_s, "load_s": report.load_s, "warmup_s": report.warmup_s,
                          "shapes": report.shapes, "compiled": report.compiled,
                          "from_cache": report.from_cache, "compiles_after_ready": report.compiles_after_ready,
                          "burst1": first, "burst2": second}))

    trio.run(main)


def start(args, cache: Path, warm_up: bool) -> dict:
    command = [sys.executable, __file__, "--child", "--cache", str(cache), "--kv-slots", str(args.kv_slots),
               "--max-context", str(args.max_context), "--requests", str(args.requests),
               "--tokens", str(args.tokens)]
    if args.model:
        command += ["--model", args.model]
    if not warm_up:
        command.append("--no-warm-up")
    out = subprocess.run(command, check=True, stdout=subprocess.PIPE, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a .gguf file or a Hugging Face directory (default model)")
    parser.add_argument("--kv-slots", type=int, default=16)
    parser.add_argument("--max-context", type=int, default=4096)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--cache", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--no-warm-up", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args)
        return 0
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        cache, unwarmed = Path(tmp) / "cache", Path(tmp) / "unwarmed"
        runs["cold cache"] = start(args, cache, warm_up=True)
        runs["warm cache"] = start(args, cache, warm_up=True)
        runs["no warm-up, cold cache"] = start(args, unwarmed, warm_up=False)
    for run in runs.values():
        run["burst1_over_burst2"] = run["burst1"]["seconds"] / run["burst2"]["seconds"]
    result = {"model": args.model or "default", "kv_slots": args.kv_slots, "max_context": args.max_context,
              "requests": args.requests, "tokens": args.tokens, "runs": runs}
    print(json.dumps(result, indent=1))
    print("\n| start | ready s | model s | warm-up s | compiled | from cache | burst 1 s | burst 2 s "
          "| burst 1 / burst 2 | compiles after ready |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, r in runs.items():
        print(f"| {name} | {r['ready_s']:.1f} | {r['load_s']:.1f} | {r['warmup_s']:.1f} | {r['compiled']} "
              f"| {r['from_cache']} | {r['burst1']['seconds']:.1f} | {r['burst2']['seconds']:.1f} "
              f"| {r['burst1_over_burst2']:.2f} | {r['compiles_after_ready']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
