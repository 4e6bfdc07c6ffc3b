"""Tool calls on the chat route, through the real server and the official client: the
default model (whose template has no place for tools: motet's own system message asks
for the hermes format) on both backends, with `required`, a named function, `auto`
and `none`, streamed and not, and a conversation that carries a call and its result;
a tiny model with a Qwen-style template that renders the tools itself; each call
format forced by a grammar (`--tool-parser`); bad fields are 400s naming them."""

from __future__ import annotations

import json
from functools import partial

import httpx
import jsonschema
import pytest
from conftest import tiny_llama_with_template
from http_helpers import SMOL, TINY, engine_server, in_thread, sync_client, tiny_server

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city"],
           "properties": {"city": {"type": "string", "maxLength": 24}}}
ADD = {"type": "object", "additionalProperties": False, "required": ["a", "b"],
       "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999},
                      "b": {"type": "integer", "minimum": 0, "maximum": 999}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city now",
                                            "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "Add two numbers", "parameters": ADD}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def checked(calls) -> list[tuple[str, dict]]:
    """(name, arguments) of each call, its arguments valid for its function's schema."""
    out = []
    for call in calls:
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        assert call.id.startswith("call_") and call.type == "function"
        out.append((call.function.name, arguments))
    return out


def streamed_calls(chunks) -> list[tuple[str, dict]]:
    """The calls a stream's tool_calls deltas add up to (each comes whole here)."""
    calls: dict[int, dict] = {}
    for chunk in chunks:
        for delta in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            entry = calls.setdefault(delta.index, {"name": "", "arguments": ""})
            entry["name"] += delta.function.name or ""
            entry["arguments"] += delta.function.arguments or ""
    return [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())]


CHOICES = {"required": dict(tool_choice="required"),
           "named": dict(tool_choice={"type": "function", "function": {"name": "add"}}, parallel_tool_calls=False),
           "auto": {}, "none": dict(tool_choice="none")}


async def test_required_named_auto_and_none_streamed_and_not_from_the_official_client(serve_smol):
    whole, streamed = {}, {}
    async with serve_smol() as (engine, url):
        client = sync_client(url)
        chat = partial(client.chat.completions.create, model="smol", messages=ASK, max_tokens=60,
                       temperature=0, tools=TOOLS)
        for name, fields in CHOICES.items():
            whole[name] = await in_thread(chat, **fields)
            streamed[name] = await in_thread(lambda fields=fields: list(chat(stream=True, **fields)))
    for name, answer in whole.items():  # greedy: the stream says what the whole answer says
        message, chunks = answer.choices[0].message, streamed[name]
        calls = checked(message.tool_calls or [])
        assert streamed_calls(chunks) == calls, name
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == (message.content or ""), name
        reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert reasons == [answer.choices[0].finish_reason], name
    required = whole["required"].choices[0]
    assert checked(required.message.tool_calls) and required.finish_reason == "tool_calls"
    assert required.message.content is None
    assert [name for name, _ in checked(whole["named"].choices[0].message.tool_calls)] == ["add"]
    auto = whole["auto"].choices[0].message  # the model decides: a call that parses, or words
    assert (auto.tool_calls and checked(auto.tool_calls)) or auto.content
    assert whole["none"].choices[0].message.tool_calls is None and whole["none"].choices[0].message.content


async def test_a_call_and_its_result_go_back_through_the_template(default_model):
    """The server renders the conversation, whichever engine it drives: the in-process one here."""
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 24 degrees"}]
    async with engine_server(default_model, SMOL) as (engine, url):
        client = sync_client(url)
        answer = await in_thread(client.chat.completions.create, model="smol", messages=history, max_tokens=24,
                                 temperature=0, tools=TOOLS)
        async with httpx.AsyncClient(base_url=url) as http:
            plain = (await http.post("/tokenize", json={"messages": history})).json()["tokens"]
        text = engine.detokenize(plain)
    assert answer.choices[0].message.content and answer.choices[0].finish_reason in ("stop", "length")
    assert "sunny, 24 degrees" in text


QWEN_TOOLS = (  # the shape of Qwen's template: tools in the system turn, calls as hermes blocks
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>\n{%- for tool in tools %}\n{{ tool | tojson }}"
    "{%- endfor %}\n</tools>\nCall them inside <tool_call></tool_call> tags.<|im_end|>\n{%- endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{%- for call in m.tool_calls or [] %}<tool_call>\n{{ call.function | tojson }}\n</tool_call>{%- endfor %}"
    "<|im_end|>\n{% endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)


@pytest.fixture(scope="module")
def tool_llama(tmp_path_factory):
    return tiny_llama_with_template(tmp_path_factory.mktemp("tools") / "llama", QWEN_TOOLS)


ONE_UNIT = [{"type": "function", "function": {"name": "convert", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["unit"],
    "properties": {"unit": {"enum": ["c", "f"]}}}}}]


@pytest.mark.parametrize("parser", [None, "hermes", "llama3_json", "mistral"])
async def test_every_call_format_forced_by_its_grammar(tool_llama, parser):
    """The tiny model writes noise, but a forced call parses in each format; without a
    --tool-parser the template's own (hermes) is used, and the tools are in its prompt."""
    settings = {} if parser is None else {"tool_parser": parser}
    # the tiny model's vocabulary spells the tools out in many tokens: its whole context
    async with tiny_server(tool_llama, {**TINY, "max_context": 512}, **settings) as (engine, url):
        client = sync_client(url)
        ask = partial(client.chat.completions.create, model="m", messages=ASK, max_tokens=96, temperature=0,
                      tools=ONE_UNIT, tool_choice="required", parallel_tool_calls=False)
        answer = await in_thread(ask)
        chunks = await in_thread(lambda: list(ask(stream=True)))
        prompt = engine.render_chat(ASK, tools=ONE_UNIT)
    calls = answer.choices[0].message.tool_calls
    assert len(calls) == 1 and calls[0].function.name == "convert"
    assert json.loads(calls[0].function.arguments)["unit"] in ("c", "f")
    assert streamed_calls(chunks) == [("convert", json.loads(calls[0].function.arguments))]
    assert '"name": "convert"' in prompt  # the template rendered the tools itself


@pytest.mark.parametrize(("body", "param"), [
    ({"tools": {"name": "x"}}, "tools"),
    ({"tools": [{"type": "function"}]}, "tools[0]"),
    ({"tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools[0].function.parameters"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools"),
    ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {}}]}]}, "messages[0].tool_calls[0]"),
])
async def test_bad_tool_fields_are_400_naming_the_field(tool_llama, body, param):
    async with tiny_server(tool_llama) as (engine, url):
        async with httpx.AsyncClient(base_url=url) as http:
            response = await http.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 2, **body})
            completion = await http.post("/v1/completions", json={"prompt": "hi", "tools": TOOLS})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert completion.status_code == 400 and completion.json()["error"]["param"] == "tools"


async def test_a_tool_schema_no_call_can_fit_is_a_400_saying_why(tool_llama):
    impossible = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "required": ["n"], "properties": {"n": {"type": "integer", "minimum": 3, "maximum": 1}}}}}]
    async with tiny_server(tool_llama) as (engine, url):
        async with httpx.AsyncClient(base_url=url) as http:
            response = await http.post("/v1/chat/completions", json={
                "messages": ASK, "max_tokens": 8, "tools": impossible, "tool_choice": "required"})
            auto = await http.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 4,
                                                                  "tools": impossible})
    assert response.status_code == 400, response.text
    assert "grammar" in response.json()["error"]["message"]
    assert auto.status_code == 200  # no grammar unless a call is forced
