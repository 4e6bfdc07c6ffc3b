"""A started engine never makes a request wait on the compiler: every shape it serves is
compiled (and run once) before it is ready, and the persistent compilation cache makes a
second start of the same configuration compile nothing. Counts, never timings: JAX's own
compile events (motet/model/compilation.py), as /health, /metrics and the mux WARMUP line
report them."""

from __future__ import annotations

import subprocess
import sys
from functools import partial

import httpx
import numpy as np
import openai
import trio
from conftest import GOLDEN, REPO, TINY_GEO, metric

from motet.actors.runner import ModelRunner
from motet.actors.step_rows import FILLER_ROW
from motet.actors.warmup import WarmupPlan, warm_up
from motet.engines.engine import Engine
from motet.engines.mux_engine import MuxEngine
from motet.model.kv import KVGeometry
from motet.runtime.config import DEFAULT_BURST, ExpertSettings

TIMEOUT = 600  # seconds per start: a cold one compiles everything
SLOTS, CONTEXT = 16, 256
BURST = 16


def prompt(i: int, burst: int) -> str:
    """Prompts of several lengths (several prefill sizes), different in each burst."""
    return " ".join(f"word{(i * 5 + j + burst) % 97}" for j in range(1 + 3 * i))


async def burst(call, number: int) -> list:
    """BURST requests at once; their answers, in order."""
    answers = [None] * BURST

    async def one(i: int):
        answers[i] = await call(i, number)

    async with trio.open_nursery() as nursery:
        for i in range(BURST):
            nursery.start_soon(one, i)
    return answers


