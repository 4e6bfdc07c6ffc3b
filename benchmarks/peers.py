"""motet against llama.cpp on the same GGUF files, the same token ids, side by side in
one run: single-stream decode, 16 concurrent streams, and a 512-token prefill.

    .venv/bin/python benchmarks/peers.py [--files default,moe-q4km,moe-q8] [--repeats N] [--rounds R]
                                         [--threads T] [--kv float16|8-bit] [--activations int16|int8]

The files: the default model (SmolLM2-135M-Instruct, Q4_1), and a generated MoE of
realistic shape (benchmarks/moe_gguf.py: Qwen3-MoE layout, 12 layers, 32 experts, top-4,
d=512) quantized by llama.cpp itself to Q4_K_M and to Q8_0.

llama.cpp runs through llama-cpp-python's low-level API (a benchmark-only dependency,
not one of motet's) in a child process, so a build that crashes on this CPU is reported
rather than taking the run down; motet's Engine runs in a child process of its own.

What is measured per file, in each engine's child (the best of --repeats timed runs,
after an untimed run of every scenario); with --rounds R, both children R times, which
one goes first alternating, and the median of each figure and of each round's ratio
(peers_report.py): on a shared machine one engine's figures can move by a quarter
between two runs minutes apart.
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
            wall time from submitting the first prompt to the last token. motet reads the
            prompts one after another with decode steps between them, so its first streams
            end first and its last steps decode fewer rows; each round also prints motet's
            tokens a second while all 16 decode (to the first stream's end), as llama.cpp's
            side, which reads every prompt before decoding, does throughout.
  prefill   512-token prompt: prompt tokens / time to the first token.
  overhead  motet only: the bare jitted decode step of one row (decode, KV write,
            sampling, the token read back; no scheduler, no Trio), timed in the same
            process, against the engine's time per token at one stream: what the runtime
            around the step costs, less what the engine's pipelined steps hide (the next
            step runs while the host reads one), so it may be below zero. Likewise the
            bare step of 16 rows against the engine's step while all 16 streams decode.
  --activations int8 loads motet's side with x rounded to int8 in its products (the CLI's
  --activations), as llama.cpp rounds it; the default keeps int16.
  reads     the weight bytes a decode token reads, in each file's heading: motet's from its
            loaded model (`motet info`'s figure), llama.cpp's summed from the file's own
            tensor types (llama_cpp_peer.decode_bytes).

Both engines see identical ids, built with motet's tokenizer. llama.cpp never stops on
EOS; motet does, so the prompts ask for long essays and the output reports what each
engine actually generated. Each run uses different prompts so motet's slots cannot reuse
an earlier run's KV (beyond the shared chat-template opening, reported as reused tokens).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import resource
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import peers_report as report
from llama_cpp_peer import decode_bytes, install_hint, llama_cpp_runs

STREAMS = 16
STREAM_PROMPT = 256
PREFILL_PROMPT = 512
NEW_TOKENS = 128

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
            # the streams were prefilled one after another, so the first ones end first: until
            # then every step decodes all of them (llama.cpp's side decodes them all throughout)
            first_end = min(t["stamps"][-1] for t in traces)
            together = sum(sum(1 for s in t["stamps"] if all_prefilled < s <= first_end) for t in traces)
            streams = {"aggregate_decode_tok_s": after / (end - all_prefilled), "wall_s": end - started,
                       "all_decoding_tok_s": together / (first_end - all_prefilled) if first_end > all_prefilled
                       else 0.0,
                       "tokens_after_all_prefilled": after,
                       "generated_per_stream": [len(t["tokens"]) for t in traces],
                       "stopped_early": sum(t["finish_reason"] != "length" for t in traces),
                       "reused_tokens_max": max(t["reused_tokens"] for t in traces)}

            long = await motet_stream(engine, w.prefill, 1)
            ttft = long["stamps"][0] - long["submitted"]
            prefill = {"tok_s": len(w.prefill) / ttft, "ttft_s": ttft, "reused_tokens": long["reused_tokens"]}
            out.append({"single": single, "streams": streams, "prefill": prefill})
    return out


def bare_step_ms(model, context: int, rows: int = 1, repeats: int = 30) -> float:
    """A step of `rows` rows with nothing around it: the engine's jitted step with its
    greedy sampling, its KV write, the tokens read back to the host each step (as the
    engine did before it pipelined its steps). One row at positions from 64, fed what it
    sampled, as the one stream's answer; many in slots of their own from STREAM_PROMPT,
    as the streams', each fed a token of its own: over an empty cache, rows fed the same
    token route to the same experts, and a 16-row step of the MoE files then reads about
    a seventh of the experts 16 conversations read."""
    from motet.model.forward import empty_carry, greedy_sampling
    from motet.model.generate import dispatch_decode, read_decode
    from motet.model.kv import KVGeometry, init_kv

    geo = KVGeometry(n_slots=STREAMS, max_context=context, chunk=256)
    kv = init_kv(model.config, geo, model.kv_dtype)
    greedy, carry = greedy_sampling(rows), empty_carry(geo.scratch_slot + 1)
    vocab = model.config.vocab_size
    tokens, slots, start = [1 + r for r in range(rows)], list(range(rows)), 64 if rows == 1 else STREAM_PROMPT
    best = float("inf")
    for attempt in range(4):  # the first compiles
        started = time.perf_counter()
        for i in range(repeats):
            packed, kv, carry, _, _ = dispatch_decode(model, kv, geo, tokens, slots, [start + i] * rows, greedy,
                                                      False, carry)
            drawn = [int(t) for t in read_decode(model, packed, rows)[0][0][:rows]]
            tokens = drawn if rows == 1 else [1 + (131 * (i * rows + r) + 7) % (vocab - 1) for r in range(rows)]
        if attempt:
            best = min(best, (time.perf_counter() - started) / repeats)
    return best * 1e3


def motet_child_runs(job: dict) -> dict:
    import trio

    from motet.model import load_model

    model = load_model(job["model"], kv_dtype="int8" if job["kv"] == "8-bit" else "auto",
                       activations=job["activations"])
    runs = [Workload(**w) for w in job["runs"]]
    context = job["n_ctx"] // STREAMS
    out = trio.run(motet_runs, model, runs, context)
    peak_mb = peak_rss_mb()  # before the bare step's own KV
    return {"runs": out, "bare_step_ms": bare_step_ms(model, context),
            "bare_streams_step_ms": bare_step_ms(model, context, STREAMS, repeats=10), "peak_rss_mb": peak_mb,
            "kv_dtype": model.kv_dtype, "context": context, "decode_bytes": model.info()["decode_bytes"]}


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


# ---- both, in rounds ------------------------------------------------------------------

def compare(name: str, path: Path, args) -> tuple[dict, str] | None:
    """Both engines on one file, args.rounds times: the JSON result and its table."""
    from motet.model.loader import load_chat

    chat = load_chat(path)
    runs = [workload(chat, run) for run in range(args.repeats + 1)]  # run 0: untimed
    job = {"model": str(path), "threads": args.threads, "kv": args.kv, "activations": args.activations,
           "new_tokens": NEW_TOKENS,
           "n_ctx": STREAMS * -(-(PREFILL_PROMPT + NEW_TOKENS) // 256) * 256,  # cells per sequence
           "runs": [asdict(w) for w in runs]}
    rounds = []
    for i in range(args.rounds):
        order = ("llama.cpp", "motet") if i % 2 == 0 else ("motet", "llama.cpp")
        children = {}
        for which in order:
            children[which] = run_child(which, job)
            if children[which] is None:
                return None
        rounds.append(report.one_round(children["motet"], children["llama.cpp"], first=order[0]))
    combined = report.combine(rounds)
    result = {
        "file": name, "model": str(path), "bytes": path.stat().st_size, "kv": args.kv,
        "motet_activations": args.activations,
        "decode_bytes": {"motet": children["motet"]["decode_bytes"], "llama_cpp": decode_bytes(path)},
        "llama_cpp_threads": args.threads, "timed_runs": args.repeats,
        "reported": "per round the best of each engine's timed runs; over the rounds the median of each figure "
                    "and of each ratio (motet / llama.cpp, taken within a round)",
        "workload": {"single_prompt_tokens": [len(w.single) for w in runs[1:]], "new_tokens": NEW_TOKENS,
                     "streams": STREAMS, "stream_prompt_tokens": STREAM_PROMPT,
                     "prefill_prompt_tokens": PREFILL_PROMPT},
        **combined, "rounds": rounds,
    }
    reads = result["decode_bytes"]
    heading = (f"\n{name} ({path.name}, {path.stat().st_size / 1e6:.0f} MB), {args.rounds} round(s), motet's x in "
               f"{args.activations}; weights a "
               f"decode token reads: motet {reads['motet'] / 1e6:.1f} MB, llama.cpp {reads['llama_cpp'] / 1e6:.1f} MB")
    table = report.table(heading, rounds, combined, streams=STREAMS, prefill=PREFILL_PROMPT, new_tokens=NEW_TOKENS)
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
    parser.add_argument("--repeats", type=int, default=2, help="timed runs in each child; the best is taken")
    parser.add_argument("--rounds", type=int, default=1,
                        help="both engines this many times, alternating which goes first; medians reported")
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp threads")
    parser.add_argument("--kv", choices=("float16", "8-bit"), default="float16",
                        help="both KV caches: float16, or 8-bit (motet int8, llama.cpp q8_0)")
    parser.add_argument("--activations", choices=("int16", "int8"), default="int16",
                        help="what motet's quantized products round x to (llama.cpp rounds it to int8)")
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
