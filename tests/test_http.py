"""`motet serve` end to end: the real server (Hypercorn's Trio worker, in the test's
nursery, on a free loopback port) over a real engine, called with the official `openai`
client (sync in a worker thread, async under Trio) and with httpx and raw sockets where
the bytes matter. No mocks; hard timeouts; no timing assertions.

The API's behaviour is tested on both engines the server drives (the `backend`
fixtures): the in-process Engine, and a `motet mux` child behind the server's own
open_engine (as `motet serve --engine-cmd "motet mux"` runs it). Request validation is
the app's alone and runs on the in-process Engine only.

The tiny llama checkpoint (vocab 512, gibberish but real) serves most tests, with one
geometry for all of them so they share compiled functions; the default model
(SmolLM2-135M) serves the tests where the text matters. Safety (auth, CORS, limits,
static files) is in test_http_safety.py.
"""

from __future__ import annotations

import json
import shlex
import signal
import subprocess
import sys
from contextlib import asynccontextmanager
from functools import partial

import httpx
import openai
import pytest
import trio
from conftest import COMPILE_CACHE, GOLDEN, MUX_COMMAND, REPO, metric

from motet.cli.compose import open_engine
from motet.engines.engine import Engine
from motet.http.serve import serve_app
from motet.runtime.config import ExpertSettings
from motet.runtime.serve_settings import ServeSettings
from motet.runtime.slot_table import common_prefix

# as tests/engine_helpers.py, without the warm-up (tests/test_warm_start.py covers it)
TINY = dict(kv_slots=4, max_context=256, prefill_chunk=16, warm_up=False)
SMOL = dict(kv_slots=16, max_context=512, prefill_chunk=64, warm_up=False)
TIMEOUT = 240  # seconds; a hang fails the test instead of the suite
HELLO = [{"role": "user", "content": "Hello there, how are you?"}]
MUX_CMD = shlex.join(MUX_COMMAND)  # `motet mux`, sharing the tests' compilation cache
BACKENDS = ("engine", "mux")


@asynccontextmanager
async def serving(engine, **settings):
    """The app for `engine` on a free loopback port; yields its base URL."""
    async with trio.open_nursery() as nursery:
        urls = await nursery.start(partial(serve_app, engine, ServeSettings(port=0, **settings)))
        yield urls[0]
        nursery.cancel_scope.cancel()


@asynccontextmanager
async def engine_server(model, engine_kw, **settings):
    """The server over an in-process Engine; yields (engine, url)."""
    with trio.fail_after(TIMEOUT):
        async with Engine(model, **engine_kw) as engine, serving(engine, **settings) as url:
            yield engine, url


def tiny_server(llama, engine_kw=TINY, **settings):
    return engine_server(llama, engine_kw, **settings)


@asynccontextmanager
async def mux_server(model_path, engine_kw=TINY, **settings):
    """The server over `motet mux` running `model_path`, opened as `motet serve
    --engine-cmd` opens it (a RestartingEngine); yields (engine, url). The child takes
    the slots, context and queue limit of `engine_kw`, not its prefill chunk."""
    geometry = {k: engine_kw[k] for k in ("kv_slots", "max_context", "queue_limit") if k in engine_kw}
    settings = ServeSettings(port=0, engine_cmd=MUX_CMD, model_path=model_path, **geometry, **settings)
    with trio.fail_after(TIMEOUT):
        async with open_engine(settings, None) as engine, trio.open_nursery() as nursery:
            url = (await nursery.start(partial(serve_app, engine, settings)))[0]
            yield engine, url
            nursery.cancel_scope.cancel()


@pytest.fixture(params=BACKENDS)
def serve_tiny(request):
    """serve_tiny(engine_kw=TINY, **settings): the server over the tiny llama, on the
    in-process Engine or a `motet mux` child; an async context manager of (engine, url)."""
    if request.param == "engine":
        return partial(tiny_server, request.getfixturevalue("llama"))
    return partial(mux_server, GOLDEN / "llama")


@pytest.fixture(params=BACKENDS)
def serve_smol(request):
    """As serve_tiny, over the default model (SMOL geometry)."""
    if request.param == "engine":
        return partial(engine_server, request.getfixturevalue("default_model"), SMOL)
    return partial(mux_server, request.getfixturevalue("default_model_file"), SMOL)


