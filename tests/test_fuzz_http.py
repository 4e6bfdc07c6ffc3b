"""Fuzzing of what the HTTP server takes from outside, each parser with a corpus kept in
the repo (tests/corpus/<parser>/; fuzz_inputs.py): the OpenAI and Anthropic request
parsers (JSON values, and the accepted conversations through the chat template), request
bodies on the live app, and the HTTP API as a whole: the OpenAPI document it publishes at
`/openapi.json` is valid OpenAPI 3 and names every route, and schemathesis calls a real
`motet serve` (a subprocess on loopback) with requests drawn from it: no 5xx, every answer
as documented. The byte codecs' fuzzing is in test_fuzz.py.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace

import httpx
import pytest
from conftest import COMPILE_CACHE, GOLDEN, REPO
from fuzz_inputs import FUZZ, corpus, seeds
from http_helpers import TIMEOUT, tiny_server
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from motet.http.anthropic_schema import parse_messages
from motet.http.openai_schema import ROLES, InvalidRequest, Limits, parse_chat, parse_completion
from motet.http.tools import call_grammar
from motet.model.chat_template import ChatTemplateError
from motet.model.loader import load_chat
from motet.runtime.serve_settings import TOOL_FAMILIES, ServeSettings

# ---- the OpenAI request parser ------------------------------------------------------------

SURROGATES = st.sampled_from(["\ud800", "a\udfffb", "\ud83d"])  # JSON's \ud800 escapes decode to these
TEXT = st.text(max_size=20) | SURROGATES
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.integers(-(2**70), 2**70) | st.floats() | TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
    max_leaves=10,
)
PART = st.fixed_dictionaries({"type": st.just("text") | JSON, "text": TEXT | JSON})
CALL = st.fixed_dictionaries({"id": TEXT | JSON, "type": st.just("function"), "function": st.fixed_dictionaries(
    {"name": st.sampled_from(["f", "g"]) | JSON, "arguments": st.just('{"x": 1}') | TEXT | JSON})}) | JSON
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(list(ROLES)) | JSON, "content": TEXT | st.lists(PART, max_size=3) | JSON},
    optional={"tool_calls": st.lists(CALL, max_size=2) | JSON, "tool_call_id": TEXT | JSON},
) | JSON
FUNCTION = st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
    {"name": st.sampled_from(["f", "g", "bad name"]) | JSON},
    optional={"description": TEXT | JSON, "parameters": st.just({"type": "object"}) | JSON})}) | JSON
CHAT_FIELDS = ("model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "stop",
               "stream", "stream_options", "seed", "n", "presence_penalty", "frequency_penalty", "logprobs",
               "top_logprobs", "cache_slot", "user", "top_k", "min_p", "repetition_penalty", "logit_bias",
               "stop_token_ids", "response_format", "structured_outputs", "chat_template_kwargs", "tools",
               "tool_choice", "parallel_tool_calls", "functions")
COMPLETION_FIELDS = (*(f for f in CHAT_FIELDS if f not in ("messages", "max_completion_tokens", "top_logprobs")),
                     "prompt", "echo", "best_of", "suffix")
PLAUSIBLE = {  # values that pass, so the fields after them are reached too
    "model": st.just("m"), "messages": st.lists(MESSAGE, min_size=1, max_size=4),
    "prompt": TEXT | st.lists(TEXT, min_size=1, max_size=2), "max_tokens": st.integers(1, 40),
    "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1), "stop": TEXT | st.lists(TEXT, max_size=5),
    "stream": st.booleans(), "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "logprobs": st.booleans() | st.integers(0, 5), "top_logprobs": st.integers(0, 5),
    "cache_slot": st.integers(0, 3), "seed": st.integers(0, 2**63 - 1),
    "tools": st.lists(FUNCTION, max_size=3), "parallel_tool_calls": st.booleans(),
    "tool_choice": st.sampled_from(["auto", "none", "required", {"type": "function", "function": {"name": "f"}}]),
}
MESSAGES_FIELDS = ("model", "messages", "max_tokens", "system", "stop_sequences", "temperature", "top_p", "top_k",
                   "stream", "tools", "thinking", "metadata")
PLAUSIBLE |= {"system": TEXT | st.lists(PART, max_size=2), "stop_sequences": st.lists(TEXT, max_size=3),
              "logit_bias": st.dictionaries(st.integers(0, 99).map(str), st.floats(-100, 100), max_size=3),
              "response_format": st.sampled_from([{"type": "json_object"}, {"type": "text"}]),
              "structured_outputs": st.sampled_from([{"regex": "[a-z]+"}, {"choice": ["a", "b"]}])}
SMALL = Limits(max_messages=3, max_stops=2, max_stop_chars=4, max_prompt_chars=12, max_tokens=32)
REQUIRED = {"model", "messages", "prompt", "max_tokens"}


@st.composite
def bodies(draw, fields: tuple[str, ...]):
    """A request body: plausible values for some fields, any JSON for up to three, or a
    JSON value that is no object at all."""
    if draw(st.integers(0, 19)) == 0:
        return draw(JSON)
    body = {f: draw(PLAUSIBLE[f]) for f in fields if f in PLAUSIBLE and draw(st.booleans())}
    for name in draw(st.lists(st.sampled_from(fields), max_size=3, unique=True)):
        body[name] = draw(JSON)
    return body


_render = None


def render(messages) -> None:
    """An accepted conversation through the tiny llama's chat template: a prompt, or the
    template's refusal (a 400), never anything else."""
    global _render
    if _render is None:
        _render = load_chat(GOLDEN / "llama")[1]
    try:
        assert isinstance(_render([dict(m) for m in messages]), str)
    except ChatTemplateError:
        pass


