"""What the scheduler tells beyond a request's own stream: each step's expert routing,
to the expert cache (its heat) and to the telemetry subscribers, and each turn's end."""

from __future__ import annotations

import numpy as np
import trio

from ..runtime.api import StepRouting, Telemetry, TurnReport, TurnStats
from ..runtime.experts import turn_entropy, turn_perf
from .active_request import Active, add_routing
from .expert_cache import ExpertCache, TurnEnded
from .runner import ExpertStep, ModelRunner


class Publisher:
    def __init__(self, runner: ModelRunner, experts: ExpertCache | None):
        cfg = runner.model.config
        self.runner = runner
        self.experts = experts
        self.expert_zeros = np.zeros((sum(cfg.moe_layers), cfg.n_experts), np.int64)
        self.dense_layers = 0 if cfg.is_moe else cfg.n_layers
        self.subscribers: list[trio.MemorySendChannel] = []
        self.call: tuple[ExpertStep, int] | None = None  # the decode call being gathered: traffic, steps
        self.gathered: list[np.ndarray] = []

    def begin_call(self, step: ExpertStep, steps: int) -> None:
        """A decode call of `steps` steps: its rows' routing is gathered and published
        once (a step at a time it was a third of the Trio thread's time at one stream)."""
        self.call, self.gathered = (step, steps), []

    def gather(self, parts: list[np.ndarray]) -> None:
        self.gathered += parts

    def flush(self, last: bool = False) -> None:
        """Publishes what the call has gathered: at its end (last), or before a turn it
        served ends (report), so the expert cache has seen the turn's tokens first; the
        call's later steps then follow at its end."""
        if self.call is None:
            return
        (step, steps), parts = self.call, self.gathered
        if parts or steps:
            self.routing(parts, len(parts), step, steps)
        self.call, self.gathered = (None if last else (ExpertStep(), 0)), []

    def routing(self, experts: list[np.ndarray], tokens: int, step: ExpertStep, steps: int = 1) -> None:
        """Which experts a device call of `steps` decode steps used ([MoE layers, ...]
        ids per part), and its pool traffic."""
        if self.experts is None and not self.subscribers:
            return
        counts = self.expert_zeros.copy()
        add_routing(counts, experts)
        if self.experts is not None and counts.size:
            self.experts.observe_nowait(counts)
        if self.subscribers:
            counts.flags.writeable = False  # every subscriber gets this one array
            self._publish(StepRouting(counts, tokens, step.lookups, step.hits, step.moves, step.tiers, steps))

    def turn_ended(self, telemetry: Telemetry) -> None:
        self._publish(telemetry)
        if self.experts is not None:
            try:
                self.experts.inbox.send.send_nowait(TurnEnded())
            except trio.WouldBlock:
                pass  # the heat is saved at a later turn's end, or at shutdown

    def report(self, stats: TurnStats, telemetry: Telemetry, act: Active) -> TurnReport:
        self.flush()
        entropy = turn_entropy(telemetry.expert_counts, self.dense_layers)
        hit_pct = 100.0 * act.pool_hits / act.pool_lookups if act.pool_lookups else 100.0
        return TurnReport(turn_perf(stats, telemetry), entropy, gpus=self.runner.expert_tiers().gpus,
                          repin=tuple(act.repin), hit_pct=hit_pct)

    def _publish(self, event: Telemetry | StepRouting) -> None:
        for ch in list(self.subscribers):
            try:
                ch.send_nowait(event)
            except trio.WouldBlock:
                pass  # a slow subscriber misses a turn rather than stalling decode
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                self.subscribers.remove(ch)
