"""What an engine compiles before it says it is ready: every shape its runner can run.

A request must never wait on a compiler, so the set is closed: each device call pads its
inputs to one of a few sizes that the KV geometry (model/kv.py) and the expert pool
(model/expert_pool.py) list, and the runner compiles and runs each of them once at start
(ModelRunner.warm_up). Plain data, no JAX: `motet info` prints the plan without a device.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..model.expert_pool import move_sizes
from ..model.kv import KVGeometry

PREFILL, DECODE, SLOT_WIDTH, EXPERT_MOVE = "prefill", "decode", "slot", "experts"

_UNITS = {PREFILL: "tokens", DECODE: "rows", SLOT_WIDTH: "positions", EXPERT_MOVE: "experts"}
_WHAT = {
    PREFILL: "prefill chunks (the step, its KV write, sampling the first token)",
    DECODE: "decode batches (the step, its KV write, sampling with and without top logprobs)",
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
