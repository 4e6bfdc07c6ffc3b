"""Cross-slot prefix sharing: a prompt whose prefix another slot holds, busy or idle,
starts from a device copy of that prefix's KV and reads only the rest. Its answer is the
one a full prefill gives (the shared prefix is a whole number of chunks, so both read
the rest in the same chunks: the same arithmetic, the same tokens). So it is with an
8-bit cache, whose copies and stored prefixes are its own bytes."""

from __future__ import annotations

import numpy as np
import pytest
import trio
from conftest import mux_engine

from motet.engines.engine import Engine
from motet.runtime.api import TokenEvent

TINY = dict(kv_slots=4, max_context=256, prefill_chunk=16, prefill_chunk_alone=16, warm_up=False)
TIMEOUT = 240


def conversations(model, prefix: int = 64) -> list[list[int]]:
    rng = np.random.default_rng(8)
    system = rng.integers(3, model.config.vocab_size, size=prefix).tolist()
    return [system + rng.integers(3, model.config.vocab_size, size=tail).tolist() for tail in (10, 12, 7)]


async def answer(engine, prompt, **fields):
    got = await engine.complete(prompt, max_tokens=8, **fields)
    return got.token_ids, got.stats


@pytest.mark.parametrize("kv_dtype", ["auto", "int8", "fp8"])
async def test_a_prefix_another_slot_holds_is_copied_busy_or_idle(tiny_model, kv_dtype):
    model = tiny_model("llama")
    settings = {**TINY, "kv_dtype": kv_dtype}
    first, second, third = conversations(model)
    with trio.fail_after(TIMEOUT):
        async with Engine(model, **settings, share_prefixes=False) as engine:
            alone = [await answer(engine, prompt, slot=slot) for slot, prompt in enumerate((first, second, third))]
        async with Engine(model, **settings) as engine:
            # the first still decoding when the second comes: its slot is busy
            long_first = []
            async with engine.stream(first, max_tokens=40, slot=0) as events:
                async for event in events:
                    if isinstance(event, TokenEvent):
                        long_first.append(event.token_id)
                        if len(long_first) == 2:
                            second_answer = await answer(engine, second, slot=1)
            third_answer = await answer(engine, third, slot=2)  # the slots it copies from are idle now
    assert [s.reused_tokens for _, s in alone] == [0, 0, 0]
    assert second_answer[1].reused_tokens == third_answer[1].reused_tokens == 64
    assert second_answer[1].copied_tokens == third_answer[1].copied_tokens == 64
    assert second_answer[0] == alone[1][0] and third_answer[0] == alone[2][0]
    # the slot copied from decoded on undisturbed
    assert long_first[: len(alone[0][0])] == list(alone[0][0])


async def test_through_motet_mux_with_the_slots_the_submits_name(tiny_model):
    """SUBMITs name their slots; the second conversation's still starts from the first's
    system prompt, copied from the slot the first named (its TURN line's reused count)."""
    model = tiny_model("llama")
    system = "You are a terse assistant. Answer in one short line, and never apologise.\n"
    with trio.fail_after(TIMEOUT):
        async with mux_engine(model, kv_slots=4, max_context=256) as engine:
            held = len(engine.tokenize(system))
            first = await engine.complete(system + "What is the sea?", max_tokens=4, slot=0)
            second = await engine.complete(system + "Name a colour.", max_tokens=4, slot=2)
    assert first.stats.reused_tokens == 0
    assert second.stats.reused_tokens >= held - 1  # where the text's tokens meet the question's


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
async def test_a_prefix_pushed_out_of_its_slot_comes_back_from_the_store(tiny_model, kv_dtype):
    """One slot and a host-RAM store: conversation A, then B takes the slot (A's KV goes
    to the store first), then A's next turn gets A's prefix back from the store. Its
    answer and its reused tokens are those of an engine whose second slot kept A."""
    model = tiny_model("llama")
    rng = np.random.default_rng(9)
    a, b, more = (rng.integers(3, model.config.vocab_size, size=n).tolist() for n in (64, 48, 10))

    async def turns(engine):
        first, _ = await answer(engine, a)
        await answer(engine, b)
        stored = engine.statistics().prefix_store_bytes
        return await answer(engine, a + list(first) + more), stored

    with trio.fail_after(TIMEOUT):
        async with Engine(model, **{**TINY, "kv_slots": 2}, kv_dtype=kv_dtype) as engine:
            (kept, kept_stats), _ = await turns(engine)
        async with Engine(model, **{**TINY, "kv_slots": 1}, kv_dtype=kv_dtype, prefix_cache_gb=0.01) as engine:
            (restored, restored_stats), stored = await turns(engine)
    assert stored > 0
    assert restored_stats.reused_tokens == kept_stats.reused_tokens > len(a)
    assert restored_stats.copied_tokens == restored_stats.reused_tokens and kept_stats.copied_tokens == 0
    assert restored == kept
