"""`motet serve` end to end: the real server (Hypercorn's Trio worker, in the test's
nursery, on a free loopback port) over a real engine, called with the official `openai`
client (sync in a worker thread, async under Trio) and with httpx and raw sockets where
the bytes matter. No mocks; hard timeouts; no timing assertions.

The API's behaviour is tested on both engines the server drives (conftest.py's
`serve_tiny` and `serve_smol`): the in-process Engine, and a `motet mux` child behind the
server's own open_engine (as `motet serve --engine-cmd "motet mux"` runs it).

The tiny llama checkpoint (vocab 512, gibberish but real) serves most tests, with one
geometry for all of them so they share compiled functions; the default model
(SmolLM2-135M) serves the tests where the text matters. Errors and disconnects are in
test_http_errors.py, safety (auth, CORS, limits, static files) in test_http_safety.py.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from functools import partial

import httpx
import openai
import pytest
import trio
from conftest import COMPILE_CACHE, GOLDEN, REPO, metric
from http_helpers import HELLO, TIMEOUT, async_client, engine_server, in_thread, mux_server, sync_client, wait_until

from motet.runtime.config import ExpertSettings
from motet.runtime.slot_table import common_prefix

# ---- chat and completions, with the openai client ----------------------------------


async def test_chat_non_streaming_sync_client(serve_tiny):
    async with serve_tiny() as (engine, url):
        client = sync_client(url)
        answer = await in_thread(client.chat.completions.create, model="anything", messages=HELLO,
                                 max_tokens=5, temperature=0)
    assert answer.id.startswith("chatcmpl-") and answer.object == "chat.completion"
    assert answer.model == engine.name == "llama"  # any model name in, the served one out
    assert answer.system_fingerprint.startswith("motet-") and answer.created > 0
    choice = answer.choices[0]
    assert choice.finish_reason == "length" and choice.message.role == "assistant"
    assert choice.message.content and choice.logprobs is None
    usage = answer.usage
    assert usage.completion_tokens == 5 and usage.prompt_tokens > 5
    assert usage.total_tokens == usage.prompt_tokens + 5
    assert usage.prompt_tokens_details.cached_tokens == 0
    colibri = answer.model_extra["colibri"]
    assert set(colibri) == {"stats", "perf", "topk", "entropy", "gpus", "repin"}
    assert colibri["stats"]["emitted_tokens"] == 5 and colibri["stats"]["finish_reason"] == "length"
    assert colibri["perf"]["dt"] > 0 and colibri["topk"] == []
    assert len(colibri["entropy"]) == 2  # per layer (the tiny llama has 2)


async def test_chat_streaming_async_client_with_usage(serve_tiny):
    async with serve_tiny() as (engine, url):
        client = async_client(url)
        async with client, await client.chat.completions.create(
                model="m", messages=HELLO, max_tokens=6, temperature=0, stream=True,
                stream_options={"include_usage": True}) as stream:
            chunks = [chunk async for chunk in stream]
        # the same request, not streamed: the same text
        whole = await in_thread(sync_client(url).chat.completions.create, model="m", messages=HELLO,
                                max_tokens=6, temperature=0)
    first, *middle, final, usage, colibri = chunks
    assert first.choices[0].delta.role == "assistant" and first.choices[0].delta.content == ""
    assert all(c.object == "chat.completion.chunk" and c.id == first.id for c in chunks[:-1])
    assert final.choices[0].finish_reason == "length" and final.choices[0].delta.content is None
    assert "".join(c.choices[0].delta.content for c in middle) == whole.choices[0].message.content
    assert usage.choices == [] and usage.usage.completion_tokens == 6
    assert all(c.usage is None for c in chunks[:-2])
    # the telemetry frame, last before [DONE]: the openai client passes it through as extra
    assert colibri.model_extra["colibri"]["stats"]["emitted_tokens"] == 6


async def test_completions_streamed_and_not(serve_tiny):
    async with serve_tiny() as (engine, url):
        client = sync_client(url)
        whole = await in_thread(client.completions.create, model="m", prompt="Once upon a time",
                                max_tokens=7, temperature=0)
        chunks = await in_thread(lambda: list(client.completions.create(
            model="m", prompt=["Once upon a time"], max_tokens=7, temperature=0, stream=True)))
    assert whole.id.startswith("cmpl-") and whole.object == "text_completion"
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 7
    *tokens, final, colibri = chunks
    assert "".join(c.choices[0].text for c in tokens) == whole.choices[0].text
    assert final.choices[0].finish_reason == "length"
    assert colibri.model_extra["colibri"]["stats"]["prompt_tokens"] == whole.usage.prompt_tokens


async def test_n_choices_streamed_and_not(serve_tiny):
    """`n`: one prompt, n answers in choices[i] (greedy ones all the single answer), the
    prompt counted once in the usage; streamed, each choice's chunks carry its index and
    each ends with its own finish reason. Sampled choices differ."""
    ask = dict(model="m", messages=HELLO, max_tokens=6, temperature=0)
    async with serve_tiny() as (engine, url):
        client = async_client(url)
        async with client:
            one = await client.chat.completions.create(**ask)
            two = await client.chat.completions.create(**ask, n=2)
            async with await client.chat.completions.create(**ask, n=3, stream=True,
                                                            stream_options={"include_usage": True}) as stream:
                chunks = [chunk async for chunk in stream]
            sampled = await client.completions.create(model="m", prompt="Once upon a time", max_tokens=8,
                                                      temperature=1.0, seed=5, n=3)
    answer = one.choices[0].message.content
    assert [c.index for c in two.choices] == [0, 1]
    assert [c.message.content for c in two.choices] == [answer, answer]
    assert two.usage.prompt_tokens == one.usage.prompt_tokens
    assert two.usage.completion_tokens == 2 * one.usage.completion_tokens
    texts, finishes = ["", "", ""], [None, None, None]
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            finishes[choice.index] = finishes[choice.index] or choice.finish_reason
    assert texts == [answer] * 3 and finishes == ["length"] * 3
    assert chunks[-2].usage.completion_tokens == 3 * one.usage.completion_tokens
    assert [c.index for c in sampled.choices] == [0, 1, 2]
    assert len({c.text for c in sampled.choices}) > 1


async def test_logprobs_with_top_candidates(serve_tiny):
    async with serve_tiny() as (engine, url):
        client = sync_client(url)
        chat = await in_thread(client.chat.completions.create, model="m", messages=HELLO,
                               max_tokens=4, temperature=0, logprobs=True, top_logprobs=3)
        legacy = await in_thread(client.completions.create, model="m", prompt="Once upon a time",
                                 max_tokens=4, temperature=0, logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 4
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        # greedy: the sampled token is the most likely candidate
        assert entry.token == entry.top_logprobs[0].token
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        ranked = [t.logprob for t in entry.top_logprobs]
        assert ranked == sorted(ranked, reverse=True)
    topk = chat.model_extra["colibri"]["topk"]
    assert len(topk) == 4 and all(len(t) == 3 and set(t[0]) == {"text", "logprob"} for t in topk)
    lp = legacy.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(len(top) <= 2 for top in lp.top_logprobs) and lp.text_offset[0] == 0


async def test_second_turn_reports_cached_tokens(serve_tiny):
    async with serve_tiny() as (engine, url):
        client = sync_client(url)
        ask = partial(client.chat.completions.create, model="m", messages=HELLO, max_tokens=3, temperature=0)
        first = await in_thread(ask)
        second = await in_thread(ask)  # the engine picks the slot holding the longest prefix
        # two conversations with one system prompt, in slots of their own: the second
        # starts from a copy of the first's prefix
        system = [{"role": "system", "content": "You are a terse assistant. Answer in one short line. " * 2}]
        questions = [system + [{"role": "user", "content": text}] for text in ("What is the sea?", "A colour?")]
        pinned = [await in_thread(ask, messages=messages, extra_body={"cache_slot": slot})
                  for slot, messages in zip((2, 3), questions)]
        a, b = (engine.tokenize(engine.render_chat(messages)) for messages in questions)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < second.usage.prompt_tokens
    assert second.model_extra["colibri"]["stats"]["reused_tokens"] == cached
    shared = common_prefix(a, b)
    assert shared > 16 and [p.usage.prompt_tokens_details.cached_tokens for p in pinned] == [0, shared]


async def test_stop_strings_and_length_on_the_default_model(serve_smol):
    question = [{"role": "user", "content": "What is the capital of France?"}]
    async with serve_smol() as (engine, url):
        client = sync_client(url)
        ask = partial(client.chat.completions.create, model="smol", messages=question, temperature=0)
        full = await in_thread(ask, max_tokens=20)
        stopped = await in_thread(ask, max_tokens=20, stop=["Paris", "Berlin"])
        short = await in_thread(ask, max_tokens=3)
        chunks = await in_thread(lambda: list(ask(max_tokens=20, stop="Paris", stream=True)))
    assert full.choices[0].message.content == "The capital of France is Paris."
    assert full.choices[0].finish_reason == "stop"
    assert stopped.choices[0].message.content == "The capital of France is "
    assert stopped.choices[0].finish_reason == "stop"
    assert short.choices[0].finish_reason == "length" and short.usage.completion_tokens == 3
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == "The capital of France is "
    assert chunks[-2].choices[0].finish_reason == "stop"


async def test_top_k_and_min_p_cut_the_draw(serve_tiny):
    """vLLM's and llama.cpp's top_k and min_p, as the openai client sends them (extra_body):
    cut to the likeliest token, a draw at temperature 1 is the greedy answer, whatever the
    seed. A mux engine gets them (and the seed) as SUBMIT's options."""
    async with serve_tiny() as (engine, url):
        client = sync_client(url)
        ask = partial(client.chat.completions.create, model="m", messages=HELLO, max_tokens=8)
        greedy = (await in_thread(ask, temperature=0)).choices[0].message.content
        for seed in range(3):
            for cut in ({"top_k": 1}, {"min_p": 1.0}):
                drawn = await in_thread(ask, temperature=1.0, seed=seed, extra_body=cut)
                assert drawn.choices[0].message.content == greedy, (seed, cut)
        free = {(await in_thread(ask, temperature=1.0, seed=seed)).choices[0].message.content for seed in range(3)}
        assert free != {greedy}  # without a cut, the tiny model's draws do differ


