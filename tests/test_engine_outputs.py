"""What the engine API's requests give back, on real models: chunked prefill that does
not stall running streams, stop strings and length, top logprobs, telemetry, token-id
prompts and seeds, and the edges of a request's life (a reader gone early, a model that
cannot load, a prompt that is not text).

Most behaviour is run twice, through the `open_engine` fixture's two kinds: the
in-process Engine, and a MuxEngine driving `motet mux` as a child process on the same
model and geometry (engine_helpers.py and conftest.py hold what the engine tests share).
Every test runs under a hard timeout; none asserts timing.
"""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest
import trio
import trio.testing
from conftest import mux_engine
from engine_helpers import SMOL, TIMEOUT, TINY, consume, ids, outputs, run, text

from motet.engines.engine import Engine
from motet.engines.engine_args import lone_prompt_chunk
from motet.runtime.api import StepRouting, Telemetry, TokenEvent
from motet.runtime.errors import BadRequest, EngineClosed

# ---- 1. chunked prefill does not starve decoding -----------------------------------------


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


# ---- 2. stop strings, length, top logprobs -----------------------------------------------


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


async def test_a_prompt_alone_is_read_in_longer_chunks_than_beside_running_streams(llama):
    first, second = (tuple(np.random.default_rng(seed).integers(3, 512, size=100).tolist()) for seed in (8, 9))
    geometry = dict(TINY, prefill_chunk_alone=64, decode_burst=1)  # a decode call: one step

    def chunks(events) -> list[int]:  # the prompt's device calls: more rows than the decodes' 1 or 2
        return [e.tokens for e in events if isinstance(e, StepRouting) and e.tokens > 2]

    with trio.fail_after(TIMEOUT):
        async with Engine(llama, **geometry) as engine:
            channel = await engine.telemetry(buffer=1024)
            await run(engine, first, max_tokens=4)
            await trio.testing.wait_all_tasks_blocked()
            assert chunks(drain_nowait(channel)) == [64, 36]

            log = []
            async with trio.open_nursery() as nursery:
                ready = await nursery.start(partial(consume, engine, "a running stream", log, max_tokens=60))
                await ready.wait()
                drain_nowait(channel)
                await run(engine, second, max_tokens=4)
            await trio.testing.wait_all_tasks_blocked()
            assert chunks(drain_nowait(channel)) == [16] * 6 + [4]
    assert log[-1].stats.finish_reason == "length"  # it ran on while the second prompt was read


async def test_by_default_only_a_model_with_routed_experts_reads_a_lone_prompt_in_longer_chunks(tiny_model):
    prompt = tuple(np.random.default_rng(10).integers(3, 500, size=100).tolist())
    read_as = {}
    with trio.fail_after(TIMEOUT):
        for arch in ("llama", "qwen3_moe"):  # TINY's chunks of 16, without its prefill_chunk_alone
            async with Engine(tiny_model(arch), kv_slots=2, max_context=256, prefill_chunk=16, warm_up=False) as engine:
                channel = await engine.telemetry(buffer=1024)
                await run(engine, prompt, max_tokens=1)
                await trio.testing.wait_all_tasks_blocked()
                read_as[arch] = [e.tokens for e in drain_nowait(channel) if isinstance(e, StepRouting)]
    assert read_as == {"llama": [16] * 6 + [4], "qwen3_moe": [100]}
    assert lone_prompt_chunk(None, 256, routed_experts=True) == 512
    assert lone_prompt_chunk(None, 256, routed_experts=False) == 256
    assert lone_prompt_chunk(128, 256, routed_experts=True) == 256  # never below prefill_chunk


@pytest.mark.parametrize("chunks", [dict(prefill_chunk=100), dict(prefill_chunk_alone=8), dict(prefill_chunk_alone=0)])
def test_the_engine_refuses_a_prefill_chunk_that_is_no_power_of_two_from_16(chunks):
    name, value = next(iter(chunks.items()))
    with pytest.raises(ValueError, match=f"{name} must be a power of two >= 16, got {value}"):
        Engine(**chunks)


# ---- 3. telemetry ------------------------------------------------------------------------


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


# ---- 4. token-id prompts and seeds -------------------------------------------------------


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
