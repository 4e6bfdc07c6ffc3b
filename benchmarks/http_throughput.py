"""`motet serve` against its engine, in one run: 32 concurrent streaming chat clients on
the same engine, first called directly, then through the HTTP server (SSE, the OpenAI
chat API). Reports aggregate tokens/s (target: HTTP ≥ 0.90 × direct), and p50/p99 time
to first token and inter-token latency.

    .venv/bin/python benchmarks/http_throughput.py [--tokens N] [--clients N] [--rounds N]
        [--engine-cmd "motet mux" [--model PATH]]

The engine is the in-process Engine, or with --engine-cmd a mux engine child driven as
`motet serve --engine-cmd` drives it (the server's own open_engine; "direct" then means
the MuxEngine API, without HTTP). --model: the child's model (SNAP), the default model
when not given.

The HTTP clients run in a child process (httpx under Trio), so their parsing does not
share the server's event loop; on a small machine they still share its cores. Each run
has prompts of its own (the run number leads the user message), so no run reuses more
of another's KV than the chat template's shared system prompt. Aggregate throughput is
all tokens over the whole run (first request sent to last token), so queueing counts.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from functools import partial
from pathlib import Path

import trio

TOPICS = ["the sea", "a city at night", "winter in the mountains", "an old library",
          "a train journey", "the history of bread", "a thunderstorm", "a small garden",
          "the moon", "a lighthouse", "a river", "a busy market", "the desert",
          "a violin maker", "a forest in autumn", "the first snow"]


def messages(run: int, i: int) -> list[dict]:
    return [{"role": "user", "content": f"Run {run}, essay {i}: write a long, detailed essay "
                                         f"about {TOPICS[i % len(TOPICS)]}."}]


# ---- the two loads (each returns one trace per client) ------------------------------


async def direct_load(engine, run: int, clients: int, tokens: int) -> list[dict]:
    from motet.runtime.api import TokenEvent

    traces = []

    async def one(i):
        start, stamps, count = time.perf_counter(), [], 0
        prompt = engine.render_chat(messages(run, i))
        async with engine.stream(prompt, max_tokens=tokens, temperature=0.0) as events:
            async for event in events:
                if isinstance(event, TokenEvent):
                    count += 1
                    if event.text:  # as a stream chunk would carry it
                        stamps.append(time.perf_counter())
        traces.append({"start": start, "stamps": stamps, "tokens": count})

    async with trio.open_nursery() as nursery:
        for i in range(clients):
            nursery.start_soon(one, i)
    return traces


async def http_load(url: str, run: int, clients: int, tokens: int) -> list[dict]:
    import httpx

    traces = []

    async def one(http, i):
        body = {"model": "bench", "messages": messages(run, i), "max_tokens": tokens,
                "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
        start, stamps, count = time.perf_counter(), [], 0
        async with http.stream("POST", "/v1/chat/completions", json=body) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                obj = json.loads(line[6:])
                if obj.get("usage"):
                    count = obj["usage"]["completion_tokens"]
                elif obj.get("choices") and obj["choices"][0]["delta"].get("content"):
                    stamps.append(time.perf_counter())
        traces.append({"start": start, "stamps": stamps, "tokens": count})

    limits = httpx.Limits(max_connections=clients + 1)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        async with trio.open_nursery() as nursery:
            for i in range(clients):
                nursery.start_soon(one, http, i)
    return traces


async def http_load_in_child(url: str, run: int, clients: int, tokens: int) -> list[dict]:
    done = await trio.run_process(
        [sys.executable, __file__, "--load", url, "--run", str(run), "--clients", str(clients),
         "--tokens", str(tokens)], capture_stdout=True)
    return json.loads(done.stdout)


# ---- figures ------------------------------------------------------------------------


def summarize(traces: list[dict]) -> dict:
    import numpy as np

    start = min(t["start"] for t in traces)
    end = max(t["stamps"][-1] for t in traces if t["stamps"])
    ttft = [t["stamps"][0] - t["start"] for t in traces if t["stamps"]]
    itl = [b - a for t in traces for a, b in zip(t["stamps"], t["stamps"][1:])]
    tokens = sum(t["tokens"] for t in traces)

    def pct(xs, q):
        return float(np.percentile(xs, q)) if xs else 0.0

    return {"tokens": tokens, "wall_s": end - start, "aggregate_tok_s": tokens / (end - start),
            "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99),
            "itl_p50_s": pct(itl, 50), "itl_p99_s": pct(itl, 99)}


async def bench(model, clients: int, tokens: int, rounds: int, engine_cmd: str | None = None,
                model_path=None) -> dict:
    """`model`: a loaded Model for the in-process Engine (None with `engine_cmd`)."""
    from motet.http.serve import open_engine, serve_app
    from motet.runtime.serve_settings import ServeSettings

    out = {"direct": [], "http": []}
    settings = ServeSettings(port=0, kv_slots=16, max_context=1024, queue_limit=clients,
                             engine_cmd=engine_cmd, model_path=model_path)
    async with open_engine(settings, model) as engine:
        async with trio.open_nursery() as nursery:
            url = (await nursery.start(partial(serve_app, engine, settings)))[0]
            await direct_load(engine, 0, clients, tokens)  # warm: compile every shape
            await http_load_in_child(url, 1, 2, 4)  # warm: the server's first requests
            for r in range(rounds):
                out["direct"].append(summarize(await direct_load(engine, 2 + 2 * r, clients, tokens)))
                out["http"].append(summarize(await http_load_in_child(url, 3 + 2 * r, clients, tokens)))
            nursery.cancel_scope.cancel()
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=64, help="max tokens per client")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2, help="direct/HTTP pairs, alternated")
    parser.add_argument("--engine-cmd", default=None,
                        help='a mux engine command line (e.g. "motet mux"); default: the in-process Engine')
    parser.add_argument("--model", type=Path, default=None,
                        help="with --engine-cmd: the child's model (SNAP); default: the default model")
    parser.add_argument("--load", default=None, help=argparse.SUPPRESS)  # the child: HTTP load on URL
    parser.add_argument("--run", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.load:
        print(json.dumps(trio.run(http_load, args.load, args.run, args.clients, args.tokens)))
        return 0

    if args.model is not None and args.engine_cmd is None:
        parser.error("--model goes with --engine-cmd")
    if args.engine_cmd is None:
        import jax

        from motet.model import load_model

        model, backend = load_model(), jax.default_backend()
    else:
        model, backend = None, f"mux: {args.engine_cmd}"
    result = trio.run(bench, model, args.clients, args.tokens, args.rounds, args.engine_cmd, args.model)
    total = {k: sum(r["tokens"] for r in v) / sum(r["wall_s"] for r in v) for k, v in result.items()}
    result |= {"backend": backend, "clients": args.clients, "max_tokens": args.tokens,
               "http_over_direct": total["http"] / total["direct"]}
    print(json.dumps(result, indent=1))
    print(f"\n{'path':>6} {'round':>5} {'tok/s':>7} {'TTFT p50':>9} {'TTFT p99':>9} "
          f"{'ITL p50':>8} {'ITL p99':>8}")
    for kind in ("direct", "http"):
        for r, s in enumerate(result[kind]):
            print(f"{kind:>6} {r:>5} {s['aggregate_tok_s']:>7.1f} {s['ttft_p50_s']:>8.2f}s "
                  f"{s['ttft_p99_s']:>8.2f}s {s['itl_p50_s'] * 1e3:>6.0f}ms {s['itl_p99_s'] * 1e3:>6.0f}ms")
    print(f"HTTP / direct aggregate tokens/s = {result['http_over_direct']:.2f} (target >= 0.90)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
