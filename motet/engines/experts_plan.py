"""Where an engine's experts live (resident or tiered, how many on the device and in
RAM), its heat file, and the policy that keeps the heat: decided once the model is
loaded, before the runner is built."""

from __future__ import annotations

import logging

from ..actors.expert_cache import ExpertCache, HeatFile
from ..actors.expert_policy import ExpertPlan, ExpertPolicy, PolicySettings, default_heat_path, plan_experts
from ..model.expert_source import expert_bytes
from ..model.model import Model
from ..model.tiered import shared_weight_bytes
from ..runtime.config import ExpertSettings

log = logging.getLogger("motet.engines.engine")


def plan_engine_experts(model: Model, settings: ExpertSettings
                        ) -> tuple[ExpertPlan, HeatFile | None, ExpertPolicy | None]:
    """(the plan; the heat file; the policy, None for a dense model). A lazily loaded
    model's experts stay in the file: the runner reads them in when the plan keeps them
    resident. A budget too small for the model raises ValueError."""
    cfg = model.config
    plan = plan_experts(cfg, settings, expert_bytes(model), shared_weight_bytes(model.weights))
    if not cfg.is_moe:
        return plan, None, None
    log.info("experts %s: %d of %d per layer on the device%s", plan.mode, plan.pool_slots, plan.experts,
             "" if plan.ram_capacity is None else f", at most {plan.ram_capacity} in RAM")
    path, heat_file = settings.heat_file, None
    if path is None and plan.mode == "tiered":
        path = default_heat_path(model.path, settings.heat_cache_dir)
    if path is not None:
        fingerprint = f"{cfg.arch}/{model.name}/{plan.layers}x{plan.experts}/d{cfg.hidden_size}"
        heat_file = HeatFile(path, fingerprint)
    heat = ExpertCache.read_heat(heat_file, (plan.layers, plan.experts))
    policy = ExpertPolicy(plan.layers, plan.experts, plan.pool_slots, cfg.n_experts_per_tok, plan.ram_capacity,
                          PolicySettings(kind=settings.policy, prefetch=settings.prefetch), heat)
    return plan, heat_file, policy
