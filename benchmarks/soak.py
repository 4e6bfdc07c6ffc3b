"""Load and soak: `motet serve` under a mix of requests, for a set number of them, then
the invariants that must hold once the load is gone.

    .venv/bin/python benchmarks/soak.py [--requests 400] [--concurrency 8] [--targets engine,mux]
        [--model tests/golden/llama] [--engine-cmd "python -m motet mux"] [--kv-slots 4]
        [--max-context 256] [--max-tokens 48] [--seed 0] [--rss-tolerance-mib 64]
        [--compile-cache ~/.cache/motet/jax]

Targets: `engine`, the HTTP server over the in-process Engine; `mux`, the same server over
a mux engine child (`--engine-cmd`, as `motet serve --engine-cmd` drives it). Loopback
only; the clients are httpx in the server's own Trio loop. The mix: streamed and whole
chat answers, new conversations and continued ones (so slots' caches are reused),
completions, streams the client drops after a few chunks, requests the client abandons
mid-answer (a disconnect), prompts past the context, bodies past the size limit, and
bad fields.

Afterwards: every slot free and nothing queued (`engine.statistics()`), no Trio task
left over (`trio.lowlevel.current_statistics().tasks_living` against the count after
the warm-up), no thread left over (`threading.active_count()`), RSS flat after the
warm-up (psutil, this process and a mux child; within a tolerance), and every request
with exactly one terminal answer: a finish (`stop`/`length`), a documented error (400
with a `param` or code, 413, 429; in a stream, one error frame), or the client's own
disconnect. Prints JSON, then a short table; exits 1 when an invariant fails.
tests/test_soak.py runs a short version of it.
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import trio

REPO = Path(__file__).resolve().parent.parent
KINDS = {  # kind: weight in the mix
    "stream_chat": 5, "chat": 3, "continue_chat": 3, "completion": 2, "stream_completion": 2,
    "drop_stream": 2, "abandon": 2, "too_long": 1, "too_big": 1, "bad_field": 1,
}
DOCUMENTED = {400, 413, 429}  # the refusals this mix may meet (no pinned slots: no 409)
TOPICS = ("the sea", "a lighthouse", "bread", "the moon", "a violin", "winter", "a market", "rivers")


@dataclass
class Outcome:
    kind: str
    terminals: list[str] = field(default_factory=list)  # finish:<reason>, error:<status>:<code>, disconnected
    problems: list[str] = field(default_factory=list)  # anything outside the documented answers
    tokens: int = 0
    text: str = ""  # the answer, to continue the conversation


def is_documented(outcome: Outcome) -> bool:
    return len(outcome.terminals) == 1 and not outcome.problems


# ---- one request of each kind ---------------------------------------------------------


class Load:
    """The clients: `run(n)` sends n requests, `concurrency` at a time, kinds drawn by weight."""

    def __init__(self, http, rng: random.Random, max_tokens: int, max_context: int, body_limit: int):
        self.http, self.rng = http, rng
        self.max_tokens, self.max_context, self.body_limit = max_tokens, max_context, body_limit
        self.conversations: list[list[dict]] = []  # finished ones, to continue
        self.outcomes: list[Outcome] = []
        self.serial = 0

    async def run(self, n: int, concurrency: int) -> list[Outcome]:
        kinds = self.rng.choices(list(KINDS), weights=list(KINDS.values()), k=n)
        work = iter(kinds)

        async def worker():
            for kind in work:
                self.outcomes.append(await self.one(kind))

        async with trio.open_nursery() as nursery:
            for _ in range(concurrency):
                nursery.start_soon(worker)
        return self.outcomes[-n:]

    def _messages(self) -> list[dict]:
        self.serial += 1
        topic = self.rng.choice(TOPICS)
        return [{"role": "user", "content": f"Conversation {self.serial}: tell me about {topic}."}]

    async def one(self, kind: str) -> Outcome:
        outcome = Outcome(kind)
        tokens = self.rng.randint(1, self.max_tokens)
        base = {"model": "soak", "max_tokens": tokens, "temperature": self.rng.choice([0, 0.7, 1.0])}
        match kind:
            case "stream_chat" | "chat" | "continue_chat" | "drop_stream":
                messages = self._messages()
                if kind == "continue_chat" and self.conversations:
                    messages = self.rng.choice(self.conversations) + [{"role": "user", "content": "Go on."}]
                body = {**base, "messages": messages, "stream": kind != "chat",
                        "stream_options": {"include_usage": self.rng.random() < 0.5}}
                await self._request("/v1/chat/completions", body, outcome, drop_after=(
                    self.rng.randint(1, 4) if kind == "drop_stream" else None))
                if outcome.terminals[:1] in (["finish:stop"], ["finish:length"]) and len(messages) < 5:
                    self.conversations.append(messages + [{"role": "assistant", "content": outcome.text}])
            case "completion" | "stream_completion":
                body = {**base, "prompt": f"Story {self.rng.random()}: once upon a time",
                        "stream": kind == "stream_completion"}
                await self._request("/v1/completions", body, outcome)
            case "abandon":  # the client leaves mid-answer: a disconnect
                body = {**base, "max_tokens": self.max_tokens, "messages": self._messages()}
                with trio.move_on_after(self.rng.uniform(0.005, 0.2)):
                    await self._request("/v1/chat/completions", body, outcome)
                    return outcome
                outcome.terminals.append("disconnected")
            case "too_long":  # past the context in tokens (a 400), well within the body limit
                await self._request("/v1/completions", {**base, "prompt": "word " * (2 * self.max_context)}, outcome)
            case "too_big":  # past the body limit (a 413)
                await self._request("/v1/completions", {**base, "prompt": "x" * self.body_limit}, outcome)
            case "bad_field":
                field_, value = self.rng.choice([("temperature", 5), ("top_p", 0), ("n", 3), ("stop", [1])])
                await self._request("/v1/chat/completions", {**base, "messages": self._messages(),
                                                            field_: value}, outcome)
        return outcome

    async def _request(self, path: str, body: dict, outcome: Outcome, drop_after: int | None = None) -> None:
        async with self.http.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                self._refusal(response.status_code, await response.aread(), outcome)
                return
            if not body.get("stream"):
                answer = json.loads(await response.aread())
                choice = answer["choices"][0]
                outcome.text = choice.get("message", {}).get("content", choice.get("text", ""))
                outcome.tokens = answer["usage"]["completion_tokens"]
                outcome.terminals.append(f"finish:{choice['finish_reason']}")
                return
            chunks, done = 0, 0
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    if line:
                        outcome.problems.append(f"not an SSE data line: {line[:80]!r}")
                    continue
                if line == "data: [DONE]":
                    done += 1
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    outcome.terminals.append(f"error:stream:{event['error'].get('code')}")
                    continue
                for choice in event.get("choices", ()):
                    delta = choice.get("delta", {}).get("content") or choice.get("text") or ""
                    outcome.text += delta
                    outcome.tokens += bool(delta)
                    if choice.get("finish_reason") is not None:
                        outcome.terminals.append(f"finish:{choice['finish_reason']}")
                chunks += 1
                if drop_after is not None and chunks >= drop_after and not outcome.terminals:
                    outcome.terminals.append("disconnected")  # leaving the block closes the connection
                    return
            finished = any(t.startswith("finish:") for t in outcome.terminals)
            if done != (1 if finished else 0):
                outcome.problems.append(f"{done} [DONE] after {outcome.terminals}")

    @staticmethod
    def _refusal(status: int, data: bytes, outcome: Outcome) -> None:
        try:
            error = json.loads(data)["error"]
        except (ValueError, KeyError, TypeError):
            outcome.problems.append(f"{status} without an error object: {data[:120]!r}")
            return
        outcome.terminals.append(f"error:{status}:{error.get('code') or error.get('param')}")
        if status not in DOCUMENTED:
            outcome.problems.append(f"status {status}: {error.get('message')}")
        elif status == 400 and not (error.get("param") or error.get("code")):
            outcome.problems.append(f"a 400 naming no field: {error.get('message')}")


# ---- the run, and what must hold after it -------------------------------------------------


def rss_mib(pid: int | None = None) -> float:
    import psutil

    return psutil.Process(pid).memory_info().rss / 2**20


async def steady_tasks(quiet_s: float = 0.3, timeout_s: float = 10.0) -> int:
    """The living task count once it has not changed for `quiet_s` (connections close a
    little after their last response)."""
    count, since = trio.lowlevel.current_statistics().tasks_living, trio.current_time()
    with trio.move_on_after(timeout_s):
        while trio.current_time() - since < quiet_s:
            await trio.sleep(0.05)
            now = trio.lowlevel.current_statistics().tasks_living
            if now != count:
                count, since = now, trio.current_time()
    return count


async def settle(predicate, timeout_s: float) -> bool:
    """Whether `predicate()` comes true within the timeout (cancels, threads, connections
    end a little after their requests)."""
    with trio.move_on_after(timeout_s):
        while not predicate():
            await trio.sleep(0.05)
        return True
    return False


async def soak(engine, settings, *, requests: int, concurrency: int, seed: int = 0,
               max_tokens: int = 48, warmup: int | None = None, rss_tolerance_mib: float = 64.0) -> dict:
    """Serve `engine` with `settings` (port 0 picks one), load it, check the invariants."""
    import httpx

    from motet.http.serve import serve_app

    rng = random.Random(seed)
    child = getattr(getattr(engine, "current", None), "process", None)  # a mux engine's child
    warmup = warmup if warmup is not None else max(2 * concurrency, requests // 10)
    report: dict = {"requests": requests, "warmup": warmup, "concurrency": concurrency, "seed": seed}
    async with trio.open_nursery() as nursery:
        url = (await nursery.start(partial(serve_app, engine, settings)))[0]
        limits = httpx.Limits(max_connections=concurrency + 2, max_keepalive_connections=0)

        def client():
            return httpx.AsyncClient(base_url=url, timeout=300, limits=limits)

        async with client() as http:  # warm-up: every path compiled and allocated once
            await Load(http, random.Random(seed + 1), max_tokens, settings.max_context,
                       settings.max_body_bytes).run(warmup, concurrency)
        await settle(lambda: engine.statistics().running == 0, 30)
        before = {"tasks": await steady_tasks(),
                  "threads": threading.active_count(), "rss_mib": rss_mib(),
                  "child_rss_mib": rss_mib(child.pid) if child else None}
        peak = before["rss_mib"]
        started = time.perf_counter()
        async with client() as http:
            load = Load(http, rng, max_tokens, settings.max_context, settings.max_body_bytes)
            async with trio.open_nursery() as sampler:
                async def sample():
                    nonlocal peak
                    while True:
                        peak = max(peak, rss_mib())
                        await trio.sleep(0.5)
                sampler.start_soon(sample)
                outcomes = await load.run(requests, concurrency)
                sampler.cancel_scope.cancel()
        wall_s = time.perf_counter() - started
        slots_free = await settle(lambda: (s := engine.statistics()).running == 0 and s.waiting == 0, 30)
        tasks_back = await settle(lambda: trio.lowlevel.current_statistics().tasks_living <= before["tasks"], 15)
        threads_back = await settle(lambda: threading.active_count() <= before["threads"], 15)
        stats = engine.statistics()
        after = {"tasks": trio.lowlevel.current_statistics().tasks_living, "threads": threading.active_count(),
                 "rss_mib": rss_mib(), "child_rss_mib": rss_mib(child.pid) if child else None}
        nursery.cancel_scope.cancel()
    growth = after["rss_mib"] - before["rss_mib"]
    child_growth = after["child_rss_mib"] - before["child_rss_mib"] if child else 0.0
    bad = [o for o in outcomes if not is_documented(o)]
    report |= {
        "wall_s": round(wall_s, 2), "requests_per_s": round(requests / wall_s, 2),
        "tokens": sum(o.tokens for o in outcomes),
        "kinds": dict(Counter(o.kind for o in outcomes)),
        "answers": dict(Counter(o.terminals[0] if len(o.terminals) == 1 else f"{len(o.terminals)} terminals"
                                for o in outcomes)),
        "undocumented": [{"kind": o.kind, "terminals": o.terminals, "problems": o.problems} for o in bad[:10]],
        "slots": {"running": stats.running, "waiting": stats.waiting, "total": stats.slots_total},
        "before": before, "after": after, "rss_peak_mib": round(peak, 1),
        "rss_growth_mib": round(growth, 1), "child_rss_growth_mib": round(child_growth, 1),
        "rss_tolerance_mib": rss_tolerance_mib,
    }
    report["invariants"] = {
        "every_slot_free": slots_free,
        "no_task_leaked": tasks_back,
        "no_thread_leaked": threads_back,
        "rss_flat": growth <= rss_tolerance_mib and child_growth <= rss_tolerance_mib,
        "one_terminal_answer_each": not bad,
    }
    return report


async def run_target(target: str, args) -> dict:
    from motet.cli.compose import open_engine
    from motet.runtime.serve_settings import ServeSettings

    common = dict(port=0, kv_slots=args.kv_slots, max_context=args.max_context, queue_limit=64,
                  max_body_bytes=args.max_body_bytes)
    if target == "engine":
        from motet.engines.engine import Engine

        settings = ServeSettings(**common)
        engine_cm = Engine(args.model, kv_slots=args.kv_slots, max_context=args.max_context,
                           prefill_chunk=16, queue_limit=64)
    else:
        settings = ServeSettings(**common, engine_cmd=args.engine_cmd, model_path=args.model)
        engine_cm = open_engine(settings, None)
    async with engine_cm as engine:
        return await soak(engine, settings, requests=args.requests, concurrency=args.concurrency,
                          seed=args.seed, max_tokens=args.max_tokens, rss_tolerance_mib=args.rss_tolerance_mib)


def table(results: dict) -> str:
    rows = [f"{'target':>7} {'requests':>8} {'wall s':>7} {'req/s':>6} {'tokens':>7} {'slots':>6} "
            f"{'tasks':>9} {'threads':>8} {'RSS MiB (child)':>22} {'ok':>3}"]
    for target, r in results.items():
        b, a = r["before"], r["after"]
        rss = f"{b['rss_mib']:.0f}->{a['rss_mib']:.0f}"
        if b["child_rss_mib"] is not None:
            rss += f" ({b['child_rss_mib']:.0f}->{a['child_rss_mib']:.0f})"
        ok = "yes" if all(r["invariants"].values()) else "NO"
        rows.append(f"{target:>7} {r['requests']:>8} {r['wall_s']:>7.1f} {r['requests_per_s']:>6.1f} "
                    f"{r['tokens']:>7} {r['slots']['running']:>2}/{r['slots']['total']:<3} "
                    f"{b['tasks']:>4}->{a['tasks']:<4} {b['threads']:>3}->{a['threads']:<4} {rss:>22} {ok:>3}")
    for target, r in results.items():
        rows.append(f"{target}: " + ", ".join(f"{k} {v}" for k, v in sorted(r["answers"].items())))
    return "\n".join(rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=400, help="requests per target, after the warm-up")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--targets", default="engine,mux", help="engine, mux, or both (comma-separated)")
    parser.add_argument("--model", type=Path, default=REPO / "tests" / "golden" / "llama")
    parser.add_argument("--engine-cmd", default=None,
                        help="the mux target's child (default: this Python's `motet mux`, sharing the cache)")
    parser.add_argument("--kv-slots", type=int, default=4)
    parser.add_argument("--max-context", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=48, help="the most a request asks for")
    parser.add_argument("--max-body-bytes", type=int, default=64 << 10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rss-tolerance-mib", type=float, default=64.0)
    parser.add_argument("--compile-cache", default=str(Path.home() / ".cache" / "motet" / "jax"),
                        help="JAX's persistent compilation cache ('' for none)")
    args = parser.parse_args(argv)
    if args.compile_cache:
        import jax

        jax.config.update("jax_compilation_cache_dir", args.compile_cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    if args.engine_cmd is None:
        cache = ["--compile-cache", args.compile_cache] if args.compile_cache else []
        args.engine_cmd = shlex.join([sys.executable, "-m", "motet", "mux", *cache])
    results = {t: trio.run(run_target, t, args) for t in args.targets.split(",")}
    print(json.dumps(results, indent=1))
    print()
    print(table(results))
    return 0 if all(all(r["invariants"].values()) for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