def check_parse(parse, body, limits: Limits) -> None:
    try:
        request = parse(body, limits)
    except InvalidRequest as exc:
        assert exc.message
        if isinstance(body, dict):  # a 400 naming a field the body has (or must have)
            assert exc.param and re.split(r"[.\[]", exc.param)[0] in body.keys() | REQUIRED, exc.param
        else:
            assert exc.param is None
        return
    o = request.options
    assert 0 <= o.temperature <= 2 and 0 < o.top_p <= 1 and 0 <= o.top_logprobs <= 5
    assert o.max_tokens is None or 1 <= o.max_tokens <= (limits.max_tokens or math.inf)
    assert len(o.stop) <= limits.max_stops and all(0 < len(s) <= limits.max_stop_chars for s in o.stop)
    texts = [m["content"] for m in request.messages] if hasattr(request, "messages") else [request.prompt]
    assert sum(map(len, texts)) <= limits.max_prompt_chars
    for text in (*texts, *o.stop):
        text.encode("utf-8")  # no lone surrogate gets through
    if hasattr(request, "messages"):
        assert 0 < len(request.messages) <= limits.max_messages
        assert all(m["role"] in ("system", "user", "assistant", "tool") for m in request.messages)
        tools = getattr(request, "tools", None)
        if tools is not None:  # a forced call's grammar is built for any tools accepted
            assert not tools.forced or all(call_grammar(tools, family).text for family in TOOL_FAMILIES)
        render(request.messages)


@corpus("openai_chat")
def test_openai_chat_corpus(seed):
    body = json.loads(seed.read_bytes())
    check_parse(parse_chat, body, Limits())
    check_parse(parse_chat, body, SMALL)


@corpus("openai_completion")
def test_openai_completion_corpus(seed):
    body = json.loads(seed.read_bytes())
    check_parse(parse_completion, body, Limits())
    check_parse(parse_completion, body, SMALL)


@FUZZ
@given(bodies(CHAT_FIELDS), st.sampled_from([Limits(), SMALL]))
@example({"model": "m", "messages": [{"role": ["user"], "content": "x"}]}, Limits())
def test_openai_chat_fuzzed(body, limits):
    check_parse(parse_chat, body, limits)


@FUZZ
@given(bodies(COMPLETION_FIELDS), st.sampled_from([Limits(), SMALL]))
def test_openai_completion_fuzzed(body, limits):
    check_parse(parse_completion, body, limits)


@FUZZ
@given(bodies(MESSAGES_FIELDS), st.sampled_from([Limits(), SMALL]), st.booleans())
def test_anthropic_messages_fuzzed(body, limits, count_only):
    """Anthropic's Messages request: a ChatRequest, or a 400 naming one of its own fields."""
    check_parse(lambda b, lim: parse_messages(b, lim, count_only), body, limits)


# ---- request bodies on the live server ----------------------------------------------------


def assert_documented(response: httpx.Response, name: str) -> None:
    assert response.status_code < 500, (name, response.status_code, response.text[:300])
    if response.status_code >= 400:
        error = response.json()["error"]
        assert error["message"] and error["type"] == "invalid_request_error", (name, error)


