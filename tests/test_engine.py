"""The engine API end to end, on real models (no mocks): continuous batching, prefix
reuse, cancellation, typed errors, shutdown, chunked prefill, stop strings, telemetry, seeds.

Most behaviour is run twice, through the `engine` fixture's two kinds: the in-process
Engine, and a MuxEngine driving `motet mux` as a child process on the same model and
geometry. A mux engine sees text only (no token ids, no seeds, no telemetry channel), so
where a test checks token ids it checks them on the Engine, and the texts on both. Tests
of what only exists in-process (token-id prompts, seeds, telemetry, chunked prefill) use
Engine alone.

Models are loaded once per session (conftest); an Engine around a loaded Model is cheap,
so each test builds its own; a MuxEngine starts a child (a few seconds). Engines of one
model share a geometry where they can, so they share compiled functions. Every test runs
under a hard timeout; none asserts timing.
"""

from __future__ import annotations

import threading
from functools import partial

import numpy as np
import pytest
import trio
import trio.testing
from conftest import mux_engine

from motet.engines.engine import Engine
from motet.runtime.api import FinishEvent, StepRouting, Telemetry, TokenEvent
from motet.runtime.errors import (
    BadRequest,
    ContextExceeded,
    DuplicateId,
    EmptyPrompt,
    EngineClosed,
    EngineError,
    NotFound,
    QueueFull,
    SlotBusy,
)
from motet.runtime.slot_table import common_prefix

# The tiny llama checkpoint (vocab 512, context 512): for tests that need *a* model.
TINY = dict(kv_slots=4, max_context=256, prefill_chunk=16)
# The default model (SmolLM2-135M): one geometry for all its engines.
SMOL = dict(kv_slots=16, max_context=512, prefill_chunk=64)

TIMEOUT = 240  # seconds; a hang fails the test instead of the suite


@pytest.fixture
def llama(tiny_model):
    return tiny_model("llama")


@pytest.fixture(params=["engine", "mux"])
def kind(request) -> str:
    return request.param


@pytest.fixture
def open_engine(kind):
    """open_engine(model, **geometry) → an engine of this test's kind, not yet started."""
    return Engine if kind == "engine" else mux_engine


async def run(engine, prompt, **kwargs) -> tuple[list[TokenEvent], FinishEvent]:
    """One request, streamed to the end: its token events and its finish event."""
    async with engine.stream(prompt, **kwargs) as events:
        tokens = [event async for event in events if isinstance(event, TokenEvent)]
    return tokens, events.finish


def ids(tokens: list[TokenEvent]) -> list[int]:
    return [t.token_id for t in tokens]


def outputs(tokens: list[TokenEvent]) -> list[tuple[int | None, str]]:
    """What a request produced, token by token: ids (None from a mux engine) and texts."""
    return [(t.token_id, t.text) for t in tokens]


def text(tokens: list[TokenEvent], finish: FinishEvent) -> str:
    return "".join(t.text for t in tokens) + finish.text_tail


def encode(model, prompt: str) -> tuple[int, ...]:
    """The tokens an engine runs for a text prompt (Engine.encode; `motet mux` uses it too)."""
    tok = model.tokenizer
    add_bos = tok.add_bos and not (tok.bos_token and prompt.startswith(tok.bos_token))
    return tuple(tok.encode(prompt, add_special=add_bos))


def text_of_length(model, n: int) -> str:
    """A text prompt of exactly n tokens."""
    words = "sea " * n
    while len(encode(model, words)) > n:
        words = words[:-4]
    assert len(encode(model, words)) == n
    return words


def resident(prompt: tuple[int, ...], generated: list[int], finish: FinishEvent) -> tuple[int, ...]:
    """The tokens whose KV a slot holds after a turn: the prompt and every generated token
    fed back. The last emitted token is fed back only when the turn ended on an
    end-of-turn token (sampled after it); on `length` or a cancel it was never run."""
    fed = generated if finish.stats.finish_reason == "stop" else generated[:-1]
    return tuple(prompt) + tuple(fed)


# ---- 1. continuous batching ------------------------------------------------------------


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


# ---- 2. prefix reuse across turns ------------------------------------------------------


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


# ---- 3. cancellation -------------------------------------------------------------------

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


# ---- 4. typed errors -------------------------------------------------------------------


