"""Tiered experts through the Engine and `motet mux`: the same answers as resident mode,
telemetry that is real and agrees with itself (TIERS, EMAP, REPIN, DONE's hit rate,
expert_state, expert_tiers), the heat file across restarts, and a budget too small for
the model refused at start."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import numpy as np
import pytest
import trio
from conftest import GOLDEN, REPO

from motet.engines.engine import Engine
from motet.protocol import mux
from motet.runtime.config import ExpertSettings

# no warm-up: tests/test_warm_start.py and tests/test_mesh.py cover the tiered one
TINY = dict(kv_slots=4, max_context=256, prefill_chunk=16, prefill_chunk_alone=16, warm_up=False)
TIMEOUT = 240
PROMPTS = ("the sea is", "rivers run to", "once upon a time there was a")


async def answers(engine: Engine) -> dict[str, tuple]:
    """The three prompts at once (one batch of decode rows), greedy: text → (ids, finish)."""
    out = {}

    async def one(prompt):
        async with engine.stream(prompt, max_tokens=12) as events:
            ids = [e.token_id async for e in events if hasattr(e, "token_id")]
        out[prompt] = (tuple(ids), events.finish)

    async with trio.open_nursery() as nursery:
        for prompt in PROMPTS:
            nursery.start_soon(one, prompt)
    return out


def tier_counts_of(emap: bytes) -> tuple[int, int, int]:
    tiers = [b >> 6 for b in emap]
    return tiers.count(2), tiers.count(1), tiers.count(0)


@pytest.mark.parametrize("arch", ("qwen3_moe", "mixtral"))
async def test_a_tiered_engine_answers_as_the_resident_one(tiny_model, tmp_path, arch):
    model = tiny_model(arch)
    with trio.fail_after(TIMEOUT):
        async with Engine(model, **TINY) as engine:
            want = await answers(engine)
            assert engine.expert_plan.mode == "resident"
            assert engine.expert_tiers().disk == 0
        settings = ExpertSettings(device_experts_per_layer=model.config.n_experts_per_tok, ram_gb=0.0001,
                                  heat_file=tmp_path / "heat.json")
        async with Engine(model, **TINY, experts=settings) as engine:
            got = await answers(engine)
            tiers, state = engine.expert_tiers(), engine.expert_state()
    assert {p: ids for p, (ids, _) in got.items()} == {p: ids for p, (ids, _) in want.items()}
    rows, cols = sum(model.config.moe_layers), model.config.n_experts
    assert tiers.mode == "tiered" and tiers.pool_slots == model.config.n_experts_per_tok
    assert tiers.device + tiers.ram + tiers.disk == rows * cols
    assert tiers.device == rows * tiers.pool_slots and tiers.ram <= 4  # 0.1 MB of RAM
    assert tier_counts_of(state.emap) == state.tiers == (tiers.device, tiers.ram, tiers.disk)
    assert 0 < tiers.lookups and 0 <= tiers.hits < tiers.lookups
    assert state.hit_rate == pytest.approx(tiers.hits / tiers.lookups)
    assert tiers.prefetch_recall is not None and 0 <= tiers.prefetch_recall <= 1
    for _, finish in got.values():
        assert 0 <= finish.report.hit_pct < 100
        assert finish.report.repin and all(gpu == 0 and old in (0, 1) for *_, old, gpu in finish.report.repin)
    for _, finish in want.values():
        assert finish.report.hit_pct == 100.0 and finish.report.repin == ()
    assert (tmp_path / "heat.json").exists()  # written at shutdown


async def test_heat_persists_so_a_restarted_engine_starts_warm(tiny_model, tmp_path):
    model = tiny_model("olmoe")  # 8 experts, top-2
    settings = ExpertSettings(device_experts_per_layer=3, heat_file=tmp_path / "heat.json")
    with trio.fail_after(TIMEOUT):
        async with Engine(model, **TINY, experts=settings) as engine:
            await answers(engine)
            assert await engine.save_expert_heat() == tmp_path / "heat.json"
            heat = engine._expert_cache.policy.heat.copy()
        async with Engine(model, **TINY, experts=settings) as engine:
            start = engine.expert_tiers()
    assert heat.sum() > 0
    on_device = np.frombuffer(start.tiers, np.uint8).reshape(start.rows, start.cols) == 2
    for r in range(start.rows):
        hottest = set(np.argsort(-heat[r], kind="stable")[:3].tolist())
        assert set(np.flatnonzero(on_device[r]).tolist()) == hottest


async def test_a_corrupt_heat_file_is_ignored_with_a_warning(tiny_model, tmp_path, caplog):
    path = tmp_path / "heat.json"
    path.write_text('{"format": "motet-heat", "version": 1, "model"')
    settings = ExpertSettings(device_experts_per_layer=2, heat_file=path)
    with caplog.at_level(logging.WARNING), trio.fail_after(TIMEOUT):
        async with Engine(tiny_model("olmoe"), **TINY, experts=settings) as engine:
            done = await engine.complete("still answers", max_tokens=3)
    assert done.stats.emitted_tokens > 0
    assert "ignoring the expert heat file" in caplog.text


async def test_a_budget_below_top_k_is_refused_at_start(tiny_model):
    with pytest.raises(ValueError, match="each token is routed to 2"):
        async with Engine(tiny_model("qwen3_moe"), **TINY, experts=ExpertSettings(device_experts_per_layer=1)):
            pass


# ---- `motet mux` ------------------------------------------------------------------

PROMPT = b"<|im_start|>user\nTell me about the sea.<|im_end|>\n<|im_start|>assistant\n"


def run_mux(args=(), env=None, stdin: bytes = b""):
    environ = {**os.environ, "SNAP": str(GOLDEN / "olmoe"), "SERVE": "1", "SERVE_BATCH": "1",
               "KV_SLOTS": "2", "CTX": "256", **(env or {})}
    proc = subprocess.run(
        [sys.executable, "-m", "motet", "mux", "--compile-cache", str(REPO / ".jax_cache" / "tests"),
         "--no-warm-up", *args],
        input=stdin, capture_output=True, env=environ, timeout=300, cwd=REPO,
    )
    return proc, mux.ResponseDecoder().feed(proc.stdout)


def telemetry(events, kind):
    return [e.fields for e in events if isinstance(e, mux.Telemetry) and e.kind == kind]


def test_mux_tiered_telemetry_is_real_and_consistent(tmp_path):
    """The positional cap (2 experts per layer of 8) and RAM_GB make the model tiered."""
    submit = f"SUBMIT 1 0 {len(PROMPT)} 20 0 1\n".encode() + PROMPT + b"\n"
    proc, events = run_mux(["2"], {"RAM_GB": "0.0001", "HEAT_FILE": str(tmp_path / "h.json")}, submit)
    assert proc.returncode == 0, proc.stderr.decode()
    tiers, emaps = telemetry(events, "TIERS"), telemetry(events, "EMAP")
    assert len(tiers) == len(emaps) == 2  # the handshake's and the turn's
    for t, (rows, cols, hexmap) in zip(tiers, emaps):
        device, ram, disk = map(int, t[:3])
        rows, cols = int(rows), int(cols)
        assert device + ram + disk == rows * cols == 2 * 8
        assert device == 2 * rows and ram <= 4
        assert tier_counts_of(bytes.fromhex(hexmap)) == (device, ram, disk)
        # GB with two decimals, as the protocol writes them (this model weighs ~3 MB)
        assert float(t[3]) >= 0 and float(t[4]) == pytest.approx(ram * 3 * 64 * 32 * 4 / 1e9, abs=0.006)
    repins = telemetry(events, "REPIN")
    assert repins  # two slots per layer cannot hold a whole turn's experts
    for layer, expert, old_tier, gpu in (map(int, r) for r in repins):
        assert 0 <= layer < 2 and 0 <= expert < 8 and old_tier in (0, 1) and gpu == 0
    (done,) = [e for e in events if isinstance(e, mux.Done)]
    assert 0 < done.hit_pct < 100
    assert telemetry(events, "GPUS") == [("0",)]  # no GPU on this host
    (perf,) = telemetry(events, "PERF")
    _, dt, t_edisk, t_ewait, *_ = map(float, perf)
    assert 0 < t_edisk <= t_ewait < dt  # the turn waited for experts, partly on file reads
    assert (tmp_path / "h.json").exists()


def test_mux_resident_by_default_reports_everything_on_the_device():
    submit = f"SUBMIT 1 0 {len(PROMPT)} 4 0 1\n".encode() + PROMPT + b"\n"
    proc, events = run_mux(["0"], stdin=submit)
    assert proc.returncode == 0
    assert [tuple(t[:3]) for t in telemetry(events, "TIERS")] == [("16", "0", "0")] * 2
    assert not telemetry(events, "REPIN")
    (done,) = [e for e in events if isinstance(e, mux.Done)]
    assert done.hit_pct == 100.0
    (perf,) = telemetry(events, "PERF")
    assert perf[2:4] == ("0.0000", "0.0000")  # no expert ever waited for or read


def test_mux_refuses_a_cap_below_top_k_at_start():
    proc, events = run_mux(["1"])
    assert proc.returncode == 2
    assert not events  # no READY
    assert b"each token is routed to 2" in proc.stderr


def test_mux_expert_settings_come_from_the_cap_the_environment_and_flags():
    from motet.cli import build_parser
    from motet.cli.config import mux_settings

    def settings(argv, env=None):
        return mux_settings(build_parser().parse_args(["mux", *argv]), env or {}).experts

    assert settings([]) == ExpertSettings()  # auto, no budget: resident
    assert settings(["0"]).device_experts_per_layer is None  # 0: no limit
    env = {"EXPERT_CAP": "6", "DEVICE_GB": "1.5", "RAM_GB": "8", "EXPERTS": "tiered", "HEAT_FILE": "/tmp/h.json",
           "EXPERT_POLICY": "lru", "EXPERT_PREFETCH": "0"}
    assert settings([], env) == ExpertSettings(mode="tiered", device_experts_per_layer=6, device_gb=1.5, ram_gb=8.0,
                                               heat_file="/tmp/h.json", policy="lru", prefetch=False)
    flagged = settings(["4", "--experts", "auto", "--ram-gb", "2", "--expert-policy", "heat"], env)
    assert (flagged.mode, flagged.device_experts_per_layer, flagged.ram_gb, flagged.policy) == ("auto", 4, 2.0, "heat")
    with pytest.raises(ValueError, match="RAM_GB"):
        settings([], {"RAM_GB": "lots"})
    with pytest.raises(ValueError, match="expert mode"):
        settings([], {"EXPERTS": "everywhere"})


async def test_quantized_experts_fill_a_device_budget_by_the_bytes_they_hold(tmp_path):
    """--quantize int4 through the Engine: the plan counts an expert's quantized bytes, so
    a budget of four float32 experts per layer holds every int4 one; a tiered quantized
    engine answers as the resident one and TIERS reports the bytes its tiers hold."""
    from motet.model.tiered import shared_weight_bytes

    path = GOLDEN / "qwen3_moe"
    with trio.fail_after(TIMEOUT):
        async with Engine(path, dtype="int4", **TINY) as engine:
            want = await answers(engine)
            cfg, plan = engine.model.config, engine.expert_plan
            shared = shared_weight_bytes(engine.model.weights)
        float_expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size * 4
        assert plan.mode == "resident" and plan.expert_bytes * 5 < float_expert
        heat = tmp_path / "heat.json"  # not beside the golden checkpoint
        budget = ExpertSettings(device_gb=(shared + plan.layers * 4 * float_expert) / 1e9, heat_file=heat)
        async with Engine(path, dtype="int4", **TINY, experts=budget) as engine:
            assert engine.expert_plan.pool_slots == cfg.n_experts  # 4 float32 experts' room
        settings = ExpertSettings(device_experts_per_layer=3, ram_gb=2.5 * plan.expert_bytes / 1e9, heat_file=heat)
        async with Engine(path, dtype="int4", **TINY, experts=settings) as engine:
            got = await answers(engine)
            tiers = engine.expert_tiers()
    assert {p: ids for p, (ids, _) in got.items()} == {p: ids for p, (ids, _) in want.items()}
    assert tiers.mode == "tiered" and tiers.ram == 2
    assert tiers.device_gb * 1e9 == pytest.approx(shared + plan.layers * 3 * plan.expert_bytes)
    assert tiers.ram_gb * 1e9 == pytest.approx(2 * plan.expert_bytes)
