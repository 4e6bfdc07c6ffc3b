"""`motet serve`'s errors end to end, over the real server: a bad request field is a 400
naming the field (the app's own check, on the in-process Engine), a bad body through the
official client, a full queue is a 429, an engine's refusals are 4xx and a closing engine a
503, and a client that goes away cancels its request and frees its slot. Both backends where
the engine answers (conftest.py's `serve_tiny`); no mocks, hard timeouts."""

from __future__ import annotations

import json
from functools import partial

import httpx
import openai
import pytest
import trio
from conftest import metric
from http_helpers import HELLO, TIMEOUT, TINY, in_thread, sync_client, tiny_server, wait_until

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