async def test_errors_leave_other_requests_untouched(llama, open_engine, kind):
    long_prompt = "The quick brown fox jumps over the lazy dog"
    with trio.fail_after(TIMEOUT):
        async with open_engine(llama, **TINY) as engine:
            alone = await engine.complete(long_prompt, max_tokens=180, slot=1)  # what it gives undisturbed
            long_tokens, long_finish = [], None
            streaming = trio.Event()

            async def long_request(*, task_status=trio.TASK_STATUS_IGNORED):
                nonlocal long_finish
                async with engine.stream(long_prompt, max_tokens=180, slot=0) as events:
                    task_status.started(events.request_id)
                    async for event in events:
                        if isinstance(event, TokenEvent):
                            long_tokens.append(event)
                            streaming.set()
                long_finish = events.finish

            async with trio.open_nursery() as nursery:
                rid = await nursery.start(long_request)
                await streaming.wait()

                with pytest.raises(SlotBusy) as busy:
                    async with engine.stream("hi", slot=0):
                        pass
                assert busy.value.slot == 0
                with pytest.raises(DuplicateId) as dup:
                    await engine.complete("hi", request_id=rid)
                assert dup.value.request_id == rid
                for empty in ("", [], ()):
                    with pytest.raises(EmptyPrompt):
                        await engine.complete(empty)
                for n in (256, 300):
                    # A mux engine takes text: one of exactly n tokens.
                    with pytest.raises(ContextExceeded) as ctx:
                        await engine.complete([5] * n if kind == "engine" else text_of_length(llama, n))
                    assert (ctx.value.used, ctx.value.limit) == (n, 256)
                for bad in (dict(slot=4), dict(slot=-1), dict(top_p=0.0), dict(max_tokens=0),
                            dict(temperature=-1.0), dict(top_logprobs=6), dict(request_id=0)):
                    with pytest.raises(BadRequest):
                        async with engine.stream("hi", **bad):
                            pass
                if kind == "mux":
                    with pytest.raises(BadRequest):  # the wire carries text only
                        await engine.complete([5, 6, 7])

            assert all(isinstance(e, EngineError) for e in (busy.value, dup.value, ctx.value))
            assert long_finish.stats.finish_reason == "length"
            assert long_finish.stats.emitted_tokens == 180
            # The errors came after its first token, while it decoded (how many of its
            # tokens they overlapped depends on the machine's speed, so it is not
            # asserted: a faster engine made that flaky), and it answered exactly what it
            # answers alone.
            assert "".join(e.text for e in long_tokens) + long_finish.text_tail == alone.text
            # And it produced what it produces alone.
            alone, _ = await run(engine, long_prompt, max_tokens=180, slot=1)
            assert outputs(long_tokens) == outputs(alone)


async def test_queue_full(llama, open_engine):
    with trio.fail_after(TIMEOUT):
        async with open_engine(llama, kv_slots=1, queue_limit=1, max_context=256,
                               prefill_chunk=16) as engine:
            results = {}

            async def request(name, prompt, max_tokens, *, task_status=trio.TASK_STATUS_IGNORED):
                async with engine.stream(prompt, max_tokens=max_tokens) as events:
                    task_status.started()  # accepted: running, or waiting for the slot
                    tokens = [e async for e in events if isinstance(e, TokenEvent)]
                results[name] = (tokens, events.finish)

            async with trio.open_nursery() as nursery:
                await nursery.start(request, "running", "first in", 150)
                await nursery.start(request, "waiting", "second in", 60)
                with pytest.raises(QueueFull) as full:
                    await engine.complete("third in")
                assert full.value.limit == 1
                assert not results  # both still in flight when the third was refused

        for name in ("running", "waiting"):
            assert results[name][1].stats.finish_reason == "length"
        # The one that waited got what it gets alone.
        async with open_engine(llama, **TINY) as engine:
            alone, _ = await run(engine, "second in", max_tokens=60)
        assert outputs(results["waiting"][0]) == outputs(alone)


async def test_an_engine_chosen_id_never_collides_with_a_callers(llama, open_engine):
    with trio.fail_after(TIMEOUT):
        async with open_engine(llama, **TINY) as engine:
            async with engine.stream("mine", max_tokens=50, request_id=1) as events:
                # A request that names no id must not be refused for the caller's id.
                other = await engine.complete("no id of its own", max_tokens=2)
                async for _ in events:
                    pass
    assert other.stats.request_id != 1


