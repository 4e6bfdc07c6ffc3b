"""The expert policy on its own: heat, the pinned hot set and its hysteresis, the RAM
warm set, the plan (resident or tiered, and the pool size) and the heat file."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import replace

import numpy as np
import pytest

from motet.actors.expert_policy import (
    ExpertPolicy,
    PolicySettings,
    default_heat_path,
    load_heat,
    plan_experts,
    save_heat,
)
from motet.model.config import ModelConfig
from motet.runtime.config import ExpertSettings

FP = "qwen3_moe/tiny/2x8/d64"


def counts(layers: int, experts: int, hits: dict[tuple[int, int], int]) -> np.ndarray:
    c = np.zeros((layers, experts))
    for (r, e), n in hits.items():
        c[r, e] = n
    return c


def test_heat_decays_and_recency_breaks_ties():
    p = ExpertPolicy(1, 4, pool_slots=4, top_k=1, ram_capacity=None, settings=PolicySettings(decay=0.5))
    p.observe(counts(1, 4, {(0, 0): 4}))
    p.observe(counts(1, 4, {(0, 1): 2}))
    assert p.heat[0].tolist() == [2.0, 2.0, 0.0, 0.0]
    rank = p.rank()[0]
    assert rank[1] > rank[0] > rank[2] == rank[3]  # equal heat: the one seen last ranks higher
    p.observe(counts(1, 4, {}))
    assert p.heat[0].tolist() == [1.0, 1.0, 0.0, 0.0]


def test_pins_leave_room_for_a_token_and_skip_cold_experts():
    p = ExpertPolicy(2, 8, pool_slots=4, top_k=2, ram_capacity=None, settings=PolicySettings(pin_fraction=1.0))
    assert p.pins == 2  # C - k: a step's misses always find a free-floating slot
    p.observe(counts(2, 8, {(0, 3): 5, (0, 5): 1, (0, 6): 3}))
    placement = p.placement()
    assert placement.pinned[0] == {3, 6}
    assert placement.pinned[1] == frozenset()  # nothing routed there yet: nothing pinned


def test_hysteresis_keeps_an_incumbent_until_a_challenger_is_clearly_hotter():
    p = ExpertPolicy(1, 4, pool_slots=3, top_k=2, ram_capacity=None,
                     settings=PolicySettings(decay=1.0, hysteresis=0.5))
    p.observe(counts(1, 4, {(0, 0): 10}))
    assert p.placement().pinned[0] == {0}
    p.observe(counts(1, 4, {(0, 1): 12}))  # 12 vs 10 · 1.5: not enough
    assert p.placement().pinned[0] == {0}
    p.observe(counts(1, 4, {(0, 1): 4}))  # 16 > 15
    assert p.placement().pinned[0] == {1}


def test_lru_ranks_nothing_and_pins_nothing():
    p = ExpertPolicy(1, 8, pool_slots=6, top_k=2, ram_capacity=4, settings=PolicySettings(kind="lru"))
    p.observe(counts(1, 8, {(0, 1): 9}))
    placement = p.placement()
    assert placement.pinned == (frozenset(),) and placement.warm == (frozenset(),)
    assert not placement.rank.any()


def test_the_warm_set_is_the_hottest_unpinned_experts_ram_can_hold():
    p = ExpertPolicy(2, 8, pool_slots=3, top_k=2, ram_capacity=2)
    p.observe(counts(2, 8, {(0, 0): 9, (0, 1): 1, (1, 2): 5, (1, 3): 3, (1, 4): 2}))
    placement = p.placement()
    assert placement.pinned == (frozenset({0}), frozenset({2}))
    assert placement.warm == (frozenset(), frozenset({3, 4}))


def test_heat_levels_are_six_bit_log_buckets():
    p = ExpertPolicy(1, 3, pool_slots=3, top_k=1, ram_capacity=None, settings=PolicySettings(decay=1.0))
    p.observe(counts(1, 3, {(0, 1): 1, (0, 2): 1e30}))
    assert p.heat_levels()[0].tolist() == [0, 1, 63]


# ---- the plan -----------------------------------------------------------------------

CFG = ModelConfig(
    arch="qwen3_moe", vocab_size=512, hidden_size=64, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=16,
    intermediate_size=128, rope_theta=1e6, rms_eps=1e-6, max_context=512, tie_embeddings=False,
    qk_norm="head", n_experts=8, n_experts_per_tok=2, moe_intermediate_size=32,
    moe_layers=(True, False, True),
)
EXPERT_BYTES = 3 * 64 * 32 * 4  # gate, up and down of one expert, float32


def plan(shared: int = 1_000_000, **settings):
    return plan_experts(CFG, ExpertSettings(**settings), EXPERT_BYTES, shared)


def test_no_budget_is_resident_and_a_cap_below_the_experts_is_tiered():
    assert (plan().mode, plan().pool_slots) == ("resident", 8)
    assert (plan(device_experts_per_layer=0).mode, plan(device_experts_per_layer=99).mode) == ("resident", "resident")
    tiered = plan(device_experts_per_layer=3, ram_gb=EXPERT_BYTES * 5 / 1e9)
    assert (tiered.mode, tiered.layers, tiered.pool_slots, tiered.ram_capacity) == ("tiered", 2, 3, 5)
    assert plan(mode="tiered").mode == "tiered"  # forced, even when everything fits
    assert plan(mode="resident", device_experts_per_layer=2).pool_slots == 8


def test_a_device_budget_in_gb_sizes_the_pool():
    shared = 2_000_000
    budget = (shared + 2 * 5 * EXPERT_BYTES + 100) / 1e9  # 5 experts in each of 2 MoE layers
    assert plan(shared, device_gb=budget).pool_slots == 5
    assert plan(shared, device_gb=100.0).mode == "resident"


def test_a_budget_below_top_k_is_a_clear_error():
    with pytest.raises(ValueError, match="routed to 2.*at least 2 experts per layer"):
        plan(device_experts_per_layer=1)
    with pytest.raises(ValueError, match="holds 0 experts"):
        plan(2_000_000, device_gb=0.001)


def test_a_dense_model_is_always_resident():
    dense = replace(CFG, arch="llama", n_experts=0, n_experts_per_tok=0, moe_layers=(False,) * 3)
    assert plan_experts(dense, ExpertSettings(device_experts_per_layer=1), 0, 10).mode == "resident"


def test_settings_refuse_nonsense():
    for bad in (dict(mode="fast"), dict(device_gb=-1), dict(policy="fifo"), dict(device_experts_per_layer=-2)):
        with pytest.raises(ValueError):
            ExpertSettings(**bad)
    with pytest.raises(ValueError):
        PolicySettings(decay=0)


# ---- the heat file ------------------------------------------------------------------


def test_heat_file_round_trip(tmp_path):
    heat = np.array([[0.0, 1.5, 2.25], [3.0, 0.0, 1e-3]])
    path = tmp_path / "sub" / "heat.json"
    save_heat(path, FP, heat)
    np.testing.assert_allclose(load_heat(path, FP, (2, 3)), heat)
    assert not list(path.parent.glob("*.tmp"))  # written through a renamed temporary


@pytest.mark.parametrize("damage", ["not json", "truncated", "other model", "other shape", "negative", "format"])
def test_a_bad_heat_file_is_ignored_with_a_warning(tmp_path, caplog, damage):
    path = tmp_path / "heat.json"
    save_heat(path, FP, np.ones((2, 3)))
    body = json.loads(path.read_text())
    text = {
        "not json": "{]",
        "truncated": path.read_text()[:20],
        "other model": json.dumps({**body, "model": "mixtral/other/2x4/d64"}),
        "other shape": json.dumps({**body, "shape": [2, 4], "heat": [[1, 1, 1, 1]] * 2}),
        "negative": json.dumps({**body, "heat": [[1, -1, 1]] * 2}),
        "format": json.dumps({**body, "version": 99}),
    }[damage]
    path.write_text(text)
    with caplog.at_level(logging.WARNING):
        assert load_heat(path, FP, (2, 3)) is None
    assert "ignoring the expert heat file" in caplog.text and str(path) in caplog.text


def test_a_missing_heat_file_is_silent(tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        assert load_heat(tmp_path / "none.json", FP, (2, 3)) is None
    assert not caplog.text


def test_the_heat_file_lives_next_to_the_model_or_in_the_cache_when_read_only(tmp_path, monkeypatch):
    model_dir, cache = tmp_path / "model", tmp_path / "cache"
    model_dir.mkdir()
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert default_heat_path(model_dir, cache) == model_dir / "motet-heat.json"
    assert default_heat_path(gguf, cache) == tmp_path / "m.gguf.motet-heat.json"
    # A read-only folder (faked: root may write anywhere) falls back to the cache folder,
    # under a name that tells models of the same name apart.
    monkeypatch.setattr(os, "access", lambda path, mode: False)
    fallback = default_heat_path(model_dir, cache)
    assert fallback.parent == cache and fallback.name.startswith("model-")
    assert default_heat_path(tmp_path / "elsewhere" / "model", cache) != fallback
