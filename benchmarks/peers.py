"""motet against llama.cpp on the same GGUF files, the same token ids, side by side in
one run: single-stream decode, 16 concurrent streams, and a 512-token prefill.

    .venv/bin/python benchmarks/peers.py [--files default,moe-q4km,moe-q8] [--repeats N] [--threads T]
                                         [--kv float16|8-bit]

The files: the default model (SmolLM2-135M-Instruct, Q4_1), and a generated MoE of
realistic shape (benchmarks/moe_gguf.py: Qwen3-MoE layout, 12 layers, 32 experts, top-4,
d=512) quantized by llama.cpp itself to Q4_K_M and to Q8_0.

llama.cpp runs through llama-cpp-python's low-level API (a benchmark-only dependency,
not one of motet's) in a child process, so a build that crashes on this CPU is reported
rather than taking the run down; motet's Engine runs in a child process of its own.

What is measured per file (best of --repeats timed runs, after an untimed run of every
scenario):
  peak RSS  each engine's process at its peak, with its own KV cache (motet's with malloc
            set as the motet command sets it: runtime/allocator.py). Both caches hold
            float16 (each engine's default for a quantized file) and the same positions a
            stream: llama.cpp's cells per sequence are motet's max_context. --kv 8-bit gives
            both 8-bit caches: motet's int8 (a float32 scale per position and KV head) and
            llama.cpp's q8_0 (a float16 scale per 32 values; its quantized V cache needs
            flash attention, on).
  single    greedy decode tokens/s after a short chat prompt: (generated - 1) / (time
            from the first token to the last), prefill excluded.
  streams   16 concurrent 256-token prompts, 128 greedy tokens each: tokens generated
            after every stream has finished its prefill / the time they took, and the
            wall time from submitting the first prompt to the last token.
  prefill   512-token prompt: prompt tokens / time to the first token.
  overhead  motet only: the bare jitted decode step of one row (decode, KV write,
            sampling, the token read back; no scheduler, no Trio), timed in the same
            process, against the engine's time per token at one stream: what the runtime
            around the step costs, less what the engine's pipelined steps hide (the next
            step runs while the host reads one), so it may be below zero.

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
GGML_Q8_0 = 8  # ggml_type: llama.cpp's 8-bit KV cache type
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
            "--force-reinstall --no-deps llama-cpp-python==0.3.36 && .venv/bin/pip install diskcache")


# ---- the workload -------------------------------------------------------------------

@dataclass(frozen=True)
class Workload:
    single: list[int]  # a short chat prompt
    streams: list[list[int]]  # STREAMS prompts of STREAM_PROMPT ids
    prefill: list[int]  # PREFILL_PROMPT ids


def chat_ids(chat, tag: str, topic: str, length: int | None) -> list[int]:
    """A ChatML prompt asking for a long essay; with `length`, notes padded or cut so the
    prompt is exactly `length` ids. `tag` opens the system message, so prompts of
    different runs share only the template's first tokens. chat: (tokenizer, render),
    as motet.model.load_chat gives them."""
    tokenizer, render = chat
    enc = tokenizer.encode
    fill = "\x00NOTES\x00"
    ask = f"write a very long, detailed essay about {topic}, in many sections."
    user = f"Notes:{fill}\n\nUsing these notes, {ask}" if length else ask[0].upper() + ask[1:]
    text = render([
        {"role": "system", "content": f"{tag}. You are a helpful writer of long essays."},
        {"role": "user", "content": user},
    ])
    if not length:
        return enc(text)
    head, tail = (enc(part) for part in text.split(fill))
    need = length - len(head) - len(tail)
    notes = enc(" " + NOTES * (need // 60 + 1))
    return head + notes[:need] + tail


def workload(chat, run: int) -> Workload:
    tag = f"Session {run}"
    return Workload(
        single=chat_ids(chat, tag, TOPICS[run % len(TOPICS)], None),
        streams=[chat_ids(chat, f"{tag}.{i}", TOPICS[(run + i) % len(TOPICS)], STREAM_PROMPT)
                 for i in range(STREAMS)],
        prefill=chat_ids(chat, f"{tag} long", TOPICS[(run + 7) % len(TOPICS)], PREFILL_PROMPT),
    )


def peak_rss_mb() -> float:
    """This process's peak resident memory (VmHWM). Not ru_maxrss: Linux carries that across
    exec, so a child would report its parent's peak when the parent's was the larger (as
    it is after the parent has written the MoE files)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


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


async def motet_runs(model, runs: list[Workload], context: int) -> list[dict]:
    """The first run is the untimed one that compiles every shape the others use.
    context: positions a stream may use, as llama.cpp's cells per sequence."""
    import trio

    from motet.engines.engine import Engine

    out = []
    async with Engine(model=model, kv_slots=STREAMS, max_context=context, prefill_chunk=256) as engine:
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


