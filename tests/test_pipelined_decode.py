"""Pipelined decode: a step dispatched before the one it follows has been read back
takes that step's sampled tokens and PRNG keys on the device (ModelRunner.dispatch's
`chained`), and draws exactly what a step fed from the host would have drawn. The
scheduler runs every resident decode this way; these tests pin the runner's half, and
the engine's against the plain one-step-at-a-time generator."""

from __future__ import annotations

from dataclasses import replace
from functools import partial

import numpy as np
import pytest
import trio
from conftest import TINY_ARCHS, TINY_GEO

from motet.actors.expert_policy import ExpertPlan
from motet.actors.runner import ModelRunner
from motet.actors.step_rows import SamplingRow
from motet.engines.engine import Engine
from motet.model.generate import generate
from motet.runtime.api import TokenEvent

SAMPLED = dict(temperature=0.8, top_p=0.95)


def prompt_of(model, length: int, salt: int) -> list[int]:
    rng = np.random.default_rng(salt)
    return rng.integers(3, model.config.vocab_size, size=length).tolist()


def row(key, want_top=True) -> SamplingRow:
    return SamplingRow(SAMPLED["temperature"], SAMPLED["top_p"], 0, 0.0, key, want_top)


def as_tuple(s):
    return s.token, s.logprob, tuple(s.next_key.tolist()), s.top, s.experts.tolist()


def same_draw(a, b) -> bool:
    """The same token, key, candidates and experts, and the logprob within float32's
    rounding: a float32 model's logits for a row move in their last bits with the other
    rows of its step (XLA's dot takes one row and two rows by different paths)."""
    close = abs(a.logprob - b.logprob) <= 1e-5 * max(1.0, abs(b.logprob))
    return close and as_tuple(a)[2:] == as_tuple(b)[2:] and a.token == b.token


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_chained_steps_draw_what_host_fed_steps_draw(tiny_model, arch):
    """Slot 0 is fed from the host and read back after every step; slot 1 runs the same
    request with every step chained to the one before and nothing read until the end."""
    model = tiny_model(arch)
    runner = ModelRunner(model, TINY_GEO)
    prompt = prompt_of(model, 9, 1)
    key = runner.new_key(7)
    first = [runner.prefill(slot, prompt, 0, row(key))[0] for slot in (0, 1)]
    assert as_tuple(first[0]) == as_tuple(first[1])

    host, sampled = [], first[0]
    for i in range(6):
        sampled = runner.decode([sampled.token], [0], [len(prompt) + i], [row(sampled.next_key)])[0]
        host.append(sampled)

    chained = []
    for i in range(6):
        link = i > 0  # the first step feeds the prefill's token from the host
        token = 0 if link else first[1].token
        chained.append(runner.dispatch([token], [1], [len(prompt) + i], [row(first[1].next_key)], [link]))
    chained = [runner.collect(step)[0] for step in chained]
    assert [as_tuple(s) for s in chained] == [as_tuple(s) for s in host]


