"""Which experts deserve the device: heat per expert, a pinned hot set with hysteresis,
and the heat file that lets a restarted engine start warm. Plain code (no Trio, no JAX),
unit-tested on its own; the ExpertCache actor feeds it routing and sends its placements
to the runner, and the benchmark drives it directly.

Heat is a decayed frequency: each step, heat ← heat·decay + tokens routed to the expert.
Recency breaks ties (the expert seen last ranks higher).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import get_args

import numpy as np

from ..model.expert_pool import Placement
from ..runtime.config import ExpertPolicyKind

log = logging.getLogger(__name__)

HEAT_FORMAT = "motet-heat"
HEAT_VERSION = 1
POLICIES = get_args(ExpertPolicyKind)


@dataclass(frozen=True)
class PolicySettings:
    kind: ExpertPolicyKind = "heat"  # "heat": pinned hot set + rank; "lru": least recently used only
    decay: float = 0.97  # per step; a half-life of about 23 steps
    hysteresis: float = 0.5  # a pinned expert stays unless a challenger is 1.5x hotter
    # Of the pool's slots (at most C - k); the rest float, least recently used first out.
    # A quarter measured best on the benchmark's traces; more pins starve the floating
    # slots that follow a passage's experts.
    pin_fraction: float = 0.25
    prefetch: bool = True  # guess the next layer's experts from this layer's hidden state
    # Steps between placements: the hot set moves slowly (hysteresis), and a placement
    # costs a few tenths of a millisecond of host time.
    every: int = 4

    def __post_init__(self):
        if self.kind not in POLICIES:
            raise ValueError(f"expert policy must be one of {POLICIES}, got {self.kind!r}")
        if not 0 < self.decay <= 1:
            raise ValueError(f"decay must be in (0, 1], got {self.decay}")
        if self.hysteresis < 0 or not 0 <= self.pin_fraction <= 1:
            raise ValueError("hysteresis must be >= 0 and pin_fraction in [0, 1]")
        if self.every < 1:
            raise ValueError(f"every must be at least 1 step, got {self.every}")


class ExpertPolicy:
    """Heat over [R MoE layers, E experts]; placements for a pool of C slots per layer
    (top_k: experts per token, always left free-floating so a step's misses have room)
    and a RAM tier of ram_capacity experts (None: no limit)."""

    def __init__(self, layers: int, experts: int, pool_slots: int, top_k: int,
                 ram_capacity: int | None, settings: PolicySettings = PolicySettings(),
                 heat: np.ndarray | None = None):
        self.R, self.E, self.C = layers, experts, pool_slots
        self.settings = settings
        self.ram_capacity = ram_capacity
        self.heat = np.zeros((layers, experts)) if heat is None else np.array(heat, np.float64)
        self.last_seen = np.zeros((layers, experts), np.int64)
        self.step = 0
        self.pins = min(pool_slots - top_k, round(pool_slots * settings.pin_fraction))
        self.pinned: list[frozenset[int]] = [frozenset()] * layers

    def observe(self, counts: np.ndarray) -> None:
        """One step's routed tokens per (layer, expert)."""
        counts = np.asarray(counts)
        self.step += 1
        self.heat = self.heat * self.settings.decay + counts
        self.last_seen[counts > 0] = self.step

    def placement_due(self) -> bool:
        """Whether this step (the last observed) is one that re-places the experts."""
        return self.step % self.settings.every == 0

    def rank(self) -> np.ndarray:
        """Priority per (layer, expert): heat, recency breaking ties. LRU ranks nothing
        (the pool then evicts the least recently used slot)."""
        if self.settings.kind == "lru":
            return np.zeros((self.R, self.E))
        return self.heat + 1e-9 * self.last_seen / max(1, self.step)

    def placement(self) -> Placement:
        """The hot set per layer, with hysteresis: a pinned expert keeps its place while
        no unpinned one is (1 + hysteresis) times hotter; cold experts are never pinned."""
        rank = self.rank()
        if self.settings.kind == "lru" or self.pins <= 0:
            empty: tuple[frozenset[int], ...] = (frozenset(),) * self.R
            return Placement(empty, self._warm(rank, empty), rank)
        score = rank.copy()
        for r, incumbents in enumerate(self.pinned):
            score[r, list(incumbents)] *= 1 + self.settings.hysteresis
        best = np.argsort(-score, axis=1, kind="stable")[:, : self.pins]
        hot = np.take_along_axis(self.heat, best, axis=1) > 0
        pinned = [frozenset(row[keep].tolist()) for row, keep in zip(best, hot)]
        self.pinned = pinned
        return Placement(tuple(pinned), self._warm(rank, pinned), rank)

    def _warm(self, rank: np.ndarray, pinned) -> tuple[frozenset[int], ...]:
        """Experts worth holding in RAM: the hottest of the rest, as many as RAM holds."""
        if self.settings.kind == "lru":
            return (frozenset(),) * self.R
        hot = self.heat > 0
        for r, experts in enumerate(pinned):
            hot[r, list(experts)] = False
        flat = np.flatnonzero(hot)
        flat = flat[np.argsort(-rank.reshape(-1)[flat], kind="stable")][: self.ram_capacity]
        return tuple(frozenset((flat[flat // self.E == r] % self.E).tolist()) for r in range(self.R))

    def heat_levels(self) -> np.ndarray:
        """EMAP's 6-bit heat: log2 bucket of the decayed heat, 0 … 63."""
        return np.minimum(63, np.ceil(np.log2(1 + self.heat))).astype(np.uint8)


# ---- the heat file ----------------------------------------------------------------


def save_heat(path: Path, fingerprint: str, heat: np.ndarray) -> None:
    """Write atomically (a temporary file renamed over), so a crash never leaves half."""
    body = {"format": HEAT_FORMAT, "version": HEAT_VERSION, "model": fingerprint,
            "shape": list(heat.shape), "heat": [[round(float(h), 4) for h in row] for row in heat]}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(body))
    tmp.replace(path)


def load_heat(path: Path, fingerprint: str, shape: tuple[int, int]) -> np.ndarray | None:
    """The saved heat, or None (with a warning saying why) when the file is missing,
    damaged or for another model; never raises for a bad file."""
    if not path.exists():
        return None
    try:
        body = json.loads(path.read_text())
        if body.get("format") != HEAT_FORMAT or body.get("version") != HEAT_VERSION:
            raise ValueError("not a motet heat file of this version")
        if body.get("model") != fingerprint:
            raise ValueError(f"it is for model {body.get('model')!r}, not {fingerprint!r}")
        heat = np.asarray(body["heat"], np.float64)
        if heat.shape != tuple(shape) or tuple(body.get("shape", ())) != tuple(shape):
            raise ValueError(f"its shape {heat.shape} is not {tuple(shape)}")
        if not np.all(np.isfinite(heat)) or (heat < 0).any():
            raise ValueError("it holds negative or non-finite heat")
        return heat
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("ignoring the expert heat file %s: %s", path, exc)
        return None


def default_heat_path(model_path: Path, cache_dir: Path) -> Path:
    """Next to the model (a directory's own file, or `<file>.motet-heat.json`), or under
    cache_dir when that folder is not writable."""
    model_path = Path(model_path)
    folder = model_path if model_path.is_dir() else model_path.parent
    name = "motet-heat.json" if model_path.is_dir() else model_path.name + ".motet-heat.json"
    if folder.is_dir() and os.access(folder, os.W_OK):
        return folder / name
    digest = hashlib.sha256(str(model_path.resolve()).encode()).hexdigest()[:12]
    return cache_dir / f"{model_path.name}-{digest}.json"


# ---- the plan: resident or tiered, and the pool size ---------------------------------


@dataclass(frozen=True)
class ExpertPlan:
    mode: str  # "resident" or "tiered"
    layers: int  # MoE layers R
    experts: int  # per layer E
    pool_slots: int  # device slots per layer C (E when resident)
    ram_capacity: int | None  # experts RAM may hold, over all layers; None: no limit
    expert_bytes: int


def plan_experts(cfg, settings, expert_bytes: int, shared_bytes: int) -> ExpertPlan:
    """Resident or tiered, from the model's size and the budgets (ExpertSettings).
    expert_bytes: one expert's (quantized, as the file holds it, or floats); shared_bytes:
    the weights that are not experts (always on the device). A budget below one token's
    experts per layer (top-k) is an error, said now, not mid-request."""
    R, E, k = sum(cfg.moe_layers), cfg.n_experts, cfg.n_experts_per_tok
    if not cfg.is_moe:
        return ExpertPlan("resident", R, E, E, None, expert_bytes)
    ram = None if settings.ram_gb is None else int(round(settings.ram_gb * 1e9)) // expert_bytes
    slots = E
    if settings.device_experts_per_layer:
        slots = min(E, settings.device_experts_per_layer)
    elif settings.device_gb is not None:
        room = int(round(settings.device_gb * 1e9)) - shared_bytes
        slots = max(0, min(E, room // (R * expert_bytes)))
    if settings.mode == "resident":
        if slots < E:
            log.warning("resident experts forced: all %d per layer on the device, over the budget", E)
        return ExpertPlan("resident", R, E, E, ram, expert_bytes)
    if slots < k:
        need = (shared_bytes + R * k * expert_bytes) / 1e9
        raise ValueError(
            f"the device budget holds {slots} experts per MoE layer, but each token is routed "
            f"to {k}: give at least {k} experts per layer (about {need:.3f} GB with the "
            f"{shared_bytes / 1e9:.3f} GB of shared weights)"
        )
    mode = "tiered" if settings.mode == "tiered" or slots < E else "resident"
    return ExpertPlan(mode, R, E, slots, ram, expert_bytes)