async def test_penalties_bias_and_stop_ids_from_the_official_client(serve_tiny):
    """OpenAI's logit_bias and penalties as the client sends them, vLLM's
    repetition_penalty and stop_token_ids through extra_body: a bias of 100 makes every
    token the one it names, and that token as a stop id ends the answer before it. A mux
    engine gets them as SUBMIT's options."""
    async with serve_tiny() as (engine, url):
        client = sync_client(url)
        ask = partial(client.completions.create, model="m", prompt="the sea is", max_tokens=6, temperature=0)
        plain = await in_thread(ask, max_tokens=24)
        penalized = await in_thread(ask, max_tokens=24, frequency_penalty=2.0, presence_penalty=1.0,
                                    extra_body={"repetition_penalty": 2.0})
        token = engine.tokenize(" sea", add_special=False)[0]
        forced = await in_thread(ask, logit_bias={str(token): 100})
        stopped = await in_thread(ask, logit_bias={str(token): 100}, extra_body={"stop_token_ids": [token]})
        repeated = engine.detokenize([token] * 6)
    assert penalized.choices[0].text != plain.choices[0].text
    assert forced.choices[0].text == repeated
    assert stopped.choices[0].text == "" and stopped.choices[0].finish_reason == "stop"
    assert stopped.usage.completion_tokens == 0


