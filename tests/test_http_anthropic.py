"""Anthropic's Messages API on the real server, through the official `anthropic` client,
on both backends: text, system prompts, streaming events in Anthropic's order, stop
sequences, usage, count_tokens, tool_use and tool_result blocks, thinking blocks, and
errors in Anthropic's shape."""

from __future__ import annotations

from functools import partial

import anthropic
import httpx
import jsonschema
import pytest
import test_http_reasoning
from http_helpers import SMOL, engine_server, in_thread, tiny_server

thinking_llama = test_http_reasoning.thinking_llama  # the fixture: a tiny model whose template thinks

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


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
     "a user message takes text, tool_result blocks"),
    ({"max_tokens": 4, "messages": QUESTION, "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
     "server tools are not run here"),
    ({"max_tokens": 4, "messages": QUESTION, "tools": [{"name": "no spaces"}]}, "'tools[0].name'"),
    ({"max_tokens": 4, "messages": QUESTION, "tool_choice": {"type": "sometimes"}}, "'tool_choice' must be"),
    ({"max_tokens": 4, "messages": QUESTION, "thinking": {"type": "maybe"}}, "'thinking' must be"),
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


WEATHER = {"name": "get_weather", "description": "The weather in a city now", "input_schema": {
    "type": "object", "additionalProperties": False, "required": ["city"],
    "properties": {"city": {"type": "string", "maxLength": 24}}}}
ADD = {"name": "add", "description": "Add two numbers", "input_schema": {
    "type": "object", "additionalProperties": False, "required": ["a", "b"],
    "properties": {"a": {"type": "integer", "maximum": 999}, "b": {"type": "integer", "maximum": 999}}}}
WEATHER_Q = [{"role": "user", "content": "What is the weather in Paris?"}]


def uses(message) -> list[tuple[str, dict]]:
    """The tool_use blocks of a message, each input valid for its tool's schema."""
    schemas = {t["name"]: t["input_schema"] for t in (WEATHER, ADD)}
    out = []
    for block in message.content:
        if block.type == "tool_use":
            jsonschema.validate(block.input, schemas[block.name])
            assert block.id.startswith("toolu_")
            out.append((block.name, block.input))
    return out


async def test_tool_use_any_named_and_streamed_and_a_tool_result_back(default_model):
    """The server translates Anthropic's tools, whichever engine it drives: the in-process
    one here (test_http_tools runs tool calls over a mux engine too)."""
    async with engine_server(default_model, SMOL) as (engine, url):
        ask = partial(client(url).messages.create, model="smol", max_tokens=60, extra_body={"temperature": 0},
                      tools=[WEATHER, ADD])
        forced = await in_thread(ask, messages=WEATHER_Q, tool_choice={"type": "any"})
        named = await in_thread(ask, messages=WEATHER_Q,
                                tool_choice={"type": "tool", "name": "add", "disable_parallel_tool_use": True})
        none = await in_thread(ask, messages=WEATHER_Q, tool_choice={"type": "none"})

        def stream():
            with client(url).messages.stream(model="smol", max_tokens=60, extra_body={"temperature": 0},
                                              tools=[WEATHER, ADD], tool_choice={"type": "any"},
                                              messages=WEATHER_Q) as events:
                kinds = [e.type for e in events]
                return kinds, events.get_final_message()

        kinds, streamed = await in_thread(stream)
        call = forced.content[-1]
        back = await in_thread(ask, messages=[
            *WEATHER_Q, {"role": "assistant", "content": [{"type": "tool_use", "id": call.id, "name": call.name,
                                                           "input": call.input}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                          "content": [{"type": "text", "text": "sunny, 24 degrees"}]}]}])
    assert uses(forced) and forced.stop_reason == "tool_use"
    assert [name for name, _ in uses(named)] == ["add"]
    assert none.stop_reason in ("end_turn", "max_tokens") and not uses(none)
    assert uses(streamed) == uses(forced) and streamed.stop_reason == "tool_use"  # greedy both times
    assert "content_block_start" in kinds and "content_block_stop" in kinds
    assert back.content[0].type == "text" and back.content[0].text


async def test_thinking_blocks_streamed_and_not(thinking_llama):
    async with tiny_server(thinking_llama) as (engine, url):
        ask = partial(client(url).messages.create, model="m", max_tokens=16, extra_body={"temperature": 0},
                      messages=QUESTION)
        thought = await in_thread(ask, thinking={"type": "enabled", "budget_tokens": 1024})
        plain = await in_thread(ask, thinking={"type": "disabled"})

        def stream():
            with client(url).messages.stream(model="m", max_tokens=16, extra_body={"temperature": 0},
                                              messages=QUESTION, thinking={"type": "enabled",
                                                                           "budget_tokens": 1024}) as events:
                deltas = [e.delta.type for e in events if e.type == "content_block_delta"]
                return deltas, events.get_final_message()

        deltas, streamed = await in_thread(stream)
        free = await engine.complete(engine.render_chat(QUESTION), max_tokens=16)
    # the block never closes in 16 tokens of the tiny model: all of it is thinking
    assert [b.type for b in thought.content] == ["thinking", "text"] and thought.content[0].thinking == free.text
    assert all(b.type == "text" for b in plain.content)
    assert set(deltas) == {"thinking_delta"} and streamed.content[0].thinking == free.text
