"""Disaggregated serving, side by side in one run, on the default model (SmolLM2-135M).

    .venv/bin/python benchmarks/disagg.py [--sizes 512,2048,8191] [--rounds 2] [--skip-split]

1. Handover cost against re-prefill, per prompt length: one engine reads the prompt and
   saves the slot (a session file in /dev/shm); the bytes cross loopback TCP as K_LAYER
   frames (the wire the workers speak); a second engine restores them into a slot. Beside
   it, the second engine reading the same prompt itself. A handover pays off when
   save + transfer + restore is well under the re-prefill.
2. Time to first token of a long prompt, and the inter-token latency of 8 streams already
   decoding while it is read: one `motet mux` engine alone, then `motet serve --split`'s
   SplitEngine (a prefill engine and a decode engine, two processes). Split serving's
   point is that the long read no longer stalls the running decodes.

Both engines of a pair run on this host's CPU cores: on a 2-core machine the two
processes of the split compete for the same cores, which a split over two accelerators
does not. Numbers are medians of --rounds; nothing is compared across runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time

import jax
import trio
from engine_throughput import prompt_for

from motet.engines.engine import Engine
from motet.engines.mux_engine import MuxEngine
from motet.engines.split_children import open_split_engines
from motet.model import default_model_path, load_model
from motet.protocol import wire
from motet.runtime.api import TokenEvent
from motet.runtime.split_settings import SplitSettings

STREAMS = 8

TOPIC = ("The history of the printing press, from movable type in East Asia to Gutenberg's workshop and "
         "the newspapers, pamphlets and scientific journals that followed, and how each changed who could "
         "read, write and argue in public. ")


def prompt_ids(model, n: int, salt: int = 0) -> tuple[int, ...]:
    """n token ids of ordinary text (a different text per salt)."""
    ids = model.tokenizer.encode(f"Essay {salt}. " + TOPIC * (n // 20 + 2), add_special=False)
    return tuple(ids[:n])


def session_dir() -> str:
    shm = "/dev/shm"
    if os.path.isdir(shm) and os.access(shm, os.W_OK):
        return tempfile.mkdtemp(prefix="motet-disagg-", dir=shm)
    return tempfile.mkdtemp(prefix="motet-disagg-")


async def tcp_transfer(path: str) -> tuple[float, int]:
    """Send a session file's bytes over loopback TCP as K_LAYER frames of at most 32 MiB
    and decode them on the other side (checksums verified): (ms, bytes sent)."""
    data = open(path, "rb").read()
    piece = 32 << 20
    pieces = range(0, len(data), piece)
    received = trio.Event()
    got = []

    async def serve(stream):
        decoder = wire.FrameDecoder()
        while len(got) < len(pieces):
            chunk = await stream.receive_some(1 << 20)
            if not chunk:
                break
            for frame in decoder.feed(chunk):
                got.append(len(wire.decode_layer(frame.payload).data))
        received.set()

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(trio.serve_tcp, serve, 0)
        port = listeners[0].socket.getsockname()[1]
        started = time.perf_counter()
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        sent = 0
        for i, o in enumerate(pieces):  # checksums are part of the cost: made in the timing
            frame = wire.encode_frame(wire.K_LAYER, wire.encode_layer(i, 0, data[o : o + piece]))
            await stream.send_all(frame)
            sent += len(frame)
        await received.wait()
        ms = (time.perf_counter() - started) * 1000
        await stream.aclose()
        nursery.cancel_scope.cancel()
    assert sum(got) == len(data)
    return ms, sent


async def handover_costs(model, sizes: list[int], rounds: int) -> list[dict]:
    context = 8192
    folder = session_dir()
    rows = []
    async with (
        Engine(model, kv_slots=2, max_context=context) as prefill_engine,
        Engine(model, kv_slots=2, max_context=context) as decode_engine,
    ):
        for n in sizes:
            runs = []
            for r in range(rounds + 1):  # the first round compiles the shapes; not kept
                prompt = prompt_ids(model, n, salt=r)
                path = os.path.join(folder, f"{n}-{r}.session")
                await prefill_engine.erase_slot(0)
                started = time.perf_counter()
                await prefill_engine.prefill(prompt, slot=0)
                prefill_ms = (time.perf_counter() - started) * 1000
                saved = await prefill_engine.save_slot(0, path)
                transfer_ms, wire_bytes = await tcp_transfer(path)
                restored = await decode_engine.restore_slot(0, path)
                await decode_engine.erase_slot(1)
                started = time.perf_counter()
                await decode_engine.prefill(prompt, slot=1)
                reprefill_ms = (time.perf_counter() - started) * 1000
                os.unlink(path)
                if r:
                    runs.append(dict(prefill_ms=prefill_ms, save_ms=saved.ms, transfer_ms=transfer_ms,
                                     restore_ms=restored.ms, reprefill_ms=reprefill_ms,
                                     bytes=saved.bytes, wire_bytes=wire_bytes))
            row = {"tokens": n, **{k: statistics.median(run[k] for run in runs) for k in runs[0]}}
            row["handover_ms"] = row["save_ms"] + row["transfer_ms"] + row["restore_ms"]
            row["reprefill_over_handover"] = row["reprefill_ms"] / row["handover_ms"]
            rows.append(row)
    os.rmdir(folder)
    return rows


async def decode_under_a_long_prompt(engine, long_prompt: str, short_prompts: list[str]) -> dict:
    """STREAMS streams decode; once each has its first token, the long prompt arrives.
    Its time to first token, and the streams' gaps between tokens before it came and
    while it was read (until its first token)."""
    stamps: list[list[float]] = [[] for _ in short_prompts]
    all_going = trio.Event()
    marks = {}

    async def stream(i, cancel_scope):
        with cancel_scope:
            async with engine.stream(short_prompts[i], max_tokens=2000, slot=i) as events:
                async for event in events:
                    if isinstance(event, TokenEvent):
                        stamps[i].append(time.perf_counter())
                        if all(stamps) and not all_going.is_set():
                            all_going.set()

    scopes = [trio.CancelScope() for _ in short_prompts]
    async with trio.open_nursery() as nursery:
        for i, scope in enumerate(scopes):
            nursery.start_soon(stream, i, scope)
        await all_going.wait()
        await trio.sleep(2.0)  # the steady state before the long prompt
        marks["submitted"] = time.perf_counter()
        async with engine.stream(long_prompt, max_tokens=1, slot=STREAMS) as events:
            async for event in events:
                if "first" not in marks:
                    marks["first"] = time.perf_counter()
        await trio.sleep(1.0)
        for scope in scopes:
            scope.cancel()
    while engine.statistics().running:  # the cancels reach the engine: every slot free again
        await trio.sleep(0.05)

    def gaps(start, stop):
        return [b - a for ts in stamps for a, b in zip(ts, ts[1:]) if start <= a and b <= stop]

    before = gaps(marks["submitted"] - 2.0, marks["submitted"])
    during = gaps(marks["submitted"], marks["first"])
    # a gap spanning the submit or the first token counts as during
    during += [b - a for ts in stamps for a, b in zip(ts, ts[1:]) if a < marks["submitted"] < b or a < marks["first"] < b]
    return {
        "ttft_long_s": marks["first"] - marks["submitted"],
        "itl_before_median_ms": 1000 * statistics.median(before) if before else None,
        "itl_during_median_ms": 1000 * statistics.median(during) if during else None,
        "itl_during_max_ms": 1000 * max(during) if during else None,
        "tokens_during": len(during),
    }


async def split_or_not(long_tokens: int, context: int) -> dict:
    model_file = default_model_path()
    command = [sys.executable, "-m", "motet", "mux"]
    env = {"SNAP": str(model_file), "CTX": str(context), "KVSAVE": "0"}
    model = load_model(model_file)
    # Two runs compile every shape (a slot's second prompt shares its first token with
    # the first: a prefill with history); the third, on another long prompt, is measured.
    *warm, measured = (model.tokenizer.decode(list(prompt_ids(model, long_tokens, salt=s))) for s in (6, 7, 8))
    short = [model.render_chat(prompt_for(i)) for i in range(STREAMS)]
    openers = {
        "one engine": lambda: MuxEngine(command, env=env, kv_slots=STREAMS + 1),
        "split": lambda: open_split_engines(SplitSettings(min_prompt_tokens=min(1024, long_tokens // 2)), model_file,
                                            kv_slots=STREAMS + 1, max_context=context, command=command),
    }
    out = {}
    for name, opener in openers.items():
        async with opener() as engine:
            for prompt in warm:
                await decode_under_a_long_prompt(engine, prompt, short)
            before = engine.split_statistics().last if name == "split" else None
            out[name] = await decode_under_a_long_prompt(engine, measured, short)
            if name == "split":  # the measured prompt's handover
                last = engine.split_statistics().last
                out[name]["handover"] = None if last == before else dataclasses.asdict(last)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="512,2048,8191", help="prompt lengths in tokens")
    parser.add_argument("--rounds", type=int, default=2, help="measured rounds per size")
    parser.add_argument("--skip-split", action="store_true", help="only the handover costs")
    parser.add_argument("--long", type=int, default=3000, help="the long prompt's tokens in part 2")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    model = load_model()
    result = {"backend": jax.default_backend(), "model": str(default_model_path().name), "cores": os.cpu_count()}
    result["handover"] = trio.run(handover_costs, model, sizes, args.rounds)
    if not args.skip_split:
        result["long_prompt_tokens"] = args.long
        result["decode_under_long_prompt"] = trio.run(split_or_not, args.long, 4096)
    print(json.dumps(result, indent=1))
    print(f"\n{'tokens':>7} {'MB':>7} {'save':>8} {'tcp':>8} {'restore':>8} {'handover':>9} {'re-prefill':>11} "
          f"{'ratio':>6}   (ms)")
    for row in result["handover"]:
        print(f"{row['tokens']:>7} {row['bytes'] / 1e6:>7.1f} {row['save_ms']:>8.1f} {row['transfer_ms']:>8.1f} "
              f"{row['restore_ms']:>8.1f} {row['handover_ms']:>9.1f} {row['reprefill_ms']:>11.1f} "
              f"{row['reprefill_over_handover']:>6.2f}")
    if not args.skip_split:
        print(f"\n{STREAMS} streams decoding, then a {args.long}-token prompt:")
        print(f"{'':>12} {'TTFT long':>10} {'ITL before':>11} {'ITL during':>11} {'max gap':>9}   (s, ms)")
        for name, row in result["decode_under_long_prompt"].items():
            print(f"{name:>12} {row['ttft_long_s']:>10.2f} {row['itl_before_median_ms']:>11.1f} "
                  f"{row['itl_during_median_ms']:>11.1f} {row['itl_during_max_ms']:>9.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
