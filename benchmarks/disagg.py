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
import json
import os
import statistics
import sys
import tempfile
import time

import jax
import numpy as np
import trio

from motet.engine import Engine
from motet.model import default_model_path, load_model
from motet.protocol import wire

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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="512,2048,8191", help="prompt lengths in tokens")
    parser.add_argument("--rounds", type=int, default=2, help="measured rounds per size")
    parser.add_argument("--skip-split", action="store_true", help="only the handover costs")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    model = load_model()
    result = {"backend": jax.default_backend(), "model": str(default_model_path().name), "cores": os.cpu_count()}
    result["handover"] = trio.run(handover_costs, model, sizes, args.rounds)
    print(json.dumps(result, indent=1))
    print(f"\n{'tokens':>7} {'MB':>7} {'save':>8} {'tcp':>8} {'restore':>8} {'handover':>9} {'re-prefill':>11} "
          f"{'ratio':>6}   (ms)")
    for row in result["handover"]:
        print(f"{row['tokens']:>7} {row['bytes'] / 1e6:>7.1f} {row['save_ms']:>8.1f} {row['transfer_ms']:>8.1f} "
              f"{row['restore_ms']:>8.1f} {row['handover_ms']:>9.1f} {row['reprefill_ms']:>11.1f} "
              f"{row['reprefill_over_handover']:>6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