# ---- 5. shutdown -----------------------------------------------------------------------


async def consume(engine, prompt, log, *, ready_after=1, task_status=trio.TASK_STATUS_IGNORED,
                  **kwargs):
    """Stream `prompt` into `log`; started once accepted; `ready` after a few tokens. An
    engine error ends up in the log too."""
    ready = trio.Event()
    try:
        async with engine.stream(prompt, **kwargs) as events:
            task_status.started(ready)
            async for event in events:
                log.append(event)
                if len(log) >= ready_after:
                    ready.set()
    except EngineError as exc:
        log.append(exc)


def idle_trio_workers_only(before: set[threading.Thread]) -> list[str]:
    """Threads started since `before` that are not idle Trio worker threads. Trio keeps
    its idle to_thread workers (daemon threads named "Trio thread N" while idle) for ten
    seconds for reuse; any other new thread, or a worker still running a job (renamed
    while it runs), would be a leak."""
    return [t.name for t in set(threading.enumerate()) - before
            if not (t.daemon and t.name.startswith("Trio thread "))]


async def test_leaving_the_engine_finishes_requests_in_flight(llama, open_engine):
    before = set(threading.enumerate())
    logs = [[], [], []]
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as outer:
            async with open_engine(llama, **TINY) as engine:
                for i, log in enumerate(logs):
                    await outer.start(partial(consume, engine, f"request {i}", log, max_tokens=40))
                finished = [any(isinstance(e, FinishEvent) for e in log) for log in logs]
            # The engine has closed; the consumers read what it finished for them.
    assert not any(finished)  # all three were in flight when the block was left
    for log in logs:
        finish = log[-1]
        assert isinstance(finish, FinishEvent)
        assert finish.stats.finish_reason == "length"
        assert finish.stats.emitted_tokens == len(log) - 1 == 40
    assert idle_trio_workers_only(before) == []


class Boom(Exception):
    pass


async def test_leaving_the_engine_on_an_error_cancels_requests(llama, open_engine):
    before = set(threading.enumerate())
    logs = [[], [], []]
    raised = []
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as outer:
            try:
                async with open_engine(llama, **TINY) as engine:
                    ready = [await outer.start(partial(consume, engine, f"request {i}", log,
                                                       ready_after=2, max_tokens=200))
                             for i, log in enumerate(logs)]
                    for event in ready:
                        await event.wait()  # all three are decoding
                    raise Boom()
            except Boom as exc:  # the caller's own exception, not wrapped in a group
                raised.append(exc)
            # The consumers live in `outer`, which is not cancelled: they end because the
            # engine closed their streams, not because their own scope was cancelled.
    assert raised
    for log in logs:
        assert 2 <= len(log) - 1 < 200
        assert isinstance(log[-1], EngineClosed)
        assert not any(isinstance(e, FinishEvent) for e in log)
    assert idle_trio_workers_only(before) == []


async def test_a_closed_engine_refuses_requests(llama, open_engine):
    async with open_engine(llama, **TINY) as engine:
        pass
    outcome = []

    async def late():
        try:
            await engine.complete("too late", max_tokens=2)
        except EngineClosed as exc:
            outcome.append(exc)

    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(late)
            await trio.testing.wait_all_tasks_blocked()
            # No engine task is left to answer: if the call is still waiting, it hangs.
            nursery.cancel_scope.cancel()
    assert len(outcome) == 1


# ---- 6. chunked prefill does not starve decoding ---------------------------------------