async def test_every_corpus_body_gets_an_answer_or_a_documented_error(llama):
    files = [(p, route) for p in seeds("http_body") for route in ("/v1/chat/completions", "/v1/completions")]
    files += [(p, "/v1/chat/completions") for p in seeds("openai_chat")]
    files += [(p, "/v1/completions") for p in seeds("openai_completion")]
    async with tiny_server(llama) as (engine, url), httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as http:
        for path, route in files:
            body = path.read_bytes()
            if b'"stream": true' in body:  # small answers: the corpus is about the request
                body = body.replace(b'"stream": true', b'"stream": true, "max_tokens": 4')
            response = await http.post(route, content=body, headers={"Content-Type": "application/json"})
            assert_documented(response, path.name)
        assert engine.statistics().running == 0


# ---- the OpenAPI document, and schemathesis against the real server -----------------------

KEY = "fuzz-key-0123456789"


def test_the_openapi_document_is_valid_openapi_3_and_names_every_route():
    import schemathesis

    from motet.http.app import create_app
    from motet.http.openapi import openapi_document

    settings_ = ServeSettings(api_key=KEY)
    document = openapi_document(settings_, "llama", 2)
    schemathesis.openapi.from_dict(document).validate()  # OpenAPI's own schema (3.1)
    assert document["openapi"].startswith("3.")
    app = create_app(SimpleNamespace(), settings_)  # routes only: no engine is called
    routes = {(re.sub(r"<(?:\w+:)?(\w+)>", r"{\1}", rule.rule), method.lower())
              for rule in app.url_map.iter_rules() for method in rule.methods - {"HEAD", "OPTIONS"}}
    documented = {(path, method) for path, item in document["paths"].items() for method in item}
    assert routes == documented
    limits = document["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert limits["messages"]["maxItems"] == settings_.max_messages
    assert limits["max_tokens"]["anyOf"][0]["maximum"] == settings_.max_context


@pytest.fixture(scope="module")
def served():
    """`motet serve` over the tiny llama, as a subprocess on a free loopback port, with an
    API key; yields (url, stderr file). Its stderr is read after the run (no key in it)."""
    with tempfile.TemporaryFile() as err:
        command = [sys.executable, "-m", "motet", "-v", "serve", "--port", "0", "--model", str(GOLDEN / "llama"),
                   "--kv-slots", "2", "--max-context", "256", "--compile-cache", str(COMPILE_CACHE),
                   "--api-key", KEY]
        process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=err)
        try:
            deadline = time.monotonic() + TIMEOUT
            while b"python -c" not in (text := (err.seek(0), err.read())[1]):
                assert process.poll() is None and time.monotonic() < deadline, text.decode()
                time.sleep(0.1)
            yield re.search(r"motet: serving \S+ at (http://\S+)", text.decode())[1], err
        finally:
            process.terminate()
            process.wait(timeout=60)


SCHEMATHESIS_EXAMPLES = {"POST /v1/chat/completions": 25, "POST /v1/completions": 25}


def test_schemathesis_against_the_real_server(served):
    import schemathesis
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import (
        content_type_conformance,
        response_schema_conformance,
        status_code_conformance,
    )

    url, _ = served
    document = httpx.get(url + "/openapi.json", timeout=TIMEOUT)
    assert document.status_code == 200  # published without the key
    schema = schemathesis.openapi.from_dict(document.json())
    schema.validate()
    checks = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
    auth = {"Authorization": f"Bearer {KEY}"}
    for result in schema.get_all_operations():
        operation = result.ok()

        @settings(max_examples=SCHEMATHESIS_EXAMPLES.get(operation.label, 8), deadline=None,
                  suppress_health_check=list(HealthCheck), database=None)
        @given(operation.as_strategy())
        def call(case):
            case.call_and_validate(base_url=url, headers=auth, checks=checks, timeout=TIMEOUT)

        call()


def test_the_api_key_never_reaches_the_logs(served):
    url, err = served
    for headers in ({"Authorization": f"Bearer {KEY}"}, {"x-api-key": KEY}, {"Authorization": f"Bearer {KEY}x"},
                    {"x-api-key": KEY[:-1]}):
        httpx.get(url + "/v1/models", headers=headers, timeout=TIMEOUT)
        httpx.post(url + "/v1/completions", headers=headers, content=b"{", timeout=TIMEOUT)
    err.seek(0)
    logged = err.read()
    assert b"motet: serving llama" in logged  # the log is there, verbose
    assert KEY.encode() not in logged and KEY[:-1].encode() not in logged
