"""What an engine compiles before it says it is ready: every shape its runner can run;
and the record of how the start went.

A request must never wait on a compiler, so the set is closed: each device call pads its
inputs to one of a few sizes that the KV geometry (model/kv.py) and the expert pool
(model/expert_pool.py) list, and the runner compiles and runs each of them once at start
(ModelRunner.warm_up). The plan is plain data: `motet info` prints it without a device.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path

from ..model.compilation import CompileCount, CompileCounter, use_compile_cache
from ..model.expert_pool import move_sizes
from ..model.kv import KVGeometry
from ..runtime.api import StartupReport

log = logging.getLogger("motet.engines.engine")

PREFILL, DECODE, SLOT_WIDTH, EXPERT_MOVE = "prefill", "decode", "slot", "experts"

_UNITS = {PREFILL: "tokens", DECODE: "rows", SLOT_WIDTH: "positions", EXPERT_MOVE: "experts"}
_WHAT = {
    PREFILL: "prefill chunks (the step, its KV write, sampling the first token)",
    DECODE: "decode batches (the step, its KV write, sampling with top-p and top logprobs)",
    SLOT_WIDTH: "slot reads and writes (sessions, handovers)",
    EXPERT_MOVE: "expert uploads and copies back (tiered pools)",
}


@dataclass(frozen=True)
class WarmShape:
    kind: str  # PREFILL, DECODE, SLOT_WIDTH or EXPERT_MOVE
    size: int  # tokens, rows, positions or experts

    def __str__(self) -> str:
        return f"{self.kind} {self.size} {_UNITS[self.kind]}"


@dataclass(frozen=True)
class WarmupPlan:
    shapes: tuple[WarmShape, ...]

    @classmethod
    def of(cls, geo: KVGeometry, pool_slots: int | None = None) -> WarmupPlan:
        """The shapes of an engine with this geometry; pool_slots: its tiered pool's slots
        per layer (None: the experts are resident)."""
        shapes = [WarmShape(PREFILL, t) for t in geo.prefill_chunks()]
        shapes += [WarmShape(DECODE, b) for b in geo.decode_batches()]
        shapes += [WarmShape(SLOT_WIDTH, w) for w in geo.slot_widths()]
        if pool_slots is not None:
            shapes += [WarmShape(EXPERT_MOVE, n) for n in move_sizes(pool_slots)]
        return cls(tuple(shapes))

    def describe(self) -> list[str]:
        """One line per kind: how many sizes, which."""
        lines = []
        for kind, what in _WHAT.items():
            sizes = [s.size for s in self.shapes if s.kind == kind]
            if sizes:
                lines.append(f"{len(sizes)} {what}: {', '.join(map(str, sizes))} {_UNITS[kind]}")
        return lines


class StartupClock:
    """An engine's start from its first step to ready: the compilation cache turned on
    first, then every executable JAX needs counted (stop() ends the count), the times
    of the phases, and the executables needed after ready (0 unless a shape was missed)."""

    def __init__(self, compile_cache: Path | None):
        self.started = time.monotonic()
        self.cache_dir = use_compile_cache(compile_cache)
        self.counter = CompileCounter().start()
        self.loaded = self.warmed = self.started
        self.report: StartupReport | None = None
        self._at_ready = CompileCount()

    def progress(self, what: str, done: int, total: int) -> None:
        """A line on stderr per warm-up step (ModelRunner.warm_up's progress)."""
        log.info("warm-up: %s (%d of %d, %.1f s)", what, done, total, time.monotonic() - self.started)

    def ready(self, shapes: int) -> StartupReport:
        self._at_ready = count = self.counter.now()
        self.report = StartupReport(
            ready_s=time.monotonic() - self.started, load_s=self.loaded - self.started,
            warmup_s=self.warmed - self.loaded, shapes=shapes, compiled=count.compiled,
            from_cache=count.from_cache, cache_dir=None if self.cache_dir is None else str(self.cache_dir))
        r = self.report
        log.info("ready in %.1f s (model %.1f s; %d shapes in %.1f s: %d executables compiled, %d from the "
                 "cache)", r.ready_s, r.load_s, r.shapes, r.warmup_s, r.compiled, r.from_cache)
        return r

    def now(self) -> StartupReport | None:
        """The report with the executables needed since ready (None before ready)."""
        if self.report is None:
            return None
        return replace(self.report, compiles_after_ready=(self.counter.now() - self._at_ready).requests)

    def stop(self) -> None:
        self.counter.stop()