# ---- the other routes --------------------------------------------------------------


async def test_models_health_experts_and_metrics(serve_tiny):
    async with serve_tiny() as (engine, url):
        client = sync_client(url)
        models = await in_thread(client.models.list)
        model = await in_thread(client.models.retrieve, "llama")
        with pytest.raises(openai.NotFoundError) as missing:
            await in_thread(client.models.retrieve, "gpt-4")
        async with httpx.AsyncClient(base_url=url) as http:
            health = await http.get("/health")
            before = (await http.get("/metrics")).text
            await in_thread(client.chat.completions.create, model="m", messages=HELLO, max_tokens=3)
            after = await http.get("/metrics")
            experts = (await http.get("/experts")).json()
    assert [m.id for m in models.data] == ["llama"] and model.id == "llama" and model.object == "model"
    assert missing.value.body["code"] == "model_not_found"
    assert health.status_code == 200 and health.json()["status"] == "ok"
    startup = health.json()["startup"]  # both backends say how the engine came up (mux: its WARMUP line)
    assert startup["ready_s"] > 0 and startup["compiled"] >= 0 and startup["from_cache"] >= 0

    assert after.headers["content-type"].startswith("text/plain")
    assert metric(before, "motet_prompt_tokens_total") == 0
    assert metric(after.text, "motet_prompt_tokens_total") > 0
    assert metric(after.text, "motet_generation_tokens_total") == 3
    queries = metric(after.text, "motet_prefix_cache_queries_total")
    assert queries == metric(after.text, "motet_prompt_tokens_total")
    assert metric(after.text, "motet_prefix_cache_hits_total") == 0
    assert metric(after.text, "motet_requests_total", finish_reason="length") == 1
    assert metric(after.text, "motet_time_to_first_token_seconds_count") == 1
    assert metric(after.text, "motet_inter_token_latency_seconds_count") == 2
    assert metric(after.text, "motet_kv_slots_total") == 4
    assert metric(after.text, "motet_kv_slots_busy") == metric(after.text, "motet_requests_running") == 0
    assert metric(after.text, "motet_requests_waiting") == 0
    assert metric(after.text, "motet_experts", tier="device") == 2  # dense: one per layer
    assert metric(after.text, "motet_experts", tier="disk") == 0

    assert set(experts) == {"rows", "cols", "map", "hits", "seq", "gpus", "entropy", "repin",
                            "slots_busy", "slots_total", "tokens_per_s"}
    assert (experts["rows"], experts["cols"]) == (2, 1)
    assert len(bytes.fromhex(experts["map"])) == 2 and len(experts["entropy"]) == 2
    assert experts["slots_busy"] == 0 and experts["slots_total"] == 4
    assert experts["tokens_per_s"] > 0  # three tokens in the last few seconds


