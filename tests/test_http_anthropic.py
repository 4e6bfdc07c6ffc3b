"""Anthropic's Messages API on the real server, through the official `anthropic` client,
on both backends: text, system prompts, streaming events in Anthropic's order, stop
sequences, usage, count_tokens, and errors in Anthropic's shape."""

from __future__ import annotations

import anthropic
import httpx
import pytest
import test_http
from test_http import in_thread, tiny_server

serve_smol = test_http.serve_smol  # the fixture: the default model's server on either backend

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture
def llama(tiny_model):
    return tiny_model("llama")


def client(url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key="none", max_retries=0)


async def test_messages_streamed_and_not_with_stop_sequences_and_usage(serve_smol):
    async with serve_smol() as (engine, url):
        ask = client(url).messages
        answer = await in_thread(ask.create, model="smol", max_tokens=20, extra_body={"temperature": 0}, messages=QUESTION)
        blocks = await in_thread(ask.create, model="smol", max_tokens=20, extra_body={"temperature": 0}, system="Be brief.",
                                 messages=[{"role": "user", "content": [{"type": "text", "text": QUESTION[0]["content"]}]}])
        stopped = await in_thread(ask.create, model="smol", max_tokens=20, extra_body={"temperature": 0}, messages=QUESTION,
                                  stop_sequences=["Paris"])
        short = await in_thread(ask.create, model="smol", max_tokens=3, extra_body={"temperature": 0}, messages=QUESTION)

        def stream():
            with ask.stream(model="smol", max_tokens=20, extra_body={"temperature": 0}, messages=QUESTION) as events:
                kinds = [e.type for e in events]
                return kinds, events.get_final_message()

        kinds, final = await in_thread(stream)
        counted = await in_thread(client(url).messages.count_tokens, model="smol", messages=QUESTION)
    assert answer.content[0].type == "text" and answer.content[0].text == "The capital of France is Paris."
    assert answer.stop_reason == "end_turn" and answer.stop_sequence is None and answer.role == "assistant"
    assert answer.usage.input_tokens > 0 and answer.usage.output_tokens > 0
    assert blocks.content[0].text
    assert stopped.content[0].text == "The capital of France is "
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == "Paris"
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 3
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "content_block_delta" in kinds
    assert final.content[0].text == answer.content[0].text and final.stop_reason == "end_turn"
    assert counted.input_tokens == answer.usage.input_tokens


@pytest.mark.parametrize(("body", "words"), [
    ({"messages": QUESTION}, "'max_tokens' is required"),
    ({"max_tokens": 4, "messages": []}, "'messages' must be a non-empty array"),
    ({"max_tokens": 4, "messages": [{"role": "system", "content": "x"}]}, "role"),
    ({"max_tokens": 4, "messages": QUESTION, "temperature": 1.5}, "'temperature' must be in [0, 1]"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "only text blocks"),
    ({"max_tokens": 4, "messages": QUESTION, "tools": [{"name": "f"}]}, "'tools' is not supported yet"),
    ({"max_tokens": 4, "messages": QUESTION, "stop_sequences": ["a", "b", "c", "d", "e"]}, "stop_sequences"),
])
async def test_bad_requests_are_400_in_anthropics_shape(llama, body, words):
    async with tiny_server(llama) as (engine, url):
        async with httpx.AsyncClient(base_url=url) as http:
            response = await http.post("/v1/messages", json=body)
        if "max_tokens" in body:  # the client itself requires it
            known = {k: v for k, v in body.items() if k in ("max_tokens", "messages", "stop_sequences", "tools")}
            extra = {k: v for k, v in body.items() if k not in known}  # temperature: not the client's any more
            with pytest.raises(anthropic.BadRequestError, match="invalid_request_error"):
                await in_thread(client(url).messages.create, model="m", **known, extra_body=extra)
    assert response.status_code == 400, response.text
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert words in error["error"]["message"]
