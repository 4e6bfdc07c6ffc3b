"""The engine API end to end, on real models (no mocks): continuous batching, prefix
reuse across turns, cancellation. Errors and shutdown are in test_engine_errors.py; what a
request's output holds (stop strings, logprobs, telemetry, seeds) in test_engine_outputs.py.

A mux engine sees text only (no token ids, no seeds, no telemetry channel), so where a test
checks token ids it checks them on the Engine, and the texts on both. Models are loaded once
per session (conftest); an Engine around a loaded Model is cheap, so each test builds its
own; a MuxEngine starts a child (a few seconds). Engines of one model share a geometry where
they can, so they share compiled functions.

Most behaviour is run twice, through the `open_engine` fixture's two kinds: the
in-process Engine, and a MuxEngine driving `motet mux` as a child process on the same
model and geometry (engine_helpers.py and conftest.py hold what the engine tests share).
Every test runs under a hard timeout; none asserts timing.
"""

from __future__ import annotations

import pytest
import trio
from engine_helpers import SMOL, TIMEOUT, TINY, encode, ids, outputs, resident, run, text

from motet.engines.engine import Engine
from motet.runtime.api import FinishEvent, TokenEvent
from motet.runtime.errors import NotFound
from motet.runtime.slot_table import common_prefix

# ---- 1. continuous batching --------------------------------------------------------------


async def test_sixteen_concurrent_streams_match_each_alone(default_model):
    topics = ["apples", "the sea", "Paris", "rain", "chess", "bees", "tea", "winter",
              "trains", "Mars", "bread", "owls", "jazz", "glass", "maps", "salt"]
    with trio.fail_after(TIMEOUT):
        async with Engine(default_model, **SMOL) as engine:
            prompts = [engine.render_chat([{"role": "user", "content": f"Tell me about {t}."}])
                       for t in topics]
            # Each prompt alone, on a slot of its own that held nothing before.
            alone = [await engine.complete(p, max_tokens=16, slot=i) for i, p in enumerate(prompts)]

        async with Engine(default_model, **SMOL) as engine:
            together = {}

            async def one(i):
                together[i] = await engine.complete(prompts[i], max_tokens=16)

            async with trio.open_nursery() as nursery:
                for i in range(len(prompts)):
                    nursery.start_soon(one, i)

    assert len({c.stats.slot for c in together.values()}) == 16  # all ran at once
    for i, ref in enumerate(alone):
        got = together[i]
        assert got.stats.finish_reason in ("stop", "length")
        assert got.stats.reused_tokens == 0
        assert got.token_ids == ref.token_ids, topics[i]
        assert got.text == ref.text


async def test_stream_and_complete_round_trip(llama, open_engine):
    prompt = "Once upon a time"
    with trio.fail_after(TIMEOUT):
        async with open_engine(llama, **TINY) as engine:
            async with engine.stream(prompt, max_tokens=10, slot=0) as events:
                seen = [event async for event in events]
            done = await engine.complete(prompt, max_tokens=10, slot=1)
            chat = await engine.chat([{"role": "user", "content": "Hello there"}], max_tokens=4)
    *tokens, finish = seen
    assert all(isinstance(t, TokenEvent) and t.request_id == events.request_id for t in tokens)
    assert finish is events.finish and isinstance(finish, FinishEvent)
    s = finish.stats
    assert (s.request_id, s.slot, s.finish_reason) == (events.request_id, 0, "length")
    assert s.emitted_tokens == len(tokens) == 10
    assert s.prompt_tokens == len(encode(llama, prompt)) and s.reused_tokens == 0
    assert s.time_to_first_token_s > 0 and s.decode_tokens_per_s > 0 and s.total_s > 0
    assert finish.report.perf.dt > 0 and len(finish.report.entropy) == llama.config.n_layers
    assert done.text == text(tokens, finish)
    assert outputs(done.tokens) == outputs(tokens)
    assert done.stats.slot == 1 and done.stats.emitted_tokens == 10
    assert chat.stats.emitted_tokens == 4 and chat.stats.prompt_tokens > 4


# ---- 2. prefix reuse across turns --------------------------------------------------------


async def test_second_turn_reuses_the_prefix(llama, open_engine, kind):
    first = [{"role": "user", "content": "What is the capital of France?"}]
    other = [{"role": "user", "content": "What is the capital of Spain?"}]
    with trio.fail_after(TIMEOUT):
        async with open_engine(llama, **TINY) as engine:
            p1 = encode(llama, engine.render_chat(first))
            tokens1, finish1 = await run(engine, engine.render_chat(first), max_tokens=12, slot=3)
            assert finish1.stats.reused_tokens == 0

            # A new prompt that parts from the first inside the first prompt: the slot
            # keeps exactly the common prefix of the two prompts.
            p2 = encode(llama, engine.render_chat(other))
            tokens2, finish2 = await run(engine, engine.render_chat(other), max_tokens=12, slot=3)
            assert finish2.stats.slot == 3
            assert 0 < common_prefix(p1, p2) < len(p1)
            assert finish2.stats.reused_tokens == min(common_prefix(p1, p2), len(p2) - 1)
            fresh2, _ = await run(engine, engine.render_chat(other), max_tokens=12, slot=1)
            assert outputs(tokens2) == outputs(fresh2)

            # The conversation goes on: the whole previous turn (prompt and reply) is
            # resident, so all of it that the new prompt repeats is reused.
            reply = text(tokens2, finish2)
            chat3 = other + [{"role": "assistant", "content": reply},
                             {"role": "user", "content": "And of Italy?"}]
            p3 = encode(llama, engine.render_chat(chat3))
            tokens3, finish3 = await run(engine, engine.render_chat(chat3), max_tokens=12, slot=3)
            if kind == "engine":  # the generated ids are known: what the slot holds, exactly
                held = resident(p2, ids(tokens2), finish2)
                assert finish3.stats.reused_tokens == min(common_prefix(held, p3), len(p3) - 1)
            assert finish3.stats.reused_tokens >= len(p2)  # all of the previous prompt, at least
            fresh3, _ = await run(engine, engine.render_chat(chat3), max_tokens=12, slot=2)
            assert outputs(tokens3) == outputs(fresh3)


