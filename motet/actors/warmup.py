"""What an engine compiles before it says it is ready: every shape its runner can run;
and the record of how the start went.

A request must never wait on a compiler, so the set is closed: each device call pads its
inputs to one of a few sizes that the KV geometry (model/kv.py) and the expert pool
(model/expert_pool.py) list, and the runner compiles and runs each of them once at start
(warm_up). The plan is plain data: `motet info` prints it without a device.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from ..model.attention import ATTN_BLOCK
from ..model.burst import BURST_ROWS, lower_decode_burst
from ..model.compilation import (
    CompileCount,
    CompileCounter,
    compile_workers,
    compiling_ahead,
    drop_lowerings,
    use_compile_cache,
)
from ..model.expert_pool import move_sizes
from ..model.forward import lower_decode, lower_decode_sampled, lower_prefill
from ..model.kv import KVGeometry, init_kv
from ..model.kv_writes import on_one_cpu
from ..model.logit_history import empty_history
from ..runtime.allocator import give_back_free
from ..runtime.api import StartupReport
from ..runtime.code_pages import give_back_code_pages
from .step_rows import FILLER_ROW, WARM_ROW, warm_constrained_row

if TYPE_CHECKING:
    from .runner import ModelRunner

log = logging.getLogger("motet.engines.engine")

PREFILL, DECODE, BURST, SLOT_WIDTH, EXPERT_MOVE = "prefill", "decode", "burst", "slot", "experts"

_UNITS = {PREFILL: "tokens", DECODE: "rows", BURST: "steps", SLOT_WIDTH: "positions", EXPERT_MOVE: "experts"}
_WHAT = {
    PREFILL: "prefill chunks (the step, its KV write, sampling the first token)",
    DECODE: "decode batches (the step, its KV write, sampling with top-p and top logprobs)",
    BURST: "one-row decode bursts (several steps a call, where the cache takes the native write)",
    SLOT_WIDTH: "slot reads and writes (sessions, handovers)",
    EXPERT_MOVE: "expert uploads and copies back (tiered pools)",
}


@dataclass(frozen=True)
class WarmShape:
    kind: str  # PREFILL, DECODE, BURST, SLOT_WIDTH or EXPERT_MOVE
    size: int  # tokens, rows, steps, positions or experts

    def __str__(self) -> str:
        return f"{self.kind} {self.size} {_UNITS[self.kind]}"


@dataclass(frozen=True)
class WarmupPlan:
    shapes: tuple[WarmShape, ...]

    @classmethod
    def of(cls, geo: KVGeometry, pool_slots: int | None = None, burst: int = 1) -> WarmupPlan:
        """The shapes of an engine with this geometry; pool_slots: its tiered pool's slots
        per layer (None: the experts are resident); burst: the most decode steps one call
        takes (model/burst.py; a tiered pool moves between steps, so takes one)."""
        shapes = [WarmShape(PREFILL, t) for t in geo.prefill_chunks()]
        shapes += [WarmShape(DECODE, b) for b in geo.decode_batches()]
        if burst > 1 and pool_slots is None:
            shapes.append(WarmShape(BURST, burst))
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
        """A line on stderr per warm-up step (warm_up's progress)."""
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


def warm_up(runner: ModelRunner, plan: WarmupPlan, progress: Callable[[str, int, int], None]) -> None:
    """Compile every shape of `plan` and run each once on the scratch slot (whose KV
    only ever holds padding rows), so no request waits on a compiler or on a first
    run. The big steps are traced one by one and compiled in threads, each shape
    run as soon as its steps are compiled (not on a group's leader: there every
    call is mirrored, and the followers compile as they repeat them).
    progress(what, done, total) after each compile and each run."""
    ahead = [] if runner.mirror is not None else list(_lowerings(runner, plan))
    total, done = len(ahead) + len(plan.shapes), 0

    def step(what: str) -> None:
        nonlocal done
        done += 1
        progress(what, done, total)

    prefill_s: dict[int, float] = {}  # each chunk size's run
    compiler_pages_held = True
    with compiling_ahead(ahead, workers=compile_workers(), done=lambda shape: step(f"compiled {shape}")) as wait:
        for shape in plan.shapes:
            if wait(shape) and compiler_pages_held:
                # Every executable is built: the compiler's pages, and the libraries' start-up
                # pages, are garbage until another compile, so they go now rather than count
                # in the warm-up's peak (and again at the end: what only a first run touched).
                give_back_code_pages()
                compiler_pages_held = False
            started = time.perf_counter()
            _warm_shape(runner, shape)
            if shape.kind == PREFILL:
                runner.wait_ready()
                prefill_s[shape.size] = time.perf_counter() - started
            step(f"ran {shape}")
    if any(shape.kind == PREFILL for shape in plan.shapes):
        # what a request with a penalty, a bias or a grammar adds: its slot's history
        # started, its first token sampled with it; and an n > 1 request's KV copy
        row, scratch = warm_constrained_row(runner.model.config.vocab_size), runner.geo.scratch_slot
        runner.prefill(scratch, [0], 0, row, ((0,), ((0, 1.0),)), forks=[(scratch, row)])
        runner.copy_min_tokens = copy_threshold(runner, prefill_s)
    runner.new_key(0)
    runner.wait_ready()
    runner.sample_seconds = 0.0
    _forget_warm_up_writes(runner)
    # Every step is compiled and run: the modules it was lowered to are garbage now, and
    # the pages they (and the cache just replaced) held go back rather than count until
    # reused.
    drop_lowerings()
    give_back_free()
    give_back_code_pages()


def _forget_warm_up_writes(runner: ModelRunner) -> None:
    """The KV cache and the samplers' history made anew: the warm-up wrote the scratch
    slot's KV (every layer, once its copy was timed) and a history row, and a new cache's
    zeros count in the resident set only once a conversation writes them
    (kv_writes.cache_zeros). Only where the cache is on one CPU device: on a mesh a new
    cache is a computation every process of the group runs."""
    if not on_one_cpu(runner.kv[0]):
        return
    cfg = runner.model.config
    runner.kv = init_kv(cfg, runner.geo, runner.model.kv_dtype)
    runner.history = empty_history(runner.geo.scratch_slot + 1, cfg.vocab_size)


def copy_threshold(runner: ModelRunner, prefill_s: dict[int, float]) -> int:
    """The fewest prompt tokens a copy of another slot's KV must save to beat reading
    them: a slot's copy (the best of three) against the prefill chunks the warm-up ran,
    each as long as the size it pads to."""
    scratch, copies = runner.geo.scratch_slot, []
    for _ in range(3):
        started = time.perf_counter()
        runner.copy_prefix(scratch, scratch, runner.geo.max_context)
        runner.wait_ready()
        copies.append(time.perf_counter() - started)
    copy_s, below, threshold = min(copies), 0, 0
    for size in sorted(prefill_s):
        if prefill_s[size] > copy_s:
            threshold = below + 1
            break
        below = size
    else:  # a copy costs more than the longest chunk: as many of those as it takes
        longest = max(prefill_s)
        threshold = longest * math.ceil(copy_s / prefill_s[longest])
    log.info("a slot's KV copy takes %.1f ms: it is used for prefixes of %d tokens or more", copy_s * 1e3,
             threshold)
    return threshold


def _lowerings(runner: ModelRunner, plan: WarmupPlan):
    """(shape, lower) of the big steps of the plan's shapes: the model's prefill and
    decode (tiered: those over the pools)."""
    k, v = runner.kv
    weights = runner.model.weights if runner.tiered is None else runner.tiered.pooled_weights()
    impl = "auto" if runner.tiered is None else runner.tiered.impl
    for shape in plan.shapes:
        decode = lower_decode if runner.tiered is not None else lower_decode_sampled
        lower = {PREFILL: lower_prefill, DECODE: decode}.get(shape.kind)
        if lower is not None:
            yield shape, partial(lower, weights, k, v, shape.size, cfg=runner.model.config, moe_impl=impl)
        elif shape.kind == BURST and runner.burst_steps([WARM_ROW]) == shape.size:
            yield shape, partial(lower_decode_burst, weights, k, v, BURST_ROWS, most=shape.size,
                                 cfg=runner.model.config, moe_impl=impl)


def _warm_shape(runner: ModelRunner, shape: WarmShape) -> None:
    """Run one shape on the scratch slot, past a block of history where the context
    has room, so the attention's history loop runs too."""
    geo, scratch, n = runner.geo, runner.geo.scratch_slot, shape.size
    if shape.kind == PREFILL:
        tokens = min(n, geo.max_context - 1)  # a prompt of this bucket's size that fits
        offset = max(0, min(ATTN_BLOCK, geo.max_context - 1 - tokens))
        if runner.tiered is None:
            runner.prefill(scratch, [0] * tokens, offset, FILLER_ROW)
        else:
            runner.warm_pool_prefill(n, offset, FILLER_ROW)
    elif shape.kind == DECODE:
        # sampled, with top-p, top candidates and penalties: every branch of the sampler runs
        position = min(ATTN_BLOCK, geo.max_context - 1)
        constrained = warm_constrained_row(runner.model.config.vocab_size)
        if runner.tiered is None:
            runner.decode([0] * n, [scratch] * n, [position] * n, [constrained] * n)
        else:
            runner.warm_pool_decode(n, position, [WARM_ROW, constrained])
    elif shape.kind == BURST:
        if runner.burst_steps([WARM_ROW]) == n:  # not where the cache or the mesh rules bursts out
            position = min(ATTN_BLOCK, geo.max_context - 1 - n)
            runner.collect_steps(runner.dispatch([0], [scratch], [position], [WARM_ROW], steps=n))
    elif shape.kind == SLOT_WIDTH:
        pairs = runner.read_layers(scratch, 0, 1, n)
        runner.write_layers(scratch, 0, pairs)
    elif shape.kind == EXPERT_MOVE:
        runner.warm_move(n)  # a plan has expert moves only for a tiered pool
    else:
        raise ValueError(f"no warm-up for {shape}")
