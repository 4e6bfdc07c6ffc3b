"""Fuzzing of every parser that takes outside bytes, each with a corpus kept in the repo.

Per parser, one property says what any input may give (its typed events, or its one
documented error type) and that the input's split never changes the answer; it runs on
every seed file in `tests/corpus/<parser>/` as is (so a regression found once stays
pinned: the `regression_*` files each crashed a parser before its fix), and on
hypothesis's inputs: arbitrary bytes, and the seeds mutated (bytes flipped, inserted,
deleted, spliced, cut). Runs are bounded (`max_examples` modest, no deadline).

    mux_request, mux_response, legacy   motet/protocol/mux/, legacy.py (and what the
                                        MuxEngine does with a child's telemetry lines)
    wire_frames, wire_msg, wire_layer   motet/protocol/wire.py
    session_file                        motet/protocol/session_file.py
    openai_chat, openai_completion      motet/http/openai_schema.py (JSON values, and the
                                        accepted conversations through the chat template)
    http_body                           the server's body reading, on the live app

The HTTP API as a whole: the OpenAPI document it publishes at `/openapi.json` is valid
OpenAPI 3 and names every route, and schemathesis calls a real `motet serve` (a
subprocess on loopback) with requests drawn from it: no 5xx, every answer as documented.
The codecs' own tests (test_mux_codec.py, test_legacy_codec.py, test_wire.py,
test_session_file.py) hold their exact-output examples and round trips.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from conftest import COMPILE_CACHE, GOLDEN, REPO
from http_helpers import TIMEOUT, tiny_server
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from test_session_file import HEADER

from motet.engines.mux_engine import MuxEngine
from motet.http.anthropic_schema import parse_messages
from motet.http.openai_schema import ROLES, InvalidRequest, Limits, parse_chat, parse_completion
from motet.http.tools import call_grammar
from motet.model.chat_template import ChatTemplateError
from motet.model.loader import load_chat
from motet.protocol import legacy, mux, wire
from motet.protocol.session_file import SessionError, read_session
from motet.runtime.serve_settings import TOOL_FAMILIES, ServeSettings

CORPUS = Path(__file__).resolve().parent / "corpus"
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))


def seeds(parser: str) -> list[Path]:
    return sorted(p for p in (CORPUS / parser).iterdir() if p.is_file())


def corpus(parser: str):
    """Parametrize a test over the parser's seed files (by name)."""
    return pytest.mark.parametrize("seed", seeds(parser), ids=lambda p: p.name)


@st.composite
def mutated(draw, parser: str) -> bytes:
    """A seed of `parser` with a few random edits."""
    data = bytearray(draw(st.sampled_from(seeds(parser))).read_bytes())
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(data)))
        match draw(st.sampled_from(("flip", "insert", "delete", "splice", "cut"))):
            case "flip" if at < len(data):
                data[at] ^= draw(st.integers(1, 255))
            case "insert":
                data[at:at] = draw(st.binary(min_size=1, max_size=8))
            case "delete":
                del data[at : at + draw(st.integers(1, 16))]
            case "splice":  # a piece of the input again, elsewhere (frames out of order)
                start = draw(st.integers(0, len(data)))
                data[at:at] = data[start : start + draw(st.integers(1, 64))]
            case "cut":
                del data[at:]
    return bytes(data)


def inputs(parser: str, max_size: int = 300):
    return st.one_of(st.binary(max_size=max_size), mutated(parser))


CUTS = st.lists(st.integers(0, 100_000), max_size=8)


def feed_all(decoder, data: bytes, cuts=()) -> list:
    bounds = [0, *sorted(c % (len(data) + 1) for c in cuts), len(data)]
    return [e for a, b in zip(bounds, bounds[1:]) for e in decoder.feed(data[a:b])]


def same(a: list, b: list) -> bool:
    return list(map(repr, a)) == list(map(repr, b))  # a "nan" field is read as NaN, never == itself


# ---- the mux codec, both directions ---------------------------------------------------

REQUEST_EVENTS = (mux.Submit, mux.Cancel, mux.Stop, mux.Malformed, mux.BadFrame,
                  mux.Save, mux.Restore, mux.Erase, mux.Prefill)
RESPONSE_EVENTS = (mux.Ready, mux.Data, mux.TopK, mux.Done, mux.Error, mux.Telemetry, mux.BadLine,
                   mux.Turn, mux.LoadFail, mux.Saved, mux.Restored, mux.Erased, mux.Prefilled, mux.SessionRefused,
                   mux.KvSaveFail, mux.Warmup)


def check_mux_requests(data: bytes, cuts=()) -> None:
    whole = mux.RequestDecoder().feed(data)
    assert all(isinstance(e, REQUEST_EVENTS) for e in whole)
    assert all(isinstance(e, mux.BadFrame) is False for e in whole[:-1])  # BAD_FRAME ends the stream
    assert same(feed_all(mux.RequestDecoder(), data, cuts), whole)