def bare_step_ms(model, context: int, repeats: int = 30) -> float:
    """One row's decode step with nothing around it: the engine's jitted step with its
    greedy sampling, its KV write, the token read back to the host each step (as the
    engine did before it pipelined its steps)."""
    from motet.model.forward import empty_carry, greedy_sampling
    from motet.model.generate import dispatch_decode, read_decode
    from motet.model.kv import KVGeometry, init_kv

    geo = KVGeometry(n_slots=STREAMS, max_context=context, chunk=256)
    kv = init_kv(model.config, geo, model.kv_dtype)
    greedy, carry = greedy_sampling(1), empty_carry(geo.scratch_slot + 1)
    token, best = 1, float("inf")
    for attempt in range(4):  # the first compiles
        started = time.perf_counter()
        for i in range(repeats):
            packed, kv, carry, _, _ = dispatch_decode(model, kv, geo, [token], [0], [64 + i], greedy, False, carry)
            token = int(read_decode(model, packed, 1)[0][0][0])
        if attempt:
            best = min(best, (time.perf_counter() - started) / repeats)
    return best * 1e3


def motet_child_runs(job: dict) -> dict:
    import trio

    from motet.model import load_model

    model = load_model(job["model"], kv_dtype="int8" if job["kv"] == "8-bit" else "auto")
    runs = [Workload(**w) for w in job["runs"]]
    context = job["n_ctx"] // STREAMS
    out = trio.run(motet_runs, model, runs, context)
    peak_mb = peak_rss_mb()  # before the bare step's own KV
    return {"runs": out, "bare_step_ms": bare_step_ms(model, context), "peak_rss_mb": peak_mb,
            "kv_dtype": model.kv_dtype, "context": context}


# ---- llama.cpp (in a child process) ---------------------------------------------------

class LlamaCpp:
    """A llama.cpp context for `n_seq` sequences, each with its own n_ctx / n_seq cells
    (llama-server's layout; one unified cache measured 4x slower at 16 streams here, as
    every sequence attends over all cells), driven batch by batch through the
    low-level API, greedy argmax in numpy."""

    def __init__(self, path: str, *, threads: int, n_ctx: int, n_seq: int, n_batch: int = 512,
                 eight_bit_kv: bool = False):
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
        if eight_bit_kv:
            cp.type_k = cp.type_v = GGML_Q8_0
            cp.flash_attn_type = 1  # enabled: a quantized V cache needs it
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
    peer = LlamaCpp(job["model"], threads=job["threads"], n_ctx=job["n_ctx"], n_seq=STREAMS,
                    eight_bit_kv=job["kv"] == "8-bit")
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


def child(which: str) -> int:
    """The body of a child process: the job on stdin, the result as JSON on stdout, the
    process's own peak RSS in it (each engine measured alone, each file afresh)."""
    job = json.load(sys.stdin)
    if which == "llama.cpp":
        result = {"runs": llama_cpp_runs(job), "peak_rss_mb": peak_rss_mb()}
    else:
        import os

        from motet.runtime.allocator import tune_malloc

        tune_malloc(os.environ)  # as the motet command sets its process
        result = motet_child_runs(job)
    real_stdout.write(json.dumps(result))
    return 0


def run_child(which: str, job: dict) -> dict | None:
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", which],
                          input=json.dumps(job), capture_output=True, text=True)
    if proc.returncode == 0:
        return json.loads(proc.stdout)
    sys.stderr.write(proc.stderr[-4000:])
    if which == "motet":
        print(f"motet's child exited with {proc.returncode}", file=sys.stderr)
        return None
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


