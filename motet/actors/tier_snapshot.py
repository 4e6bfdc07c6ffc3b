"""Where a runner's experts are, as the telemetry reports it (ExpertTiers): all on the
device when resident, else the tiered pool's counts and traffic so far."""

from __future__ import annotations

import jax
import numpy as np

from ..model.expert_pool import DEVICE, ExpertPool
from ..model.model import Model
from ..model.tiered import EXPERT_KEYS
from ..runtime.api import ExpertTiers


def tiers_snapshot(model: Model, pool: ExpertPool | None, totals: np.ndarray, shared_bytes: int, rows: int,
                   cols: int) -> ExpertTiers:
    """totals: the pool's lookups, hits, guessed, right and routed so far; shared_bytes:
    the weights' bytes that are not experts; rows, cols: MoE layers and experts (a dense
    model: one always-on expert a layer)."""
    if pool is None:
        expert_bytes = sum(
            leaf.nbytes for layer in model.weights["layers"] for key, leaf in layer.items() if key in EXPERT_KEYS
        )
        n = rows * cols
        return ExpertTiers("resident", rows, cols, bytes([DEVICE]) * n, n, 0, 0,
                           (shared_bytes + expert_bytes) / 1e9, 0.0, cols, gpus=_gpus(n))
    device, ram, disk = pool.counts()
    lookups, hits, guessed, right, routed = (int(x) for x in totals)
    return ExpertTiers(
        "tiered", rows, cols, pool.tier_map().tobytes(), device, ram, disk,
        (shared_bytes + pool.device_bytes()) / 1e9, pool.ram_bytes() / 1e9, pool.C,
        lookups, hits, guessed, right, routed, gpus=_gpus(device),
    )


def _gpus(experts: int) -> tuple[tuple[float, float, int], ...]:
    """Per GPU: memory used and total (GB, as the device reports them) and experts held
    (this engine places all on the first). None on a CPU-only host."""
    gpus = [d for d in jax.local_devices() if d.platform == "gpu"]
    out = []
    for i, device in enumerate(gpus):
        stats = device.memory_stats() or {}
        out.append((stats.get("bytes_in_use", 0) / 1e9, stats.get("bytes_limit", 0) / 1e9,
                    experts if i == 0 else 0))
    return tuple(out)
