"""Structured outputs through the real server and the official client, on both backends
(the in-process Engine, and a `motet mux` child that gets the grammar in SUBMIT's
seventh field): OpenAI's response_format (json_schema, strict; json_object), vLLM's
structured_outputs (choice, regex, grammar), streamed and not; bad ones are 400s."""

from __future__ import annotations

import json
import re
from functools import partial

import httpx
import jsonschema
import pytest
from http_helpers import in_thread, sync_client, tiny_server

CITY = {"type": "object", "additionalProperties": False, "required": ["city", "country"],
        "properties": {"city": {"type": "string", "maxLength": 24}, "country": {"type": "string", "maxLength": 24}}}
QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in JSON."}]


async def test_json_schema_choice_regex_and_gbnf_from_the_official_client(serve_smol):
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}}
    async with serve_smol() as (engine, url):
        client = sync_client(url)
        chat = partial(client.chat.completions.create, model="smol", messages=QUESTION, max_tokens=60,
                       temperature=0)
        schema = await in_thread(chat, response_format=fmt)
        chunks = await in_thread(lambda: list(chat(response_format=fmt, stream=True)))
        anything = await in_thread(chat, response_format={"type": "json_object"})
        choice = await in_thread(chat, extra_body={"structured_outputs": {"choice": ["Paris", "Lyon"]}})
        regex = await in_thread(client.completions.create, model="smol", prompt="The year was", max_tokens=8,
                                temperature=0, extra_body={"structured_outputs": {"regex": " 1[0-9]{3}"}})
        gbnf = await in_thread(chat, extra_body={"structured_outputs": {"grammar": 'root ::= "yes" | "no"'}})
    answer = json.loads(schema.choices[0].message.content)
    jsonschema.validate(answer, CITY)
    assert schema.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert json.loads(streamed) == answer  # greedy both times
    assert isinstance(json.loads(anything.choices[0].message.content), dict)
    assert choice.choices[0].message.content in ("Paris", "Lyon")
    assert re.fullmatch(r" 1[0-9]{3}", regex.choices[0].text)
    assert gbnf.choices[0].message.content in ("yes", "no")


@pytest.mark.parametrize(("body", "param"), [
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": "json"}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": [1]}}}, "response_format.json_schema"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"json": "{no"}}, "structured_outputs.json"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "structured_outputs"),
])
async def test_bad_structured_fields_are_400_naming_the_field(llama, body, param):
    async with tiny_server(llama) as (engine, url):
        async with httpx.AsyncClient(base_url=url) as http:
            response = await http.post("/v1/chat/completions",
                                       json={"messages": QUESTION, "max_tokens": 2, **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


async def test_a_grammar_that_cannot_compile_is_a_400_saying_why(llama):
    async with tiny_server(llama) as (engine, url):
        async with httpx.AsyncClient(base_url=url) as http:
            bad = await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2,
                                                           "structured_outputs": {"regex": "[a-"}})
            unsatisfiable = await http.post("/v1/completions", json={
                "prompt": "hi", "max_tokens": 2,
                "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "integer", "minimum": 3,
                                                                                      "maximum": 1}}}})
    assert bad.status_code == 400 and "the regex cannot be compiled" in bad.json()["error"]["message"]
    assert unsatisfiable.status_code == 400 and "Unsatisfiable" in unsatisfiable.json()["error"]["message"]
