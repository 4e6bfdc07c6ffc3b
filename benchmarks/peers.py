"""motet against llama.cpp on the default model's GGUF file, the same token ids, side by
side in one run: single-stream decode, 16 concurrent streams, and a 512-token prefill.

    .venv/bin/python benchmarks/peers.py [--repeats N] [--threads T]

llama.cpp runs through llama-cpp-python's low-level API (a benchmark-only dependency,
not one of motet's) in a child process, so a build that crashes on this CPU is reported
rather than taking the run down; motet runs in this process through its Engine.

What is measured (best of --repeats timed runs, after an untimed run of every scenario):
  peak RSS  each engine's process at its peak (motet: this process, with the Engine's KV
            cache; llama.cpp: its child process, with its own)
  single    greedy decode tokens/s after a short chat prompt: (generated - 1) / (time
            from the first token to the last), prefill excluded.
  streams   16 concurrent 256-token prompts, 128 greedy tokens each: tokens generated
            after every stream has finished its prefill / the time they took, and the
            wall time from submitting the first prompt to the last token.
  prefill   512-token prompt: prompt tokens / time to the first token.

Both engines see identical ids, built with motet's tokenizer. llama.cpp never stops on
EOS; motet does, so the prompts ask for long essays and the output reports what each
engine actually generated. Each run uses different prompts so motet's slots cannot reuse
an earlier run's KV (beyond the shared chat-template opening, reported as reused tokens).
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import json
import resource
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

STREAMS = 16
STREAM_PROMPT = 256
PREFILL_PROMPT = 512
NEW_TOKENS = 128
WARM_TOKENS = 8  # llama.cpp's untimed pass: it has nothing to compile

TOPICS = ["the sea", "a city at night", "winter in the mountains", "an old library",
          "a train journey", "the history of bread", "a thunderstorm", "a small garden",
          "the moon", "a lighthouse", "a river", "a busy market", "the desert",
          "a violin maker", "a forest in autumn", "the first snow"]
NOTES = ("The notes below were gathered over many years of travel, reading and long "
         "conversations with people who know the subject well. Some are facts, some are "
         "impressions, and some are questions that still have no answer. People remember "
         "the light, the sounds and the smells long after the details fade. Old maps, "
         "letters and photographs tell one story; the people who lived there tell another. "
         "Every season changes the place, and every visitor sees something different. ")

# FINDINGS.md's build, each SIMD extension switched on only where this CPU has it (a
# build with AVX-VNNI on a CPU without it dies of SIGILL in the Q4_1 dot product).
CPU_FLAGS = {"AVX": "avx", "AVX2": "avx2", "FMA": "fma", "F16C": "f16c", "BMI2": "bmi2",
             "AVX512": "avx512f", "AVX512_VBMI": "avx512vbmi", "AVX512_VNNI": "avx512_vnni",
             "AVX512_BF16": "avx512_bf16", "AVX_VNNI": "avx_vnni"}


def install_hint() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
        have = set(next(l for l in text.splitlines() if l.startswith("flags")).split(":")[1].split())
    except (OSError, StopIteration):
        have = set(CPU_FLAGS.values())
    args = ["-DGGML_NATIVE=OFF"] + [f"-DGGML_{k}={'ON' if v in have else 'OFF'}" for k, v in CPU_FLAGS.items()]
    args += ["-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]
    return (f'CMAKE_ARGS="{" ".join(args)}" .venv/bin/pip install --no-cache-dir '
            "--force-reinstall --no-deps llama-cpp-python==0.3.36")


# ---- the workload -------------------------------------------------------------------

@dataclass(frozen=True)
class Workload:
    single: list[int]  # a short chat prompt
    streams: list[list[int]]  # STREAMS prompts of STREAM_PROMPT ids
    prefill: list[int]  # PREFILL_PROMPT ids


def chat_ids(model, tag: str, topic: str, length: int | None) -> list[int]:
    """A ChatML prompt asking for a long essay; with `length`, notes padded or cut so the
    prompt is exactly `length` ids. `tag` opens the system message, so prompts of
    different runs share only the template's first tokens."""
    enc = model.tokenizer.encode
    fill = "\x00NOTES\x00"
    ask = f"write a very long, detailed essay about {topic}, in many sections."
    user = f"Notes:{fill}\n\nUsing these notes, {ask}" if length else ask[0].upper() + ask[1:]
    text = model.render_chat([
        {"role": "system", "content": f"{tag}. You are a helpful writer of long essays."},
        {"role": "user", "content": user},
    ])
    if not length:
        return enc(text)
    head, tail = (enc(part) for part in text.split(fill))
    need = length - len(head) - len(tail)
    notes = enc(" " + NOTES * (need // 60 + 1))
    return head + notes[:need] + tail


def workload(model, run: int) -> Workload:
    tag = f"Session {run}"
    return Workload(
        single=chat_ids(model, tag, TOPICS[run % len(TOPICS)], None),
        streams=[chat_ids(model, f"{tag}.{i}", TOPICS[(run + i) % len(TOPICS)], STREAM_PROMPT)
                 for i in range(STREAMS)],
        prefill=chat_ids(model, f"{tag} long", TOPICS[(run + 7) % len(TOPICS)], PREFILL_PROMPT),
    )


# ---- motet ----------------------------------------------------------------------------

async def motet_stream(engine, ids: list[int], max_tokens: int) -> dict:
    from motet.runtime.api import TokenEvent

    stamps, tokens = [], []
    submitted = time.perf_counter()
    async with engine.stream(ids, max_tokens=max_tokens) as events:
        async for event in events:
            if isinstance(event, TokenEvent):
                stamps.append(time.perf_counter())
                tokens.append(event.token_id)
    stats = events.finish.stats
    return {"submitted": submitted, "stamps": stamps, "tokens": tokens,
            "finish_reason": stats.finish_reason, "reused_tokens": stats.reused_tokens,
            "stats_decode_tok_s": stats.decode_tokens_per_s}


async def motet_runs(model, runs: list[Workload]) -> list[dict]:
    """The first run is the untimed one that compiles every shape the others use."""
    import trio

    from motet.engine import Engine

    out = []
    async with Engine(model=model, kv_slots=STREAMS, max_context=1024, prefill_chunk=256) as engine:
        for w in runs:
            one = await motet_stream(engine, w.single, NEW_TOKENS)
            span = one["stamps"][-1] - one["stamps"][0]
            single = {"decode_tok_s": (len(one["tokens"]) - 1) / span if span > 0 else 0.0,
                      "generated": len(one["tokens"]), "finish_reason": one["finish_reason"],
                      "engine_reported_decode_tok_s": one["stats_decode_tok_s"], "tokens": one["tokens"]}

            traces = [None] * STREAMS

            async def run_one(i, ids):
                traces[i] = await motet_stream(engine, ids, NEW_TOKENS)

            started = time.perf_counter()
            async with trio.open_nursery() as nursery:
                for i, ids in enumerate(w.streams):
                    nursery.start_soon(run_one, i, ids)
            all_prefilled = max(t["stamps"][0] for t in traces)
            end = max(t["stamps"][-1] for t in traces)
            after = sum(sum(1 for s in t["stamps"] if s > all_prefilled) for t in traces)
            streams = {"aggregate_decode_tok_s": after / (end - all_prefilled), "wall_s": end - started,
                       "tokens_after_all_prefilled": after,
                       "generated_per_stream": [len(t["tokens"]) for t in traces],
                       "stopped_early": sum(t["finish_reason"] != "length" for t in traces),
                       "reused_tokens_max": max(t["reused_tokens"] for t in traces)}

            long = await motet_stream(engine, w.prefill, 1)
            ttft = long["stamps"][0] - long["submitted"]
            prefill = {"tok_s": len(w.prefill) / ttft, "ttft_s": ttft, "reused_tokens": long["reused_tokens"]}
            out.append({"single": single, "streams": streams, "prefill": prefill})
    return out


# ---- llama.cpp (in a child process) ---------------------------------------------------

class LlamaCpp:
    """A llama.cpp context for `n_seq` sequences, each with its own n_ctx / n_seq cells
    (llama-server's layout; one unified cache measured 4x slower at 16 streams here, as
    every sequence attends over all cells), driven batch by batch through the
    low-level API, greedy argmax in numpy."""

    def __init__(self, path: str, *, threads: int, n_ctx: int, n_seq: int, n_batch: int = 512):
        import llama_cpp as L

        self.L = L
        self._quiet = L.llama_log_callback(lambda level, text, user: None)  # keep a reference
        L.llama_log_set(self._quiet, ctypes.c_void_p(0))
        L.llama_backend_init()
        self.model = L.llama_model_load_from_file(path.encode(), L.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        self.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        cp = L.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = n_ctx, n_batch, n_batch, n_seq
        cp.n_threads = cp.n_threads_batch = threads
        cp.kv_unified = False
        cp.no_perf = True
        self.ctx = L.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.n_batch = n_batch
        self.batch = L.llama_batch_init(n_batch, 0, 1)

    def clear(self) -> None:
        self.L.llama_memory_clear(self.L.llama_get_memory(self.ctx), True)

    def _decode(self, rows: list[tuple[int, int, int, bool]]) -> list[int]:
        """rows: (token, position, sequence, wants logits); greedy tokens of those that do."""
        b = self.batch
        b.n_tokens = len(rows)
        for i, (token, pos, seq, out) in enumerate(rows):
            b.token[i], b.pos[i], b.n_seq_id[i], b.seq_id[i][0], b.logits[i] = token, pos, 1, seq, out
        rc = self.L.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        logits = (self.L.llama_get_logits_ith(self.ctx, i) for i, row in enumerate(rows) if row[3])
        return [int(np.ctypeslib.as_array(p, shape=(self.n_vocab,)).argmax()) for p in logits]

    def prefill(self, ids: list[int], seq: int) -> int:
        for start in range(0, len(ids), self.n_batch):
            chunk = ids[start : start + self.n_batch]
            last = start + len(chunk) == len(ids)
            out = self._decode([(t, start + j, seq, last and j == len(chunk) - 1) for j, t in enumerate(chunk)])
        return out[0]

    def step(self, tokens: list[int], positions: list[int]) -> list[int]:
        """One token for each of sequences 0 .. len(tokens) - 1."""
        return self._decode([(t, p, s, True) for s, (t, p) in enumerate(zip(tokens, positions))])


def llama_cpp_runs(job: dict) -> list[dict]:
    peer = LlamaCpp(job["model"], threads=job["threads"], n_ctx=job["n_ctx"], n_seq=STREAMS)
    out = []
    for k, w in enumerate(job["runs"]):
        new = WARM_TOKENS if k == 0 else NEW_TOKENS
        peer.clear()
        tokens = [peer.prefill(w["single"], 0)]
        first = time.perf_counter()
        for i in range(new - 1):
            tokens += peer.step(tokens[-1:], [len(w["single"]) + i])
        single = {"decode_tok_s": (new - 1) / (time.perf_counter() - first), "generated": new, "tokens": tokens}

        peer.clear()
        started = time.perf_counter()
        last = [peer.prefill(ids, s) for s, ids in enumerate(w["streams"])]
        all_prefilled = time.perf_counter()
        for i in range(new - 1):
            last = peer.step(last, [len(ids) + i for ids in w["streams"]])
        end = time.perf_counter()
        streams = {"aggregate_decode_tok_s": STREAMS * (new - 1) / (end - all_prefilled), "wall_s": end - started,
                   "tokens_after_all_prefilled": STREAMS * (new - 1), "generated_per_stream": [new] * STREAMS}

        peer.clear()
        started = time.perf_counter()
        peer.prefill(w["prefill"], 0)
        ttft = time.perf_counter() - started
        out.append({"single": single, "streams": streams,
                    "prefill": {"tok_s": len(w["prefill"]) / ttft, "ttft_s": ttft}})
    return out


def llama_cpp_child() -> int:
    json.dump(llama_cpp_runs(json.load(sys.stdin)), sys.stdout)
    return 0


def run_llama_cpp(job: dict) -> list[dict] | None:
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--llama-cpp-child"],
                          input=json.dumps(job), capture_output=True, text=True)
    if proc.returncode == 0:
        return json.loads(proc.stdout)
    sys.stderr.write(proc.stderr[-4000:])
    why = "died of SIGILL: this build uses instructions this CPU lacks" if proc.returncode == -4 \
        else f"exited with {proc.returncode}"
    print(f"llama.cpp (llama-cpp-python) {why}. Rebuild it for this CPU:\n  {install_hint()}", file=sys.stderr)
    return None


# ---- report -----------------------------------------------------------------------------

def best(runs: list[dict], scenario: str, key: str, lower: bool = False) -> dict:
    return (min if lower else max)((r[scenario] for r in runs), key=lambda r: r[key])


def agreement(a: list[int], b: list[int]) -> int:
    """Greedy tokens the two engines share before they first differ."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def summarize(runs: list[dict]) -> dict:
    single = {k: v for k, v in best(runs, "single", "decode_tok_s").items() if k != "tokens"}
    return {"single": single, "streams": best(runs, "streams", "aggregate_decode_tok_s"),
            "streams_wall_s": best(runs, "streams", "wall_s", lower=True)["wall_s"],
            "prefill": best(runs, "prefill", "tok_s")}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=2, help="timed runs; the best is reported")
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp threads")
    parser.add_argument("--llama-cpp-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.llama_cpp_child:
        return llama_cpp_child()
    if importlib.util.find_spec("llama_cpp") is None:
        print("llama-cpp-python is not installed; this benchmark needs it (motet does not). "
              f"Install it with:\n  {install_hint()}", file=sys.stderr)
        return 2

    import trio

    from motet.model import default_model_path, load_model

    started = time.perf_counter()
    model = load_model()
    runs = [workload(model, run) for run in range(args.repeats + 1)]  # run 0: untimed
    job = {"model": str(default_model_path()), "threads": args.threads,
           "n_ctx": STREAMS * -(-(PREFILL_PROMPT + NEW_TOKENS) // 256) * 256,  # cells per sequence
           "runs": [asdict(w) for w in runs]}
    peer = run_llama_cpp(job)
    if peer is None:
        return 3
    peer_rss_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024  # the child, its peak
    ours = trio.run(motet_runs, model, runs)
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    ours, peer = ours[1:], peer[1:]
    m, p = summarize(ours), summarize(peer)
    m["peak_rss_mb"], p["peak_rss_mb"] = rss_mb, peer_rss_mb
    ratios = {"single_decode": m["single"]["decode_tok_s"] / p["single"]["decode_tok_s"],
              "streams_decode": m["streams"]["aggregate_decode_tok_s"] / p["streams"]["aggregate_decode_tok_s"],
              "streams_wall_time": m["streams_wall_s"] / p["streams_wall_s"],
              "prefill": m["prefill"]["tok_s"] / p["prefill"]["tok_s"],
              "peak_rss": rss_mb / peer_rss_mb}
    result = {
        "model": job["model"], "llama_cpp_threads": args.threads, "timed_runs": args.repeats,
        "reported": "best of the timed runs; ratios are motet / llama.cpp",
        "workload": {"single_prompt_tokens": [len(w.single) for w in runs[1:]], "new_tokens": NEW_TOKENS,
                     "streams": STREAMS, "stream_prompt_tokens": STREAM_PROMPT,
                     "prefill_prompt_tokens": PREFILL_PROMPT},
        "motet": m, "llama_cpp": p, "ratios": ratios,
        "greedy_agreement_tokens": [agreement(a["single"]["tokens"], b["single"]["tokens"])
                                    for a, b in zip(ours, peer)],
        "run_s": time.perf_counter() - started,
    }
    print(json.dumps(result, indent=1))
    rows = [("decode, 1 stream (tok/s)", m["single"]["decode_tok_s"], p["single"]["decode_tok_s"]),
            (f"decode, {STREAMS} streams (tok/s)", m["streams"]["aggregate_decode_tok_s"],
             p["streams"]["aggregate_decode_tok_s"]),
            (f"{STREAMS} streams, wall (s)", m["streams_wall_s"], p["streams_wall_s"]),
            (f"prefill, {PREFILL_PROMPT} tokens (tok/s)", m["prefill"]["tok_s"], p["prefill"]["tok_s"]),
            ("peak RSS (MB)", rss_mb, peer_rss_mb)]
    print(f"\n{'':<30} {'motet':>8} {'llama.cpp':>9} {'ratio':>6}")
    for name, a, b in rows:
        print(f"{name:<30} {a:>8.1f} {b:>9.1f} {a / b:>6.2f}")
    gen = m["streams"]["generated_per_stream"]
    print(f"generated: motet {m['single']['generated']} (1 stream), {min(gen)}-{max(gen)} per stream "
          f"({m['streams']['stopped_early']} stopped early); llama.cpp {NEW_TOKENS} everywhere (no EOS stop)")
    print(f"greedy tokens shared before the engines diverge (1 stream, per run): "
          f"{result['greedy_agreement_tokens']} (near-tied logits: llama.cpp quantizes activations)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
