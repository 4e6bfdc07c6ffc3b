"""What the host's side of a decode step costs one stream: the pipelined loop the engine
runs (dispatch step t + 1, then read step t back), timed in one process.

    .venv/bin/python benchmarks/dispatch.py [--files default,moe-q4km] [--rounds 6] [--steps 400]
                                            [--burn 0,0.5,1]

Two parts, each a set of forms that take turns round after round (the machine is
shared), each round reporting the wall time a step and the median CPU time of the
dispatching thread a step (`time.thread_time`):
  write  the sampled step storing its own K and V rows (forward.decode_sampled, one
         call) against the step and kv_writes.write_rows as two calls, as before
         2026-12-06;
  burn   the loop as committed, with a second Python thread handed a task each step that
         burns --burn milliseconds of CPU: what host time outside the dispatch costs a
         step on this machine.
Prints JSON, then a table (the range over the rounds).
"""

from __future__ import annotations

import argparse
import json
import queue
import sys
import threading
import time
from pathlib import Path

import numpy as np

from motet.model import forward, load_model
from motet.model.generate import padded_rows, read_decode
from motet.model.kv import KVGeometry, init_kv
from motet.model.kv_writes import write_rows

GEO = KVGeometry(n_slots=16, max_context=768, chunk=256)  # peers.py's engine


class Burner:
    """A thread that burns the CPU time it is handed, as the Trio thread spends its own."""

    def __init__(self):
        self.tasks: queue.SimpleQueue[float | None] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while (ms := self.tasks.get()) is not None:
            end = time.thread_time() + ms / 1e3
            while time.thread_time() < end:
                pass


class Loop:
    """One form's own caches and carry, and its pipelined steps."""

    def __init__(self, model, one_call: bool, burn_ms: float, burner: Burner):
        self.model, self.one_call, self.burn_ms, self.burner = model, one_call, burn_ms, burner
        self.kv = init_kv(model.config, GEO, model.kv_dtype)
        self.carry = forward.empty_carry(GEO.scratch_slot + 1)
        self.greedy = forward.greedy_sampling(1)

    def step(self, i: int):
        cfg, (k, v) = self.model.config, self.kv
        tok, slot, pos = padded_rows(GEO, [1], [0], [41 + i % 128])
        args = (tok, slot, pos, self.greedy, np.bool_(False), self.carry, np.ones(1, np.bool_))
        if self.one_call:
            k, v, packed, self.carry, _, _ = forward.decode_sampled(self.model.weights, k, v, *args, cfg=cfg)
        else:
            new_k, new_v, packed, self.carry, _, _ = forward._decode_sampled(
                self.model.weights, k, v, *args, cfg=cfg, moe_impl="auto", mesh=None)
            k, v = write_rows(k, v, new_k, new_v, slot, pos)
        self.kv = (k, v)
        return packed

    def run(self, steps: int) -> dict:
        previous, cpu = None, []
        started = time.perf_counter()
        for i in range(steps):
            t = time.thread_time()
            packed = self.step(i)
            cpu.append(time.thread_time() - t)
            if previous is not None:
                read_decode(self.model, previous, 1)
            if self.burn_ms:
                self.burner.tasks.put(self.burn_ms)
            previous = packed
        read_decode(self.model, previous, 1)
        return {"step_ms": (time.perf_counter() - started) / steps * 1e3, "dispatch_cpu_ms": float(np.median(cpu)) * 1e3}


def measure(model, forms: dict[str, tuple[bool, float]], rounds: int, steps: int, burner: Burner) -> dict:
    loops = {name: Loop(model, one_call, burn, burner) for name, (one_call, burn) in forms.items()}
    for loop in loops.values():
        loop.run(20)  # compiles
    out: dict[str, list[dict]] = {name: [] for name in loops}
    for r in range(rounds):
        for name in (list(loops) if r % 2 == 0 else list(loops)[::-1]):
            out[name].append(loops[name].run(steps))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", default="default,moe-q4km", help="as benchmarks/peers.py names them, or paths")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=400, help="steps a round")
    parser.add_argument("--burn", default="0,0.5,1", help="ms of CPU burned a step, for the burn part")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from peers import files

    burner = Burner()
    results = {}
    for name, path in files(args.files.split(",")).items():
        model = load_model(path)
        write = measure(model, {"two calls": (False, 0.0), "one call": (True, 0.0)}, args.rounds, args.steps, burner)
        burns = {f"burn {ms:g} ms": (True, ms) for ms in map(float, args.burn.split(","))}
        results[name] = {**write, **measure(model, burns, args.rounds, args.steps, burner)}
    burner.tasks.put(None)
    print(json.dumps(results, indent=1))
    print(f"\n{'file':<10} {'form':<16} {'ms a step':>14} {'dispatch CPU (ms)':>18}")
    for name, forms in results.items():
        for form, rounds in forms.items():
            wall = [r["step_ms"] for r in rounds]
            cpu = [r["dispatch_cpu_ms"] for r in rounds]
            print(f"{name:<10} {form:<16} {min(wall):>6.2f}-{max(wall):<6.2f} {min(cpu):>8.3f}-{max(cpu):<8.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
