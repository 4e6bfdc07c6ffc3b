"""One engine over several processes (jax.distributed), side by side with the same mesh in
one process, in one run: the tiny qwen3_moe checkpoint at ep=2,tp=2 served by `motet mux`.

    .venv/bin/python benchmarks/group.py [--streams 4] [--tokens 32]

  one process    4 virtual CPU devices, --mesh ep=2,tp=2
  two processes  2 virtual devices each, joined by jax.distributed (gloo), process 1
                 repeating process 0's device calls (docs/scaling.md)

Each runs a warm-up round (compiles), then `--streams` greedy requests at once, one per
slot. Reported: the wall time from the submits to the last DONE, and the aggregate decode
tokens/s. On one CPU host the virtual devices share the same cores and gloo crosses
loopback TCP, so the ratio shows the cost of the group's control and collectives, not
what several hosts would gain.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from motet.protocol import mux

REPO = Path(__file__).resolve().parent.parent
MODEL = REPO / "tests" / "golden" / "qwen3_moe"
MESH = "ep=2,tp=2"
PROMPT = b"Once upon a time"  # the random tiny model runs it to max_tokens without an end of turn
START_S = 600


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(processes: int, streams: int, logs: Path) -> list[subprocess.Popen]:
    """`motet mux` on MESH: one process with 4 devices, or a group of two with 2 each."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "SNAP": str(MODEL), "SERVE": "1", "SERVE_BATCH": "1",
           "KV_SLOTS": str(streams), "CTX": "512", "KVSAVE": "0",
           "XLA_FLAGS": f"--xla_force_host_platform_device_count={4 // processes}"}
    command = [sys.executable, "-m", "motet", "mux", "--mesh", MESH,
               "--compile-cache", str(REPO / ".jax_cache" / "group")]
    if processes > 1:
        command += ["--coordinator", f"127.0.0.1:{free_port()}", "--num-processes", str(processes)]
    procs = []
    for i in reversed(range(processes)):  # the followers first: process 0 waits for them
        ids = ["--process-id", str(i)] if processes > 1 else []
        leader = i == 0
        procs.insert(0, subprocess.Popen(
            [*command, *ids], env=env, cwd=REPO, stderr=open(logs / f"p{processes}-{i}.stderr", "wb"),
            stdin=subprocess.PIPE if leader else subprocess.DEVNULL,
            stdout=subprocess.PIPE if leader else subprocess.DEVNULL))
    return procs


def round_trip(leader: subprocess.Popen, decoder, first_id: int, streams: int, tokens: int) -> dict:
    """`streams` requests at once; the wall time until the last DONE, and the tokens."""
    started = time.perf_counter()
    for i in range(streams):
        leader.stdin.write(mux.encode_submit(mux.Submit(first_id + i, i, tokens, 0.0, 1.0, PROMPT)))
    leader.stdin.flush()
    done: dict[int, mux.Done] = {}
    deadline = time.monotonic() + START_S
    while len(done) < streams:
        if time.monotonic() > deadline:
            raise TimeoutError("no answer in time")
        data = os.read(leader.stdout.fileno(), 65536)
        if not data:
            raise RuntimeError("process 0 closed its stdout")
        for event in decoder.feed(data):
            if isinstance(event, mux.Error):
                raise RuntimeError(f"request {event.request_id}: {event.code}")
            if isinstance(event, mux.Done):
                done[event.request_id] = event
    wall = time.perf_counter() - started
    emitted = sum(d.emitted for d in done.values())
    return {"wall_s": wall, "tokens": emitted, "tok_s": emitted / wall}


def measure(processes: int, streams: int, tokens: int, logs: Path) -> dict:
    procs = start(processes, streams, logs)
    try:
        leader, decoder = procs[0], mux.ExtendedResponseDecoder()
        round_trip(leader, decoder, 1, streams, tokens)  # warm: every shape compiled
        result = round_trip(leader, decoder, 1 + streams, streams, tokens)
        leader.stdin.close()  # EOF: both processes finish and exit
        result["exit_codes"] = [p.wait(timeout=120) for p in procs]
        return result
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args(argv)
    logs = Path(tempfile.mkdtemp(prefix="motet-group-"))
    runs = {f"{n} process{'es' if n > 1 else ''}": measure(n, args.streams, args.tokens, logs) for n in (1, 2)}
    one, two = runs["1 process"], runs["2 processes"]
    result = {"model": MODEL.name, "mesh": MESH, "streams": args.streams, "tokens": args.tokens, "runs": runs,
              "two_over_one_tok_s": two["tok_s"] / one["tok_s"], "logs": str(logs)}
    print(json.dumps(result, indent=1))
    print(f"\n{'':>12} {'wall s':>8} {'tok/s':>8}  exit codes")
    for name, run in runs.items():
        print(f"{name:>12} {run['wall_s']:>8.2f} {run['tok_s']:>8.1f}  {run['exit_codes']}")
    print(f"two processes / one process: {result['two_over_one_tok_s']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
