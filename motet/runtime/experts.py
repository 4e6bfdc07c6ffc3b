"""Expert telemetry as the fronts show it: the heat map (EMAP), the experts routed since
the last look (HITS), the per-layer routing entropy of a turn, and a turn's PERF figures.
Plain code, no Trio: the stdio bridge, the engine and the HTTP server each keep their own
ExpertMap and feed it the engine's routing, and with it the engine's tiers (where each
expert is: device, host RAM or disk) and the moves between them."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence

import numpy as np

from .api import ExpertState, ExpertTiers, Perf, StepRouting, Telemetry, TurnStats

DEVICE_TIER = 2  # EMAP's 2-bit tier: 0 disk, 1 host RAM, 2 device
MAX_HEAT = 63
HITS_EVERY = 6  # device steps per HITS snapshot ("about every 6 tokens", as the mux protocol)
REPIN_KEPT = 64  # recent moves onto the device an ExpertMap remembers
GPU_INDEX = 0  # the device experts move onto (one device per engine for now)


def device_moves(moves: Sequence[tuple[int, int, int, int]]) -> list[tuple[int, int, int, int]]:
    """REPIN entries (layer, expert, old tier, gpu) of the moves (layer, expert, old tier,
    new tier) that put an expert on the device; demotions show in the next EMAP/TIERS."""
    return [(r, e, old, GPU_INDEX) for r, e, old, new in moves if new == DEVICE_TIER]


class ExpertMap:
    """Heat per (MoE layer, expert) over the engine's life, and the experts routed since
    the last `take_hits`. A dense model is one always-on expert per layer."""

    def __init__(self, rows: int, cols: int):
        self.rows, self.cols = rows, cols
        # arrays, not lists: an engine adds a step's counts for every token it decodes
        self.heat = np.zeros((rows, cols), np.int64)
        self.hits = np.zeros((rows, cols), np.bool_)
        self.seq = 0  # HITS snapshots taken
        self.last_hits: bytes | None = None
        self.entropy: tuple[float, ...] = (0.0,) * rows
        self.tiers: ExpertTiers | None = None  # None: every expert on the device
        self.repin: deque[tuple[int, int, int, int]] = deque(maxlen=REPIN_KEPT)

    @classmethod
    def for_model(cls, config) -> ExpertMap:
        if config.is_moe:
            return cls(sum(config.moe_layers), config.n_experts)
        return cls(config.n_layers, 1)

    def add(self, counts) -> None:
        """Routed-token counts of some steps, per MoE layer, per expert ([rows, cols])."""
        counts = np.asarray(counts, np.int64)
        if counts.shape != self.heat.shape:  # += would broadcast a single row over all
            raise ValueError(f"counts of shape {counts.shape} for a {self.rows}x{self.cols} map")
        self.heat += counts
        self.hits |= counts > 0

    def add_step(self, step: StepRouting) -> None:
        if step.counts.size:
            self.add(step.counts)
        else:  # dense: each layer's one expert ran
            self.heat += step.tokens
            self.hits |= step.tokens > 0
        self.repin.extend(device_moves(step.moves))
        if step.tiers is not None:
            self.set_tiers(step.tiers)

    def set_tiers(self, tiers: ExpertTiers) -> None:
        if (tiers.rows, tiers.cols) != (self.rows, self.cols):
            raise ValueError(f"tiers of {tiers.rows}x{tiers.cols} experts for a {self.rows}x{self.cols} map")
        self.tiers = tiers

    def tier_counts(self) -> tuple[int, int, int]:
        """Experts on the device, in RAM, on disk (TIERS' first three fields)."""
        if self.tiers is None:
            return self.rows * self.cols, 0, 0
        return self.tiers.device, self.tiers.ram, self.tiers.disk

    def end_turn(self, entropy: Sequence[float]) -> None:
        self.entropy = tuple(entropy)

    def emap(self) -> bytes:
        """One byte per expert, row-major: tier << 6 | heat (log2 bucket of routed tokens)."""
        tiers = self.tiers.tiers if self.tiers is not None else bytes([DEVICE_TIER]) * (self.rows * self.cols)
        bit_length = np.frexp(self.heat.astype(np.float64))[1]  # n = m·2^e with m in [0.5, 1): e; 0 for 0
        heat = np.minimum(MAX_HEAT, bit_length).astype(np.uint8).reshape(-1)
        return (np.frombuffer(tiers, np.uint8) << 6 | heat).astype(np.uint8).tobytes()

    def hit_bits(self) -> bytes:
        """A bit per expert routed since the last take, most significant bit first."""
        return np.packbits(self.hits.reshape(-1)).tobytes()

    def take_hits(self) -> bytes:
        packed = self.last_hits = self.hit_bits()
        self.hits[:] = False
        self.seq += 1
        return packed

    def state(self) -> ExpertState:
        """A snapshot; its hits are those of the last take (the current ones before any)."""
        hits = self.last_hits if self.last_hits is not None else self.hit_bits()
        t = self.tiers
        return ExpertState(
            self.rows, self.cols, self.emap(), hits, self.seq, self.entropy, self.tier_counts(),
            tuple(self.repin), t.hit_rate if t is not None and t.lookups else None,
            t.prefetch_recall if t is not None else None,
        )


def turn_entropy(counts: Sequence[Sequence[int]], rows: int) -> tuple[float, ...]:
    """A turn's per-layer routing entropy; a dense model (no counts) is 0 per layer."""
    return tuple(entropy_bits(counts)) if counts else (0.0,) * rows


def entropy_bits(counts: Sequence[Sequence[int]]) -> list[float]:
    """Per layer, the entropy (bits) of the distribution of routed tokens over experts."""
    out = []
    for layer in counts:
        total = sum(layer)
        h = -sum(n / total * math.log2(n / total) for n in layer if n) if total else 0.0
        out.append(max(0.0, h))
    return out


def turn_perf(stats: TurnStats, telemetry: Telemetry | None) -> Perf:
    """The PERF figures motet measures: the turn's seconds; the seconds its steps spent
    moving experts onto the device (t_ewait) and, of those, reading the model file
    (t_edisk), both 0 while every expert lives on the device; the rest of the device
    seconds of prefill and decode (reported as the matmul time: attention is not timed
    apart); sampling seconds (the head)."""
    if telemetry is None:
        return Perf(dt=stats.total_s)
    device = telemetry.prefill_s + telemetry.decode_s
    return Perf(dt=stats.total_s, t_edisk=telemetry.expert_disk_s, t_ewait=telemetry.expert_wait_s,
                t_emm=max(0.0, device - telemetry.expert_wait_s), t_head=telemetry.sample_s)