def test_a_deferred_step_samples_with_the_mask_of_the_token_before(tiny_model):
    """A row whose mask depends on the token before it (three tokens it picks from), with
    a frequency penalty: fed from the host step by step in slot 0; in slot 1, each step
    dispatched chained before the one before is read, its sampling deferred, and
    finished once that token gives its mask. Both draw the same."""
    model = tiny_model("qwen3_moe")
    runner = ModelRunner(model, TINY_GEO)
    assert runner.defers
    vocab = model.config.vocab_size

    def choices(token: int) -> list[int]:
        return [(token * 7 + i) % vocab for i in (3, 4, 5)]

    def masked(key, token: int) -> SamplingRow:
        allowed = np.zeros((vocab + 31) // 32, np.uint32)
        for choice in choices(token):
            allowed[choice // 32] |= np.uint32(1 << (choice % 32))
        return replace(row(key), frequency=3.0, uses_history=True, allowed=allowed.view(np.int32))

    prompt = prompt_of(model, 9, 2)
    key = runner.new_key(5)
    first = [runner.prefill(slot, prompt, 0, row(key), (tuple(prompt), ()))[0] for slot in (0, 1)]

    host, sampled = [], first[0]
    for i in range(6):
        before = sampled.token
        sampled = runner.decode([before], [0], [len(prompt) + i], [masked(sampled.next_key, before)])[0]
        assert sampled.token in choices(before)
        host.append(sampled)

    start = masked(first[1].next_key, first[1].token)
    step = runner.finish(runner.dispatch([first[1].token], [1], [len(prompt)], [start], defer=True), [start])
    piped = []
    for i in range(1, 6):
        ahead = runner.dispatch([0], [1], [len(prompt) + i], [row(key)], [True], defer=True)
        with pytest.raises(ValueError, match="after ModelRunner.finish"):
            runner.collect(ahead)
        piped.append(runner.collect(step)[0])
        step = runner.finish(ahead, [masked(piped[-1].next_key, piped[-1].token)])
    piped.append(runner.collect(step)[0])
    assert [as_tuple(s) for s in piped] == [as_tuple(s) for s in host]


def test_a_step_mixes_chained_rows_rows_from_the_host_and_rows_left_out(tiny_model):
    """Three requests in slots 2, 3 and 5: slot 3 is left out of the second step (as a
    row that ended), slot 5 joins it from the host, and every row still draws what it
    draws alone."""
    model = tiny_model("qwen3_moe")
    runner = ModelRunner(model, TINY_GEO)
    prompts = {slot: prompt_of(model, 5 + slot, slot) for slot in (2, 3, 5)}
    keys = {slot: runner.new_key(slot) for slot in prompts}
    first = {slot: runner.prefill(slot, p, 0, row(keys[slot], want_top=False))[0] for slot, p in prompts.items()}

    def alone(slot, steps):
        out, s = [], first[slot]
        for i in range(steps):
            s = runner.decode([s.token], [slot + 8], [len(prompts[slot]) + i], [row(s.next_key, False)])[0]
            out.append(s)
        return out

    for slot, p in prompts.items():  # the same requests again in slots 10, 11 and 13
        runner.prefill(slot + 8, p, 0, row(keys[slot], want_top=False))
    expect = {slot: alone(slot, 2) for slot in prompts}

    at = {slot: len(p) for slot, p in prompts.items()}
    one = runner.dispatch([first[2].token, first[3].token], [2, 3], [at[2], at[3]],
                          [row(first[2].next_key, False), row(first[3].next_key, False)])
    two = runner.dispatch([0, first[5].token], [2, 5], [at[2] + 1, at[5]],
                          [row(keys[2], False), row(first[5].next_key, False)], [True, False])
    one, two = runner.collect(one), runner.collect(two)
    assert same_draw(one[0], expect[2][0])
    assert same_draw(one[1], expect[3][0])
    assert same_draw(two[0], expect[2][1])
    assert same_draw(two[1], expect[5][0])


def test_tiered_experts_do_not_chain(tiny_model):
    model = tiny_model("qwen3_moe")
    cfg = model.config
    runner = ModelRunner(model, TINY_GEO, ExpertPlan("tiered", sum(cfg.moe_layers), cfg.n_experts, 4, None, 1))
    assert not runner.chains
    with pytest.raises(ValueError, match="do not chain"):
        runner.dispatch([0], [0], [3], [row(runner.new_key(0))], [True])


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
async def test_the_engine_draws_what_the_plain_generator_draws(tiny_model, arch):
    """A seeded, sampled request through the scheduler, which pipelines its steps, and
    through generate(), which runs one step, reads it, feeds the next: the same tokens,
    alone and batched with a request that ends early."""
    model = tiny_model(arch)
    prompt = prompt_of(model, 11, 3)
    expected = list(generate(model, prompt, max_tokens=20, seed=42, **SAMPLED))
    with trio.fail_after(240):
        async with Engine(model, kv_slots=4, max_context=TINY_GEO.max_context, prefill_chunk=16, prefill_chunk_alone=16) as engine:
            alone = await engine.complete(prompt, max_tokens=20, seed=42, **SAMPLED)
            together = {}

            async def one(name, ids, **kwargs):
                together[name] = await engine.complete(ids, **kwargs)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(partial(one, "short", prompt_of(model, 6, 4), max_tokens=3))
                nursery.start_soon(partial(one, "long", prompt, max_tokens=20, seed=42, **SAMPLED))
    assert list(alone.token_ids) == expected
    assert together["long"].token_ids == alone.token_ids


def test_forks_of_a_prompt_draw_what_the_prompt_prefilled_in_their_own_slot_draws(tiny_model):
    """An n > 1 request's other choices: slot 0 prefills the prompt and hands slots 1 and
    2 a copy of its KV and its history (a presence penalty reads it); each samples its
    first token from the same logits with its own key and decodes on. Each draws what
    the prompt prefilled in a slot of its own (6 and 7) draws with that key."""
    model = tiny_model("qwen3_moe")
    runner = ModelRunner(model, TINY_GEO)
    prompt = prompt_of(model, 21, 3)
    keys = [runner.new_key(seed) for seed in (11, 12, 13)]

    def penalized(key) -> SamplingRow:
        return replace(row(key), presence=1.5, uses_history=True)

    history = (tuple(prompt), ())
    forked = runner.prefill(0, prompt, 0, penalized(keys[0]), history,
                            forks=[(1, penalized(keys[1])), (2, penalized(keys[2]))])
    alone = [runner.prefill(slot, prompt, 0, penalized(key), history)[0] for slot, key in ((6, keys[1]), (7, keys[2]))]
    assert [s.token for s in forked[1:]] == [s.token for s in alone]
    assert [s.logprob for s in forked[1:]] == [s.logprob for s in alone]

    def run(slots: list[int], first) -> list[list[int]]:
        tokens, sampled = [[s.token] for s in first], list(first)
        for i in range(5):
            sampled = runner.decode([s.token for s in sampled], slots, [len(prompt) + i] * len(slots),
                                    [penalized(s.next_key) for s in sampled])
            for out, s in zip(tokens, sampled):
                out.append(s.token)
        return tokens

    assert run([1, 2], forked[1:]) == run([6, 7], alone)
    assert len({tuple(t) for t in run([0, 1, 2], runner.prefill(0, prompt, 0, penalized(keys[0]), history,
                                                               forks=[(1, penalized(keys[1])), (2, penalized(keys[2]))]))}) > 1


async def test_n_choices_draw_what_each_seed_draws_alone_from_one_prefill(tiny_model):
    """engine.choices: the prompt is prefilled once, the other choices start from copies
    of its KV (their stats say all the prompt was reused), and choice i draws what the
    plain generator draws with seed + i. Nothing compiles after ready: the KV copy is
    warmed up. With fewer free slots than choices, the rest queue and read the prompt
    themselves; leaving the block early cancels every choice."""
    model = tiny_model("qwen3_moe")
    prompt = prompt_of(model, 11, 5)
    expected = [list(generate(model, prompt, max_tokens=12, seed=42 + i, **SAMPLED)) for i in range(3)]
    greedy = list(generate(model, prompt, max_tokens=12))

    async def run(engine, **kwargs):
        got: list[list[int]] = [[], [], []]
        async with engine.choices(prompt, 3, max_tokens=12, **kwargs) as choices:
            async for i, event in choices:
                if isinstance(event, TokenEvent):
                    got[i].append(event.token_id)
        return got, [finish.stats for finish in choices.finishes]

    with trio.fail_after(240):
        async with Engine(model, kv_slots=4, max_context=TINY_GEO.max_context, prefill_chunk=16, prefill_chunk_alone=16) as engine:
            got, stats = await run(engine, seed=42, **SAMPLED)
            assert got == expected
            assert len({tuple(tokens) for tokens in got}) > 1
            assert [s.reused_tokens for s in stats] == [0, len(prompt), len(prompt)]
            assert len({s.slot for s in stats}) == 3
            assert engine.startup().compiles_after_ready == 0

            async with engine.choices(prompt_of(model, 9, 6), 3, max_tokens=100, **SAMPLED) as choices:
                async for _ in choices:
                    break
            while engine.statistics().running:
                await trio.sleep(0.01)
        async with Engine(model, kv_slots=2, max_context=TINY_GEO.max_context, prefill_chunk=16, prefill_chunk_alone=16) as engine:
            got, stats = await run(engine)
            assert got == [greedy] * 3
            assert [s.reused_tokens for s in stats] == [0, len(prompt), len(prompt) - 1]