# ---- the command, and a mux engine behind the server -------------------------------


async def test_motet_serve_command_prints_how_to_call_it_and_stops_on_sigint():
    command = [sys.executable, "-m", "motet", "serve", "--model", str(GOLDEN / "llama"), "--port", "0",
               "--kv-slots", "2", "--max-context", "256", "--compile-cache", str(COMPILE_CACHE)]
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            process = await nursery.start(partial(trio.run_process, command, cwd=REPO, check=False,
                                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE))
            err = b""
            while b"python -c" not in err:  # the banner's last line
                chunk = await process.stderr.receive_some(65536)
                assert chunk, err.decode()
                err += chunk
            banner = err.decode()
            url = banner.split(" at ", 1)[1].split()[0]
            answer = await in_thread(sync_client(url).completions.create, model="m", prompt="hi",
                                     max_tokens=2)
            process.send_signal(signal.SIGINT)
            out = await process.stdout.receive_some(65536)
            assert await process.wait() == 0
    assert answer.choices[0].finish_reason == "length"
    assert f"curl {url}/v1/chat/completions" in banner and "OpenAI(base_url=" in banner
    assert out == b""  # stdout stays empty: everything the server says goes to stderr


async def test_a_mux_engine_behind_the_server_is_started_again_when_it_dies():
    async with mux_server(GOLDEN / "llama", {"kv_slots": 2, "max_context": 256}) as (engine, url):
        client = sync_client(url)
        ask = partial(client.chat.completions.create, model="m", messages=HELLO, max_tokens=3,
                      temperature=0, logprobs=True, top_logprobs=2)
        first = await in_thread(ask)
        async with httpx.AsyncClient(base_url=url) as http:
            assert (await http.get("/health")).status_code == 200
            engine.current.process.kill()  # the child dies
            await wait_until(lambda: engine.restarts == 1)
            down = await http.get("/health")
            await wait_until(lambda: engine.statistics().closing is False)
            up = await http.get("/health")
        again = await in_thread(ask)
    assert first.model == "llama" and first.choices[0].finish_reason == "length"
    assert len(first.choices[0].logprobs.content[0].top_logprobs) == 2
    assert down.status_code == 503 and up.status_code == 200
    assert again.choices[0].message.content == first.choices[0].message.content


async def test_tiered_experts_agree_across_metrics_and_the_expert_map(tiny_model, tmp_path):
    """A MoE model served with 2 experts per layer on the device: /metrics' experts per
    tier and /experts' map tell the same story, and answering moves experts."""
    experts = ExpertSettings(device_experts_per_layer=2, heat_file=tmp_path / "heat")
    engine_kw = dict(kv_slots=2, max_context=256, prefill_chunk=16, prefill_chunk_alone=16, experts=experts)
    async with engine_server(tiny_model("olmoe"), engine_kw) as (engine, url):
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
            r = await client.post("/v1/completions", json={"model": "m", "prompt": "the sea", "max_tokens": 12,
                                                           "temperature": 0})
            assert r.status_code == 200 and r.json()["colibri"]["stats"]["emitted_tokens"] > 0
            state = (await client.get("/experts")).json()
            text = (await client.get("/metrics")).text
    rows, cols = state["rows"], state["cols"]
    tiers = [b >> 6 for b in bytes.fromhex(state["map"])]
    per_tier = {name: metric(text, "motet_experts", tier=name) for name in ("device", "ram", "disk")}
    assert tiers.count(2) == per_tier["device"] == rows * 2  # the pools are full after a turn
    assert tiers.count(1) == per_tier["ram"] and tiers.count(0) == per_tier["disk"]
    assert sum(per_tier.values()) == rows * cols