async def serve_two_bursts(cache) -> tuple[dict, str, list]:
    """A real `motet serve` of the tiny llama with this compilation cache: two bursts of
    BURST concurrent requests through the official client, then /health and /metrics."""
    command = [sys.executable, "-m", "motet", "serve", "--model", str(GOLDEN / "llama"), "--port", "0",
               "--kv-slots", str(SLOTS), "--max-context", str(CONTEXT), "--compile-cache", str(cache)]
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            process = await nursery.start(partial(trio.run_process, command, cwd=REPO, check=False,
                                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
            err = b""
            while b"python -c" not in err:  # the banner's last line: listening, and ready
                chunk = await process.stderr.receive_some(65536)
                assert chunk, err.decode()
                err += chunk
            url = err.decode().split("serving llama at ", 1)[1].split()[0]
            client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)

            async def ask(i: int, number: int):
                return await client.completions.create(model="llama", prompt=prompt(i, number), max_tokens=12,
                                                       temperature=0.7 * (i % 2), logprobs=i % 3 or None)

            answers = [*await burst(ask, 1), *await burst(ask, 2)]
            async with httpx.AsyncClient(base_url=url) as http:
                health = (await http.get("/health")).json()
                metrics = (await http.get("/metrics")).text
            process.terminate()
            assert await process.wait() == 0
    return health, metrics, answers


async def test_a_second_start_compiles_nothing_and_no_request_waits_on_the_compiler(tmp_path):
    cache = tmp_path / "jax"
    first, first_metrics, answers = await serve_two_bursts(cache)
    second, second_metrics, _ = await serve_two_bursts(cache)

    assert all(a.choices[0].text for a in answers) and len(answers) == 2 * BURST
    cold, warm = first["startup"], second["startup"]
    plan = WarmupPlan.of(KVGeometry(SLOTS, CONTEXT, 256), burst=DEFAULT_BURST)
    assert cold["shapes"] == warm["shapes"] == len(plan.shapes)
    assert cold["compiled"] > len(plan.shapes)  # a step, its KV write, its sampler...
    assert warm["compiled"] == 0  # the second start took every executable from the cache
    assert warm["from_cache"] >= cold["compiled"]
    assert cold["cache_dir"] == warm["cache_dir"] == str(cache)
    # Neither start compiled (or loaded) anything once ready: 32 requests of every shape
    assert cold["compiles_after_ready"] == warm["compiles_after_ready"] == 0
    for text in (first_metrics, second_metrics):
        assert metric(text, "motet_executables_after_ready") == 0
        assert metric(text, "motet_time_to_ready_seconds") > 0
    assert metric(first_metrics, "motet_startup_executables", source="compiled") == cold["compiled"]
    assert metric(second_metrics, "motet_startup_executables", source="compiled") == 0

    # The same configuration through `motet mux`: the cache is the same for every entry point.
    command = [sys.executable, "-m", "motet", "mux", "--compile-cache", str(cache)]
    env = {"SNAP": str(GOLDEN / "llama"), "CTX": str(CONTEXT), "KVSAVE": "0"}
    with trio.fail_after(TIMEOUT):
        async with MuxEngine(command, env=env, kv_slots=SLOTS) as engine:
            startup = engine.startup()
            await engine.complete(prompt(3, 1), max_tokens=4)
    assert startup.compiled == 0 and startup.from_cache >= cold["compiled"] and startup.ready_s > 0
    assert startup.shapes == len(plan.shapes)


async def check_every_path_is_warm(engine: Engine, folder) -> None:
    """Two bursts of mixed requests (greedy and sampled, with and without top logprobs,
    penalties and a bias, prompts of several lengths), a prefill-only request, a save and
    a restore: nothing compiles after ready."""
    async def ask(i: int, number: int):
        penalties = dict(frequency_penalty=0.5, repetition_penalty=1.2, logit_bias={5: 1.0}) if i % 4 == 3 else {}
        return await engine.complete(prompt(i, number), max_tokens=8, temperature=0.8 * (i % 2),
                                     top_logprobs=i % 3, seed=i, **penalties)

    await burst(ask, 1)
    await burst(ask, 2)
    await engine.complete(prompt(5, 4), max_tokens=12)  # alone: a decode burst (where a plan has one)
    await engine.prefill(prompt(4, 3), slot=0)
    saved = await engine.save_slot(0, folder / "slot0")
    await engine.restore_slot(1, folder / "slot0")
    assert saved.tokens > 0
    report = engine.startup()
    assert report.shapes > 0 and report.compiles_after_ready == 0


async def test_resident_moe_serves_every_shape_warm(tiny_model, tmp_path):
    # 4 slots: the burst's other requests wait for one, and batches of 1, 2 and 4 run
    async with Engine(tiny_model("qwen3_moe"), kv_slots=4, max_context=CONTEXT, prefill_chunk=64, prefill_chunk_alone=64) as engine:
        await check_every_path_is_warm(engine, tmp_path)


async def test_tiered_experts_serve_every_shape_warm(tiny_model, tmp_path):
    """Tiered: the layer pieces, the one-jit steps over the pools and every expert move
    size are compiled at start, and no expert moved for it: the pool is as an engine
    that skips the warm-up has it."""
    settings = dict(kv_slots=4, max_context=CONTEXT, prefill_chunk=32, prefill_chunk_alone=32)
    experts = partial(ExpertSettings, device_experts_per_layer=2)
    async with Engine(tiny_model("olmoe"), warm_up=False, experts=experts(heat_file=tmp_path / "a"),
                      **settings) as cold:
        unwarmed = cold.expert_tiers()
    async with Engine(tiny_model("olmoe"), experts=experts(heat_file=tmp_path / "b"), **settings) as engine:
        warmed = engine.expert_tiers()
        await check_every_path_is_warm(engine, tmp_path)
    assert warmed.mode == "tiered" and warmed.lookups == 0
    assert (warmed.tiers, warmed.device, warmed.ram, warmed.disk) == (
        unwarmed.tiers, unwarmed.device, unwarmed.ram, unwarmed.disk)
    assert cold.startup().shapes == 0
    assert engine.startup().shapes == len(engine.warmup_plan(KVGeometry(4, CONTEXT, 32)).shapes)


def test_motet_info_says_what_an_engine_compiles():
    out = subprocess.run([sys.executable, "-m", "motet", "info", "--model", str(GOLDEN / "llama"),
                          "--kv-slots", "4", "--max-context", "256", "--compile-cache", ""],
                         cwd=REPO, check=True, capture_output=True, text=True).stdout
    assert "compiled before ready (4 KV slots, context 256" in out
    assert "5 prefill chunks" in out and "16, 32, 64, 128, 256 tokens" in out
    assert "3 decode batches" in out and "1, 2, 4 rows" in out
    assert "1 one-row decode bursts" in out and f"{DEFAULT_BURST} steps" in out
    assert "slot reads and writes" in out


def test_the_plan_covers_every_size_a_request_can_use():
    geo = KVGeometry(n_slots=5, max_context=300, chunk=128)
    assert geo.decode_batches() == (1, 2, 4, 8)
    assert geo.prefill_chunks() == (16, 32, 64, 128)
    assert geo.slot_widths() == (64, 128, 256, 512)  # whole blocks of K (kv_layout.py)
    short = KVGeometry(n_slots=1, max_context=40, chunk=256)
    assert short.decode_batches() == (1,) and short.prefill_chunks() == (16, 32, 64)
    tiered = WarmupPlan.of(geo, pool_slots=6)
    assert [s.size for s in tiered.shapes if s.kind == "experts"] == [1, 2, 4, 8]


def test_the_warm_up_leaves_a_cache_and_history_no_conversation_wrote(tiny_model):
    """The warm-up runs every shape on the scratch slot, then makes the KV cache and the
    samplers' history anew: untouched zeros, whose pages count in the resident set only
    once a conversation writes them (kv_writes.cache_zeros)."""
    runner = ModelRunner(tiny_model("qwen3_moe"), TINY_GEO)
    warm_up(runner, WarmupPlan.of(TINY_GEO), lambda *_: None)
    scratch = TINY_GEO.scratch_slot
    k, v = runner.kv
    assert not any(np.asarray(layer[scratch]).any() for layer in k + v)
    assert not any(np.asarray(rows).any() for rows in runner.history)
    # and the cache serves as before
    token = runner.prefill(0, [5, 6, 7], 0, FILLER_ROW)[0].token
    assert 0 <= token < runner.model.config.vocab_size
    assert np.asarray(runner.kv[0][0][0]).any()