# ---- 3. cancellation ---------------------------------------------------------------------

# Token 2 is <|im_end|>, an end-of-turn token: the model never emits it, so a prompt that
# continues with it cannot share more than the tokens before it with a slot's history.
EOT = 2


def follow_up(kind, prompt: str, p1: tuple[int, ...], got: list[TokenEvent], extra: tuple[int, ...]):
    """A prompt that repeats a cancelled turn's prompt and tokens, then goes elsewhere: as
    token ids for the Engine; as text for a mux engine, which takes nothing else."""
    if kind == "engine":
        return p1 + tuple(ids(got)) + (EOT, *extra)
    return prompt + "".join(t.text for t in got) + "<|im_end|>" + " and so on" * len(extra)


async def test_cancel_by_leaving_the_stream_block(llama, open_engine, kind):
    prompt = "Once upon a time there was a tiny model"
    p1 = encode(llama, prompt)
    with trio.fail_after(TIMEOUT):
        async with open_engine(llama, **TINY) as engine:
            got = []
            async with engine.stream(p1 if kind == "engine" else prompt, max_tokens=200, slot=1) as events:
                async for event in events:
                    got.append(event)
                    if len(got) == 5:
                        break  # leaving the block cancels the request

            # The slot is free at once: a request naming it is accepted, not SlotBusy.
            p2 = follow_up(kind, prompt, p1, got, (40, 41, 42))
            tokens, finish = await run(engine, p2, max_tokens=8, slot=1)
            assert finish.stats.slot == 1
            if kind == "engine":
                # The KV computed before the cancel is kept: the prompt and the generated
                # tokens fed back (at least the four before the last one received).
                assert len(p1) + len(got) - 1 <= finish.stats.reused_tokens <= len(p1) + len(got)
            else:  # the prompt's KV at least (the text of the answer may tokenize otherwise)
                p2_ids = encode(llama, p2)
                assert finish.stats.reused_tokens >= min(common_prefix(p1, p2_ids), len(p2_ids) - 1) > 0
            fresh, _ = await run(engine, p2, max_tokens=8, slot=3)
            assert outputs(tokens) == outputs(fresh)


async def test_cancel_from_another_task(llama, open_engine, kind):
    prompt = "A long story about a small robot"
    p1 = encode(llama, prompt)
    with trio.fail_after(TIMEOUT):
        async with open_engine(llama, **TINY) as engine:
            got, finish = [], None
            running = trio.Event()

            async def reader(*, task_status=trio.TASK_STATUS_IGNORED):
                nonlocal finish
                async with engine.stream(p1 if kind == "engine" else prompt, max_tokens=200,
                                         slot=2) as events:
                    task_status.started(events.request_id)
                    async for event in events:
                        if isinstance(event, TokenEvent):
                            got.append(event)
                            if len(got) == 4:
                                running.set()
                finish = events.finish

            async with trio.open_nursery() as nursery:
                rid = await nursery.start(reader)
                await running.wait()
                await engine.cancel(rid)
                # Right away, a request naming the slot is accepted (the cancel is handled
                # first); the reader may still be reading its last events meanwhile.
                seen = list(got)
                p2 = follow_up(kind, prompt, p1, seen, (50, 51))
                tokens, next_finish = await run(engine, p2, max_tokens=8, slot=2)

            assert finish.stats.finish_reason == "cancelled"
            assert finish.stats.emitted_tokens == len(got) < 200
            assert next_finish.stats.slot == 2
            if kind == "engine":
                # The next turn kept the KV computed before the cancel: the prompt and the
                # generated tokens fed back, as far as the new prompt repeats them.
                held = resident(p1, ids(got), finish)
                assert next_finish.stats.reused_tokens == min(common_prefix(held, p2), len(p2) - 1)
                assert next_finish.stats.reused_tokens >= len(p1) + len(seen) - 1
            else:
                p2_ids = encode(llama, p2)
                assert next_finish.stats.reused_tokens >= min(common_prefix(p1, p2_ids), len(p2_ids) - 1) > 0
            fresh, _ = await run(engine, p2, max_tokens=8, slot=0)
            assert outputs(tokens) == outputs(fresh)


async def test_stop_ends_a_request_through_its_finish(llama, open_engine):
    with trio.fail_after(TIMEOUT):
        async with open_engine(llama, **TINY) as engine:
            async with engine.stream("A story that goes on", max_tokens=200) as events:
                got = 0
                async for event in events:
                    if isinstance(event, TokenEvent):
                        got += 1
                        if got == 3:
                            await engine.stop(events.request_id)
            stats = events.finish.stats
            assert stats.finish_reason == "stop"
            assert 3 <= stats.emitted_tokens == got < 200
            for call in (engine.stop, engine.cancel):
                with pytest.raises(NotFound):
                    await call(events.request_id)  # finished: no longer in flight
                with pytest.raises(NotFound):
                    await call(987654)