async def test_a_long_prompt_does_not_stall_running_streams(llama):
    long_prompt = tuple(np.random.default_rng(7).integers(3, 512, size=230).tolist())
    n_chunks = -(-len(long_prompt) // TINY["prefill_chunk"])  # 15
    with trio.fail_after(TIMEOUT):
        async with Engine(llama, **TINY) as engine:
            order = []  # ("tok", i) for the decoding streams, ("long", what) for the long one
            decoders = [[] for _ in range(3)]
            long_tokens = []

            async def decoder(i, *, task_status=trio.TASK_STATUS_IGNORED):
                async with engine.stream(f"stream number {i}", max_tokens=90) as events:
                    async for event in events:
                        decoders[i].append(event)
                        if isinstance(event, TokenEvent):
                            order.append(("tok", i))
                            if len(decoders[i]) == 1:
                                task_status.started()

            async with trio.open_nursery() as nursery:
                for i in range(3):
                    await nursery.start(decoder, i)  # decoding before the long prompt comes
                async with engine.stream(long_prompt, max_tokens=8) as events:
                    order.append(("long", "accepted"))
                    async for event in events:
                        if isinstance(event, TokenEvent):
                            if not long_tokens:
                                order.append(("long", "first token"))
                            long_tokens.append(event)

        start, first = order.index(("long", "accepted")), order.index(("long", "first token"))
        between = order[start:first]
        # One prefill chunk, then one decode step, and so on: each running stream gets a
        # token after every chunk but the last (the one that emits the long prompt's
        # first token). One less for where in the loop the long request was taken in.
        # Prefilled in one go, the streams would get no token at all in this window; and
        # the long prompt is not starved either: one chunk per decode step.
        for i in range(3):
            assert n_chunks - 2 <= between.count(("tok", i)) <= n_chunks
            assert decoders[i][-1].stats.finish_reason == "length"

        async with Engine(llama, **TINY) as engine:
            alone, _ = await run(engine, long_prompt, max_tokens=8)
            assert ids(long_tokens) == ids(alone)
            for i in range(3):
                tokens, _ = await run(engine, f"stream number {i}", max_tokens=90)
                assert ids(tokens) == [e.token_id for e in decoders[i][:-1]]


# ---- 7. stop strings, length, top logprobs ---------------------------------------------


async def test_stop_strings_and_length(default_model, open_engine):
    chat = [{"role": "user", "content": "Write one sentence about the moon."}]
    with trio.fail_after(TIMEOUT):
        async with open_engine(default_model, **SMOL) as engine:
            prompt = engine.render_chat(chat)
            tokens, finish = await run(engine, prompt, max_tokens=24)
            assert finish.stats.finish_reason == "length"
            assert finish.stats.emitted_tokens == 24 == len(tokens)
            full = text(tokens, finish)

            # A stop string that spans two tokens, so it arrives in pieces.
            pieces = [t.text for t in tokens]
            k = next(k for k in range(3, len(pieces) - 1)
                     if len(pieces[k]) >= 2 and len(pieces[k + 1]) >= 2)
            stop = pieces[k][-2:] + pieces[k + 1][:2]
            want = full[: full.find(stop)]
            assert want
            async with engine.stream(prompt, max_tokens=24, stop=[stop, "never-seen"]) as events:
                streamed = ""
                async for event in events:
                    if isinstance(event, TokenEvent):
                        streamed += event.text
                        # Nothing released is taken back, so no part of the stop string
                        # is ever released either.
                        assert want.startswith(streamed)
            got = streamed + events.finish.text_tail
            assert got == want
            assert stop not in got
            assert not any(got.endswith(stop[:j]) for j in range(1, len(stop)))
            assert events.finish.stats.finish_reason == "stop"

            # A stop string that never shows up: the whole text, ended by the length.
            tokens_n, finish_n = await run(engine, prompt, max_tokens=24, stop="never-seen")
            assert text(tokens_n, finish_n) == full
            assert finish_n.stats.finish_reason == "length"

            short, finish_s = await run(engine, prompt, max_tokens=5)
            assert finish_s.stats.finish_reason == "length"
            assert finish_s.stats.emitted_tokens == 5 == len(short)
            assert outputs(short) == outputs(tokens)[:5]


async def test_top_logprobs(default_model, open_engine, kind):
    chat = [{"role": "user", "content": "Name three colours."}]
    with trio.fail_after(TIMEOUT):
        async with open_engine(default_model, **SMOL) as engine:
            prompt = engine.render_chat(chat)
            tokens, _ = await run(engine, prompt, max_tokens=8, top_logprobs=5)
            plain, _ = await run(engine, prompt, max_tokens=8)
    assert outputs(tokens) == outputs(plain)
    assert all(t.top == () for t in plain)
    for t in tokens:
        assert len(t.top) == 5
        lps = [c.logprob for c in t.top]
        assert lps == sorted(lps, reverse=True)
        assert all(lp <= 0 for lp in lps)
        assert t.top[0].token_id == t.token_id  # greedy: the sampled token is the best
        assert t.top[0].logprob == pytest.approx(t.logprob, abs=1e-5)
        if kind == "engine":
            assert len({c.token_id for c in t.top}) == 5
        else:  # the wire carries texts: the best candidate's is the token's
            assert t.top[0].text == t.text
    # TOPK lines carry four decimals: each logprob is off by up to 5e-5 through mux.
    assert sum(np.exp(c.logprob) for c in tokens[0].top) <= 1 + (3e-4 if kind == "mux" else 1e-5)


async def test_greedy_text_is_the_same_in_process_and_through_mux(llama):
    prompts = ["Once upon a time", "The sea is", "Three small robots"]
    results = {}
    with trio.fail_after(TIMEOUT):
        for name, factory in (("engine", Engine), ("mux", mux_engine)):
            async with factory(llama, **TINY) as engine:
                alone = [await engine.complete(p, max_tokens=20, slot=i) for i, p in enumerate(prompts)]
                together = [None] * len(prompts)

                async def one(i):
                    together[i] = await engine.complete(prompts[i], max_tokens=20, slot=i)

                async with trio.open_nursery() as nursery:  # batched this time
                    for i in range(len(prompts)):
                        nursery.start_soon(one, i)
            results[name] = [(c.text, c.stats.emitted_tokens, c.stats.finish_reason, c.stats.prompt_tokens)
                             for c in alone + together]
    assert results["mux"] == results["engine"]
    assert all(r[1] == 20 for r in results["engine"])


# ---- 8. telemetry ----------------------------------------------------------------------


async def next_telemetry(channel) -> Telemetry:
    """The next turn's Telemetry: the channel also carries each device step's StepRouting."""
    async for event in channel:
        if isinstance(event, Telemetry):
            return event


def drain_nowait(channel) -> list:
    """What a channel holds now."""
    out = []
    while True:
        try:
            out.append(channel.receive_nowait())
        except trio.WouldBlock:
            return out


async def test_telemetry_per_finished_turn(llama):
    with trio.fail_after(TIMEOUT):
        async with Engine(llama, **TINY) as engine:
            channel = await engine.telemetry()
            a = await engine.complete("first turn", max_tokens=6)
            b = await engine.complete("second turn", max_tokens=6)
            seen = [await next_telemetry(channel), await next_telemetry(channel)]
            # one per turn, no more
            assert not [e for e in drain_nowait(channel) if isinstance(e, Telemetry)]
    assert [t.request_id for t in seen] == [a.stats.request_id, b.stats.request_id]
    for t in seen:
        assert isinstance(t, Telemetry)
        assert t.prefill_s > 0
        assert t.decode_s > 0
        assert t.sample_s > 0
        assert t.expert_counts == ()  # a dense model routes nothing


async def test_telemetry_counts_routed_experts(tiny_model):
    moe = tiny_model("qwen3_moe")
    cfg = moe.config
    with trio.fail_after(TIMEOUT):
        async with Engine(moe, **TINY) as engine:
            channel = await engine.telemetry()
            done = await engine.complete("count the experts", max_tokens=6)
            t = await next_telemetry(channel)
    # Every token run through the model routes to k experts in each MoE layer: the
    # prompt (less what the slot reused) and each generated token fed back.
    s = done.stats
    fed = s.emitted_tokens if s.finish_reason == "stop" else s.emitted_tokens - 1
    run_tokens = s.prompt_tokens - s.reused_tokens + fed
    assert t.request_id == s.request_id
    assert len(t.expert_counts) == sum(cfg.moe_layers) > 0
    for layer in t.expert_counts:
        assert len(layer) == cfg.n_experts
        assert sum(layer) == cfg.n_experts_per_tok * run_tokens


async def test_step_routing_sums_to_the_turn_and_a_burst_is_one_event_of_its_steps(tiny_model):
    moe = tiny_model("qwen3_moe")
    with trio.fail_after(TIMEOUT):
        async with Engine(moe, **TINY, decode_burst=4) as engine:
            channel = await engine.telemetry()
            done = await engine.complete("route a burst or two", max_tokens=14)
            await trio.testing.wait_all_tasks_blocked()  # the call's routing goes out after its tokens
            events = drain_nowait(channel)
    (turn,) = [e for e in events if isinstance(e, Telemetry)]
    routed = [e for e in events if isinstance(e, StepRouting)]
    # every token the turn ran through the model, counted once, in the calls' events as in its own
    assert sum(e.counts for e in routed).tolist() == [list(layer) for layer in turn.expert_counts]
    decode_calls = routed[1:]  # after the prompt's chunk (it fits in TINY's 16 tokens)
    assert any(e.steps > 1 for e in decode_calls)
    sampled = done.stats.emitted_tokens + (done.stats.finish_reason == "stop")  # an EOS is sampled, not emitted
    assert sum(e.tokens for e in decode_calls) == sum(e.steps for e in decode_calls) == sampled - 1


# ---- 9. token-id prompts and seeds -----------------------------------------------------


async def test_token_id_prompt_equals_text_prompt(llama):
    with trio.fail_after(TIMEOUT):
        async with Engine(llama, **TINY) as engine:
            prompt = "Token ids or text, the same"
            by_text = await engine.complete(prompt, max_tokens=10, slot=0)
            by_ids = await engine.complete(list(engine.encode(prompt)), max_tokens=10, slot=1)
    assert by_ids.token_ids == by_text.token_ids
    assert by_ids.text == by_text.text
    assert by_ids.stats.prompt_tokens == by_text.stats.prompt_tokens


async def test_seeds(llama):
    prompt = "Sampling with a seed"
    sampled = dict(max_tokens=24, temperature=0.8)
    with trio.fail_after(TIMEOUT):
        async with Engine(llama, **TINY) as engine:
            a = await engine.complete(prompt, seed=1234, **sampled)
            # The same seed again, on another slot, batched with another request.
            async with trio.open_nursery() as nursery:
                nursery.start_soon(partial(engine.complete, "company", max_tokens=24))
                b = await engine.complete(prompt, seed=1234, slot=(a.stats.slot + 1) % 4,
                                          **sampled)
            assert b.stats.slot != a.stats.slot
            c = await engine.complete(prompt, seed=99, **sampled)
            greedy = await engine.complete(prompt, max_tokens=24)
    assert b.token_ids == a.token_ids
    assert b.text == a.text
    assert c.token_ids != a.token_ids  # two seeds agreeing on 24 draws: vanishingly unlikely
    assert a.token_ids != greedy.token_ids


async def test_a_reader_gone_before_acceptance_does_not_hurt_the_scheduler(llama):
    """A caller cancelled while its Submit waits in the inbox has closed its stream; the
    scheduler's answer to it must not take the engine down."""
    from motet.actors.scheduler_messages import Submit
    from motet.runtime.api import GenerationRequest

    with trio.fail_after(TIMEOUT):
        async with Engine(llama, **TINY) as engine:
            for slot in (None, 1):  # accepted into a slot, and refused as busy below
                send, receive = trio.open_memory_channel(10)
                receive.close()
                request = GenerationRequest(prompt="gone", max_tokens=4, slot=slot)
                await engine._scheduler.inbox.send.send(
                    Submit(10 + (slot or 0), request, engine.encode("gone"), send)
                )
            answer = await engine.complete("still here", max_tokens=4)
            assert answer.stats.emitted_tokens >= 1


async def test_a_model_that_cannot_load_raises_its_own_error(tmp_path):
    from motet.model import ModelFileError

    missing = tmp_path / "missing.gguf"
    with trio.fail_after(TIMEOUT):
        with pytest.raises(ModelFileError, match="missing.gguf"):
            async with Engine(missing):
                pass


async def test_a_cancel_while_draining_still_ends_the_engine(llama):
    """Leaving the block drains; a cancel that lands meanwhile cancels what still runs
    instead of leaving the engine's tasks behind."""
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as outer:
            with trio.CancelScope() as scope:
                async with Engine(llama, **TINY) as engine:
                    decoding = trio.Event()

                    async def consume():
                        try:
                            async with engine.stream("hello there", max_tokens=200) as events:
                                async for _ in events:
                                    decoding.set()
                                    if engine.statistics().closing:  # the drain has begun
                                        scope.cancel()
                        except EngineClosed:
                            pass

                    outer.start_soon(consume)
                    await decoding.wait()
    assert scope.cancelled_caught


async def test_a_prompt_with_a_lone_surrogate_is_a_bad_request(llama):
    with trio.fail_after(TIMEOUT):
        async with Engine(llama, **TINY) as engine:
            with pytest.raises(BadRequest, match="surrogate"):
                await engine.complete("hello \ud800 there", max_tokens=4)
            assert (await engine.complete("hello there", max_tokens=4)).stats.emitted_tokens > 0