def check_mux_responses(data: bytes, cuts=()) -> None:
    whole = mux.ExtendedResponseDecoder().feed(data)
    assert all(isinstance(e, RESPONSE_EVENTS) for e in whole)
    assert same(feed_all(mux.ExtendedResponseDecoder(), data, cuts), whole)
    # What a MuxEngine does with them: lines for no open request are dropped, telemetry
    # (also for requests it has open: stand-ins here) is read or logged, never raised.
    engine = MuxEngine(["motet", "mux"])
    for event in whole:
        engine._on_event(event)
    engine._streams = {rid: SimpleNamespace(perf=None, slot=0, repin=[]) for rid in (1, 7)}
    for event in whole:
        if isinstance(event, mux.Telemetry):
            engine._on_event(event)


@corpus("mux_request")
def test_mux_request_corpus(seed):
    check_mux_requests(seed.read_bytes(), (7, 100, 5000))


@FUZZ
@given(inputs("mux_request"), CUTS)
def test_mux_requests_fuzzed(data, cuts):
    check_mux_requests(data, cuts)


@corpus("mux_response")
def test_mux_response_corpus(seed):
    check_mux_responses(seed.read_bytes(), (3, 50))


@FUZZ
@given(inputs("mux_response"), CUTS)
def test_mux_responses_fuzzed(data, cuts):
    check_mux_responses(data, cuts)


# ---- the legacy protocol ----------------------------------------------------------------

LEGACY_EVENTS = (legacy.UserLine, legacy.Reset, legacy.More, legacy.RawPrompt, legacy.BadFrame, mux.Malformed)


def check_legacy(data: bytes, cuts=()) -> None:
    whole = legacy.LegacyDecoder().feed(data)
    assert all(isinstance(e, LEGACY_EVENTS) for e in whole)
    assert not any(isinstance(e, legacy.BadFrame) for e in whole[:-1])
    assert same(feed_all(legacy.LegacyDecoder(), data, cuts), whole)


@corpus("legacy")
def test_legacy_corpus(seed):
    check_legacy(seed.read_bytes(), (1, 20))


@FUZZ
@given(inputs("legacy"), CUTS)
def test_legacy_fuzzed(data, cuts):
    check_legacy(data, cuts)


# ---- the worker wire: frames, Msg, K_LAYER ---------------------------------------------

FRAME_ERROR = re.compile(r"a frame of \d+ payload bytes is over the limit of \d+|a frame of length 0 has no kind byte")
MSG_ERROR = re.compile(r"a message that is not UTF-8|a header line without '=': \".*\"", re.S)
LAYER_ERROR = re.compile(r"a layer payload of \d+ bytes is shorter than its 16-byte head"
                         r"|layer \d+: the checksum says 0x[0-9a-f]{16} but the bytes sum to 0x[0-9a-f]{16}")


def check_msg(payload: bytes) -> None:
    try:
        msg = wire.decode_msg(payload)
    except wire.WireError as exc:
        assert MSG_ERROR.fullmatch(str(exc)), str(exc)
    else:
        assert wire.decode_msg(wire.encode_msg(msg)) == msg


def check_layer(payload: bytes) -> None:
    try:
        layer = wire.decode_layer(payload)
    except wire.WireError as exc:
        assert LAYER_ERROR.fullmatch(str(exc)), str(exc)
    else:
        assert wire.encode_layer(layer.layer, layer.rows, layer.data) == payload


def check_frames(data: bytes, cuts=()) -> None:
    decoder = wire.FrameDecoder()
    events = feed_all(decoder, data, cuts)
    *frames, last = events or [None]
    assert all(isinstance(f, wire.Frame) for f in frames)
    if isinstance(last, wire.WireError):
        assert FRAME_ERROR.fullmatch(str(last)) and decoder.closed
    elif last is not None:
        frames.append(last)
    ended = decoder.end_of_stream()
    assert ended is None or str(ended).startswith("the stream ended inside a frame")
    for frame in frames:  # what a worker does with each: its kind's decoder
        (check_layer if frame.kind == wire.K_LAYER else check_msg)(frame.payload)


@corpus("wire_frames")
def test_wire_frames_corpus(seed):
    check_frames(seed.read_bytes(), (2, 9))


@FUZZ
@given(inputs("wire_frames"), CUTS)
def test_wire_frames_fuzzed(data, cuts):
    check_frames(data, cuts)


@corpus("wire_msg")
def test_wire_msg_corpus(seed):
    check_msg(seed.read_bytes())


@FUZZ
@given(inputs("wire_msg"))
def test_wire_msg_fuzzed(data):
    check_msg(data)


@corpus("wire_layer")
def test_wire_layer_corpus(seed):
    check_layer(seed.read_bytes())


@FUZZ
@given(inputs("wire_layer", 64))
def test_wire_layer_fuzzed(data):
    check_layer(data)


# ---- the session file ---------------------------------------------------------------------
# (truncation and corruption at every byte, with the exact reasons: test_session_file.py)


def check_session(path: Path, data: bytes) -> None:
    path.write_bytes(data)
    try:
        session = read_session(path, HEADER)
    except SessionError as exc:
        assert str(exc)
    else:
        assert len(session.tokens) <= HEADER.max_context and len(session.layers) == HEADER.layers


@corpus("session_file")
def test_session_file_corpus(seed, tmp_path):
    check_session(tmp_path / "slot.session", seed.read_bytes())


def test_session_file_fuzzed():
    with tempfile.TemporaryDirectory() as folder:
        @FUZZ
        @given(inputs("session_file"))
        def run(data):
            check_session(Path(folder) / "slot.session", data)

        run()


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
