"""Decode bursts (model/burst.py): one row's several steps in one device call draw what as
many single steps draw, chained one to the next, and leave the same KV behind; the
runner bursts only the rows that may burst; the scheduler bursts one stream while
nothing waits, and never past a request's max_tokens or the context."""

from __future__ import annotations

import sys
from dataclasses import replace

import numpy as np
import pytest
import trio
from conftest import GOLDEN, TINY_ARCHS, TINY_GEO
from test_pipelined_decode import SAMPLED, as_tuple, prompt_of, row

from motet.actors.expert_policy import ExpertPlan
from motet.actors.runner import ModelRunner
from motet.engines.engine import Engine
from motet.engines.mux_engine import MuxEngine
from motet.model.generate import generate


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_a_burst_draws_and_stores_what_single_steps_do(tiny_model, arch):
    """Slot 0: six single steps, each chained to the one before. Slot 1: the same request
    as a burst of four and a burst of two chained to it, nothing read in between."""
    model = tiny_model(arch)
    runner = ModelRunner(model, TINY_GEO, burst=4)
    prompt = prompt_of(model, 9, 1)
    key = runner.new_key(7)
    first = [runner.prefill(slot, prompt, 0, row(key))[0] for slot in (0, 1)]

    singles = [runner.dispatch([0 if i else first[0].token], [0], [len(prompt) + i], [row(first[0].next_key)],
                               [i > 0]) for i in range(6)]
    singles = [runner.collect(step)[0] for step in singles]
    four = runner.dispatch([first[1].token], [1], [len(prompt)], [row(first[1].next_key)], steps=4)
    two = runner.dispatch([0], [1], [len(prompt) + 4], [row(key)], [True], steps=2)
    bursts = [rows[0] for rows in runner.collect_steps(four) + runner.collect_steps(two)]
    assert len(bursts) == 6
    assert [as_tuple(s) for s in bursts] == [as_tuple(s) for s in singles]

    layers, written = model.config.n_layers, len(prompt) + 6
    for (k0, v0), (k1, v1) in zip(runner.read_layers(0, 0, layers, written), runner.read_layers(1, 0, layers, written)):
        np.testing.assert_array_equal(k0, k1)
        np.testing.assert_array_equal(v0, v1)


def test_only_one_plainly_sampled_row_bursts(tiny_model):
    model = tiny_model("qwen3_moe")
    runner = ModelRunner(model, TINY_GEO, burst=4)
    plain = row(runner.new_key(0))
    vocab = model.config.vocab_size
    assert runner.burst_steps([plain]) == 4
    assert runner.burst_steps([plain, plain]) == 1  # two rows: a step of their own
    assert runner.burst_steps([replace(plain, presence=1.0, uses_history=True)]) == 1
    assert runner.burst_steps([replace(plain, allowed=np.full((vocab + 31) // 32, -1, np.int32))]) == 1
    assert ModelRunner(model, TINY_GEO).burst_steps([plain]) == 1  # burst=1: none
    cfg = model.config
    tiered = ModelRunner(model, TINY_GEO, ExpertPlan("tiered", sum(cfg.moe_layers), cfg.n_experts, 4, None, 1),
                         burst=4)
    assert tiered.burst_steps([plain]) == 1  # its pool moves between steps, on the host

    with pytest.raises(ValueError, match="at most 1 steps a call, not 2"):
        runner.dispatch([0, 0], [0, 1], [3, 3], [plain, plain], steps=2)
    with pytest.raises(ValueError, match="at most 4 steps a call, not 5"):
        runner.dispatch([0], [0], [3], [plain], steps=5)
    burst = runner.dispatch([0], [0], [3], [plain], steps=2)
    with pytest.raises(ValueError, match="read with collect_steps"):
        runner.collect(burst)
    assert len(runner.collect_steps(burst)) == 2
    with pytest.raises(ValueError, match="at least 1 step"):
        ModelRunner(model, TINY_GEO, burst=0)


@pytest.mark.parametrize("burst", [0, 17])
def test_the_engine_refuses_a_burst_out_of_range(burst):
    with pytest.raises(ValueError, match=r"decode_burst must be in \[1, 16\]"):
        Engine(decode_burst=burst)


async def test_the_engine_bursts_to_the_same_tokens_and_ends(tiny_model, monkeypatch):
    """The same requests with bursts of 4 and with none: a seeded sampled one whose
    max_tokens is no multiple of 4, one that meets a stop token mid-burst, one the
    context ends, and two at once (no bursts while the second waits): the same tokens
    and the same finish reasons, as the plain generator draws them. The engine of 4 did
    burst, and the other never did."""
    model = tiny_model("qwen3_moe")
    prompt = prompt_of(model, 11, 3)
    expected = list(generate(model, prompt, max_tokens=23, seed=42, **SAMPLED))
    stop_at = next(i for i in range(5, 23) if expected[i] not in expected[:i])
    near_end = prompt_of(model, TINY_GEO.max_context - 14, 5)  # the context ends it after 14 tokens
    results, calls = {}, []
    dispatch = ModelRunner.dispatch

    def counted(runner, *args, steps=1, **kwargs):
        calls.append((runner.burst, steps))
        return dispatch(runner, *args, steps=steps, **kwargs)

    monkeypatch.setattr(ModelRunner, "dispatch", counted)
    for burst in (1, 4):
        with trio.fail_after(240):
            async with Engine(model, kv_slots=4, max_context=TINY_GEO.max_context, prefill_chunk=16,
                              prefill_chunk_alone=16, decode_burst=burst) as engine:
                runs = [await engine.complete(prompt, max_tokens=23, seed=42, **SAMPLED),
                        await engine.complete(prompt, max_tokens=23, seed=42, stop_token_ids=[expected[stop_at]],
                                              **SAMPLED),
                        await engine.complete(near_end, max_tokens=40)]
                together = {}

                async def one(name, ids, fields):
                    together[name] = await engine.complete(ids, **fields)

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(one, "long", prompt, dict(max_tokens=23, seed=42, **SAMPLED))
                    nursery.start_soon(one, "short", prompt_of(model, 6, 4), dict(max_tokens=9))
                runs += [together["long"], together["short"]]
                assert engine.startup().compiles_after_ready == 0
        results[burst] = [(c.token_ids, c.stats.finish_reason) for c in runs]
    assert results[4] == results[1]
    assert {steps for burst, steps in calls if burst == 1} == {1}
    assert {steps for burst, steps in calls if burst == 4} == {1, 4}
    assert results[4][0] == (tuple(expected), "length")
    assert results[4][1] == (tuple(expected[:stop_at]), "stop")
    assert results[4][2][1] == "length" and len(near_end) + len(results[4][2][0]) == TINY_GEO.max_context
    assert results[4][3][0] == tuple(expected)


async def test_the_flag_reaches_a_mux_child():
    """`motet mux --decode-burst`: with 4 the child warms up one shape more than with 1
    (its burst), and answers alike."""
    shapes, answers = {}, {}
    for burst in ("4", "1"):
        command = [sys.executable, "-m", "motet", "mux", "--decode-burst", burst]
        env = {"SNAP": str(GOLDEN / "llama"), "CTX": "256", "KVSAVE": "0"}
        with trio.fail_after(600):  # a cold start compiles every shape
            async with MuxEngine(command, env=env, kv_slots=2) as engine:
                shapes[burst] = engine.startup().shapes
                answers[burst] = (await engine.complete("the sea is", max_tokens=11)).text
    assert shapes["4"] == shapes["1"] + 1
    assert answers["4"] == answers["1"] != ""