def compare(name: str, path: Path, args) -> tuple[dict, str] | None:
    """Both engines on one file: the JSON result and its table."""
    from motet.model.loader import load_chat

    chat = load_chat(path)
    runs = [workload(chat, run) for run in range(args.repeats + 1)]  # run 0: untimed
    job = {"model": str(path), "threads": args.threads, "kv": args.kv,
           "n_ctx": STREAMS * -(-(PREFILL_PROMPT + NEW_TOKENS) // 256) * 256,  # cells per sequence
           "runs": [asdict(w) for w in runs]}
    peer = run_child("llama.cpp", job)
    ours = run_child("motet", job) if peer is not None else None
    if ours is None:
        return None
    m, p = summarize(ours["runs"][1:]), summarize(peer["runs"][1:])
    m["peak_rss_mb"], p["peak_rss_mb"] = ours["peak_rss_mb"], peer["peak_rss_mb"]
    token_ms = 1e3 / m["single"]["decode_tok_s"]
    m["bare_step_ms"], m["token_interval_ms"] = ours["bare_step_ms"], token_ms
    m["overhead_ms"] = token_ms - ours["bare_step_ms"]
    ratios = {"single_decode": m["single"]["decode_tok_s"] / p["single"]["decode_tok_s"],
              "streams_decode": m["streams"]["aggregate_decode_tok_s"] / p["streams"]["aggregate_decode_tok_s"],
              "streams_wall_time": m["streams_wall_s"] / p["streams_wall_s"],
              "prefill": m["prefill"]["tok_s"] / p["prefill"]["tok_s"],
              "peak_rss": m["peak_rss_mb"] / p["peak_rss_mb"]}
    result = {
        "file": name, "model": str(path), "bytes": path.stat().st_size, "kv": args.kv,
        "llama_cpp_threads": args.threads, "timed_runs": args.repeats,
        "reported": "best of the timed runs; ratios are motet / llama.cpp",
        "workload": {"single_prompt_tokens": [len(w.single) for w in runs[1:]], "new_tokens": NEW_TOKENS,
                     "streams": STREAMS, "stream_prompt_tokens": STREAM_PROMPT,
                     "prefill_prompt_tokens": PREFILL_PROMPT},
        "motet": m, "llama_cpp": p, "ratios": ratios,
        "greedy_agreement_tokens": [agreement(a["single"]["tokens"], b["single"]["tokens"])
                                    for a, b in zip(ours["runs"][1:], peer["runs"][1:])],
    }
    rows = [("decode, 1 stream (tok/s)", m["single"]["decode_tok_s"], p["single"]["decode_tok_s"]),
            (f"decode, {STREAMS} streams (tok/s)", m["streams"]["aggregate_decode_tok_s"],
             p["streams"]["aggregate_decode_tok_s"]),
            (f"{STREAMS} streams, wall (s)", m["streams_wall_s"], p["streams_wall_s"]),
            (f"prefill, {PREFILL_PROMPT} tokens (tok/s)", m["prefill"]["tok_s"], p["prefill"]["tok_s"]),
            ("peak RSS (MB)", m["peak_rss_mb"], p["peak_rss_mb"])]
    lines = [f"\n{name} ({path.name}, {path.stat().st_size / 1e6:.0f} MB)"]
    lines.append(f"{'':<30} {'motet':>8} {'llama.cpp':>9} {'ratio':>6}")
    for label, a, b in rows:
        lines.append(f"{label:<30} {a:>8.1f} {b:>9.1f} {a / b:>6.2f}")
    gen = m["streams"]["generated_per_stream"]
    lines.append(f"generated: motet {m['single']['generated']} (1 stream), {min(gen)}-{max(gen)} per stream "
                 f"({m['streams']['stopped_early']} stopped early); llama.cpp {NEW_TOKENS} everywhere "
                 "(no EOS stop)")
    lines.append(f"motet per token at 1 stream: {token_ms:.1f} ms; the bare step one at a time "
                 f"{ours['bare_step_ms']:.1f} ms; the difference {m['overhead_ms']:+.1f} ms (the runtime "
                 "around the step, less what pipelining hides)")
    lines.append(f"greedy tokens shared before the engines diverge (1 stream, per run): "
                 f"{result['greedy_agreement_tokens']} (near-tied logits: llama.cpp quantizes activations)")
    table = "\n".join(lines)
    print(table, file=sys.stderr)  # progress, while the next file runs
    return result, table


def files(names: list[str]) -> dict[str, Path]:
    from motet.model import default_model_path

    out = {}
    for name in names:
        if name == "default":
            out[name] = default_model_path()
        elif name in ("moe-q4km", "moe-q8"):
            from moe_gguf import moe_files

            made = moe_files()
            out[name] = made["Q4_K_M" if name == "moe-q4km" else "Q8_0"]
        else:
            out[name] = Path(name)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", default="default,moe-q4km,moe-q8",
                        help="comma-separated: default, moe-q4km, moe-q8 or paths of GGUF files")
    parser.add_argument("--repeats", type=int, default=2, help="timed runs; the best is reported")
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp threads")
    parser.add_argument("--kv", choices=("float16", "8-bit"), default="float16",
                        help="both KV caches: float16, or 8-bit (motet int8, llama.cpp q8_0)")
    parser.add_argument("--child", choices=("llama.cpp", "motet"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(args.child)
    if importlib.util.find_spec("llama_cpp") is None:
        print("llama-cpp-python is not installed; this benchmark needs it (motet does not). "
              f"Install it with:\n  {install_hint()}", file=sys.stderr)
        return 2
    started = time.perf_counter()
    results, tables = [], []
    for name, path in files(args.files.split(",")).items():
        compared = compare(name, path, args)
        if compared is None:
            return 3
        results.append(compared[0])
        tables.append(compared[1])
    real_stdout.write(json.dumps({"files": results, "run_s": time.perf_counter() - started}, indent=1) + "\n")
    real_stdout.write("\n".join(tables) + "\n")
    return 0


if __name__ == "__main__":
    # A child's stdout carries its JSON only: logs (and anything a library prints) go to stderr.
    real_stdout = sys.stdout
    sys.stdout = sys.stderr
    sys.exit(main())