def sync_client(url: str, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=kw.pop("api_key", "none"), max_retries=0, **kw)


def async_client(url: str, **kw) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key=kw.pop("api_key", "none"), max_retries=0, **kw)


async def in_thread(fn, *args, **kwargs):
    return await trio.to_thread.run_sync(partial(fn, *args, **kwargs))


async def sse_objects(response: httpx.Response) -> list:
    """The data of each server-sent event: JSON objects, and the final "[DONE]"."""
    out = []
    async for line in response.aiter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
        else:
            assert line == "", line  # events are `data:` lines and blank separators only
    return out


async def wait_until(predicate, poll_s: float = 0.01):
    while not predicate():
        await trio.sleep(poll_s)


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


# ---- errors ------------------------------------------------------------------------


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/chat/completions", {"temperature": 3}, "temperature"),
    ("/v1/chat/completions", {"top_p": 0}, "top_p"),
    ("/v1/chat/completions", {"n": 17}, "n"),
    ("/v1/completions", {"n": 2, "cache_slot": 0}, "cache_slot"),
    ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {"presence_penalty": 2.5}, "presence_penalty"),
    ("/v1/chat/completions", {"frequency_penalty": "1"}, "frequency_penalty"),
    ("/v1/completions", {"repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/chat/completions", {"logit_bias": {"x": 1}}, "logit_bias"),
    ("/v1/chat/completions", {"logit_bias": {"5": 101}}, "logit_bias"),
    ("/v1/chat/completions", {"logit_bias": [5, 1]}, "logit_bias"),
    ("/v1/completions", {"stop_token_ids": [-1]}, "stop_token_ids"),
    ("/v1/completions", {"stop_token_ids": 3}, "stop_token_ids"),
    ("/v1/chat/completions", {"max_tokens": 0}, "max_tokens"),
    ("/v1/chat/completions", {"max_tokens": "12"}, "max_tokens"),
    ("/v1/chat/completions", {"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ("/v1/chat/completions", {"top_logprobs": 9, "logprobs": True}, "top_logprobs"),
    ("/v1/chat/completions", {"cache_slot": 4}, "cache_slot"),
    ("/v1/chat/completions", {"top_k": -2}, "top_k"),
    ("/v1/chat/completions", {"top_k": 1 << 40}, "top_k"),  # past the sampler's int32
    ("/v1/completions", {"min_p": 1.5}, "min_p"),
    ("/v1/chat/completions", {"messages": None}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "function", "content": "x"}]}, "messages[0].role"),
    ("/v1/chat/completions", {"model": None}, "model"),
    ("/v1/completions", {"prompt": ["a", "b"]}, "prompt"),
    ("/v1/completions", {"logprobs": 6}, "logprobs"),
])
async def test_bad_fields_are_400_naming_the_field(llama, path, body, param):
    base = {"model": "m", "max_tokens": 2}
    base |= {"messages": HELLO} if "chat" in path else {"prompt": "hi"}
    async with tiny_server(llama) as (engine, url):
        async with httpx.AsyncClient(base_url=url) as http:
            response = await http.post(path, json={**base, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert error["message"] and "code" in error


async def test_bad_request_through_the_openai_client_and_bad_json(llama):
    async with tiny_server(llama) as (engine, url):
        with pytest.raises(openai.BadRequestError) as caught:
            await in_thread(sync_client(url).chat.completions.create, model="m", messages=HELLO, n=17)
        async with httpx.AsyncClient(base_url=url) as http:
            broken = await http.post("/v1/chat/completions", content=b"{not json")
            missing = await http.post("/v1/chat/completions", json={"model": "m"})
    assert caught.value.status_code == 400 and caught.value.body["param"] == "n"
    assert broken.status_code == 400 and broken.json()["error"]["param"] is None
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "messages"


async def test_full_queue_is_429_with_retry_after(serve_tiny):
    # 4 slots and one place in the queue: a burst of 24 long requests cannot all be
    # taken, so some are refused at once, each with a 429 and a Retry-After.
    async with serve_tiny({**TINY, "queue_limit": 1}) as (engine, url):
        responses = []

        async def one(http, i):
            responses.append(await http.post("/v1/completions", json={
                "model": "m", "prompt": f"story {i}", "max_tokens": 240, "temperature": 0}))

        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT,
                                     limits=httpx.Limits(max_connections=32)) as http:
            async with trio.open_nursery() as nursery:
                for i in range(24):
                    nursery.start_soon(one, http, i)
    statuses = sorted(r.status_code for r in responses)
    assert set(statuses) == {200, 429} and statuses.count(200) >= 5, statuses
    refused = next(r for r in responses if r.status_code == 429)
    assert refused.headers["Retry-After"] == "1"
    assert refused.json()["error"]["code"] == "queue_full"


async def test_engine_refusals_are_4xx_naming_the_field_and_a_closing_engine_503(serve_tiny):
    # what the engine refuses (not the request parser): an empty prompt, one past the
    # context, a cache slot in use; then an engine that drains
    async with serve_tiny() as (engine, url):
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as http:
            post = partial(http.post, "/v1/completions")
            empty = await post(json={"model": "m", "prompt": "", "max_tokens": 2})
            too_long = await post(json={"model": "m", "prompt": "word " * 300, "max_tokens": 2})
            chat_too_long = await http.post("/v1/chat/completions", json={
                "model": "m", "messages": [{"role": "user", "content": "word " * 300}], "max_tokens": 2})
            body = {"model": "m", "prompt": "a long one", "max_tokens": 240, "cache_slot": 1, "stream": True}
            async with http.stream("POST", "/v1/completions", json=body) as holder:
                busy = await post(json={**body, "stream": False})
                await holder.aclose()
            # closing: health says so, new requests are refused (a RestartingEngine's
            # MuxEngine drains as the in-process Engine does)
            await getattr(engine, "current", engine).drain()
            health = await http.get("/health")
            refused = await post(json={"model": "m", "prompt": "x", "max_tokens": 1})
    for response, param in ((empty, "prompt"), (too_long, "prompt"), (chat_too_long, "messages")):
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"]
    assert too_long.json()["error"]["code"] == "context_length_exceeded"
    assert busy.status_code == 409 and busy.headers["Retry-After"] == "1", busy.text
    assert busy.json()["error"]["param"] == "cache_slot"
    assert health.status_code == 503 and health.json()["status"] == "closing"
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"


# ---- disconnects -------------------------------------------------------------------


async def raw_request(url: str, method: str, path: str, body: dict | None = None) -> trio.SocketStream:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    stream = await trio.open_tcp_stream(host, int(port))
    data = json.dumps(body).encode() if body is not None else b""
    await stream.send_all(f"{method} {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                          f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return stream


async def test_disconnect_cancels_a_stream_and_frees_its_slot(serve_tiny):
    async with serve_tiny() as (engine, url):
        body = {"model": "m", "messages": HELLO, "max_tokens": 240, "stream": True, "cache_slot": 2}
        stream = await raw_request(url, "POST", "/v1/chat/completions", body)
        head = b""
        while b'"role":"assistant"' not in head:  # the headers, then the role chunk: accepted
            head += await stream.receive_some(65536)
        assert head.startswith(b"HTTP/1.1 200")
        await stream.aclose()
        await wait_until(lambda: engine.statistics().running == 0)
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as http:
            again = await http.post("/v1/chat/completions", json={**body, "max_tokens": 2, "stream": False})
            metrics = (await http.get("/metrics")).text
    assert again.status_code == 200, again.text
    assert again.json()["colibri"]["stats"]["slot"] == 2
    assert metric(metrics, "motet_requests_total", finish_reason="cancelled") == 1
    assert metric(metrics, "motet_requests_total", finish_reason="length") == 1


async def test_disconnect_cancels_a_non_streaming_request(serve_tiny):
    async with serve_tiny() as (engine, url):
        body = {"model": "m", "prompt": "a long one", "max_tokens": 240}
        stream = await raw_request(url, "POST", "/v1/completions", body)
        await wait_until(lambda: engine.statistics().running == 1)
        await stream.aclose()
        await wait_until(lambda: engine.statistics().running == 0)
        async with httpx.AsyncClient(base_url=url) as http:
            metrics = (await http.get("/metrics")).text
    assert metric(metrics, "motet_requests_total", finish_reason="cancelled") == 1


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
    engine_kw = dict(kv_slots=2, max_context=256, prefill_chunk=16, experts=experts)
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
