"""Tool calls read out of an answer in each family's format (http/tool_calls.py), whole
and streamed in pieces of any size alike; the format a rendered prompt asks for; the
prompt motet writes for a template with no place for tools; and each forced call's
grammar, which accepts the calls of its format and nothing else (http/tools.py)."""

from __future__ import annotations

import json
import random

import pytest

from motet.http.errors import InvalidRequest
from motet.http.tool_calls import ToolCall, ToolCallStream, parse
from motet.http.tools import call_grammar, family_of, parse_tools, with_tool_prompt

CALL = '{"name": "get", "arguments": {"city": "Paris"}}'
GET = ToolCall("get", '{"city": "Paris"}')

CASES = [
    ("hermes", f"Let me look.\n<tool_call>\n{CALL}\n</tool_call>", ("Let me look.\n", [GET])),
    ("hermes", f"<tool_call>{CALL}</tool_call><tool_call>{CALL}</tool_call>", ("", [GET, GET])),
    ("hermes", '<tool_call>{"name": "x", "arguments": "{\\"a\\": 1}"}</tool_call>',
     ("", [ToolCall("x", '{"a": 1}')])),  # arguments given as the text of an object
    ("hermes", f"cut short <tool_call>{CALL}", ("cut short ", [GET])),  # no closing tag: the call still reads
    ("hermes", "<tool_call>{broken</tool_call> after", ("<tool_call>{broken</tool_call> after", [])),
    ("hermes", "a < b and <tool no call", ("a < b and <tool no call", [])),
    ("llama3_json", ' {"name": "get", "parameters": {"city": "Paris"}}', ("", [GET])),
    ("llama3_json", '{"name": "get", "parameters": {"city": "Paris"}}; {"name": "get", "parameters": '
                    '{"city": "Paris"}}', ("", [GET, GET])),
    ("llama3_json", '{"answer": 42}', ('{"answer": 42}', [])),
    ("llama3_json", "Words first.", ("Words first.", [])),
    ("mistral", f"Sure. [TOOL_CALLS][{CALL}, {CALL}]", ("Sure. ", [GET, GET])),
    ("mistral", f"[{CALL}]", ("", [GET])),  # the marker is a control token the text may lack
    ("mistral", "[1, 2] is a list", ("[1, 2] is a list", [])),
    ("mistral", "[TOOL_CALLS] not json", ("[TOOL_CALLS] not json", [])),
]


@pytest.mark.parametrize(("family", "text", "expected"), CASES)
def test_each_format_reads_whole_and_streamed_alike(family, text, expected):
    assert parse(family, text) == expected
    rng = random.Random(len(text))
    for _ in range(20):  # pieces of random sizes, as tokens come
        stream, content, calls, pos = ToolCallStream(family), "", [], 0
        while pos < len(text):
            step = rng.randint(1, 6)
            more, new = stream.push(text[pos:pos + step])
            content, calls, pos = content + more, calls + new, pos + step
        more, new = stream.flush()
        assert (content + more, calls + new) == expected


def test_hermes_content_goes_out_before_the_call_is_whole():
    stream = ToolCallStream("hermes")
    assert stream.push("Checking <tool") == ("Checking ", [])  # "<tool" may open a call: held
    assert stream.push("_call>{") == ("", [])
    assert stream.push(CALL[1:] + "</tool_call> done") == (" done", [GET])


@pytest.mark.parametrize(("prompt", "family"), [
    ("<|im_start|>system\n<tools>...</tools> use <tool_call></tool_call>", "hermes"),
    ('[AVAILABLE_TOOLS][{"type": "function"}][/AVAILABLE_TOOLS]', "mistral"),
    ('Environment: ipython\n{"name": "get", "parameters": {}}', "llama3_json"),
    ("tools, described some other way", "hermes"),
])
def test_the_format_a_prompt_asks_for(prompt, family):
    assert family_of(prompt) == family


TOOLS = {"tools": [{"type": "function", "function": {"name": "get", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
    "additionalProperties": False}}}]}


def test_a_template_without_tools_gets_them_and_the_history_as_text():
    tools = parse_tools({**TOOLS, "tool_choice": "required"})
    history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"type": "function", "function": {"name": "get", "arguments": {"city": "Paris"}}}]},
               {"role": "tool", "content": "sunny"}]
    system, user, assistant, result = with_tool_prompt(history, tools)
    assert system["content"].startswith("Be brief.") and '"name": "get"' in system["content"]
    assert "at least one" in system["content"] and user == history[1]
    assert parse("hermes", assistant["content"]) == ("", [GET])
    assert result == {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>"}


@pytest.mark.parametrize(("body", "words"), [
    ({"tool_choice": "required"}, "needs 'tools'"),
    ({**TOOLS, "tool_choice": {"type": "function", "function": {"name": "other"}}}, "not among the tools"),
    ({"functions": []}, "use 'tools'"),
])
def test_bad_tool_choices_say_why(body, words):
    with pytest.raises(InvalidRequest, match=words):
        parse_tools(body)


def test_none_and_no_tools_read_as_no_tools():
    assert parse_tools({**TOOLS, "tool_choice": "none"}) is None
    assert parse_tools({"tools": []}) is None
    assert parse_tools(TOOLS).choice == "auto" and not parse_tools(TOOLS).forced


def accepts(model, grammar, text: str) -> bool:
    """Whether a matcher for `grammar` takes every token of `text`, then the end of turn."""
    matcher = model.grammars.compile(grammar)
    for token in model.tokenizer.encode(text):
        if not (matcher.allowed()[token // 32] >> (token % 32)) & 1:
            return False
        matcher.accept(token)
    eos = min(model.tokenizer.eos_ids)
    return bool((matcher.allowed()[eos // 32] >> (eos % 32)) & 1)


GOOD = {
    "hermes": f"<tool_call>\n{CALL}\n</tool_call><tool_call>\n{CALL}\n</tool_call>",
    "llama3_json": '{"name": "get", "parameters": {"city": "Paris"}}',
    "mistral": f"[TOOL_CALLS][{CALL}, {CALL}]",
}


@pytest.mark.parametrize("family", GOOD)
def test_a_forced_calls_grammar_takes_its_format_and_refuses_the_rest(default_model, family):
    tools = parse_tools({**TOOLS, "tool_choice": "required"})
    grammar = call_grammar(tools, family)
    assert accepts(default_model, grammar, GOOD[family])
    assert parse(family, GOOD[family])[1][0] == GET
    assert not accepts(default_model, grammar, "The weather is fine.")
    assert not accepts(default_model, grammar, GOOD[family].replace('"Paris"', "3"))  # against the schema
    single = call_grammar(parse_tools({**TOOLS, "tool_choice": "required", "parallel_tool_calls": False}), family)
    if family != "llama3_json":  # one call, and no second
        assert not accepts(default_model, single, GOOD[family])
    wrong = json.loads(json.dumps(TOOLS))
    wrong["tools"][0]["function"]["name"] = "other"
    assert not accepts(default_model, call_grammar(parse_tools({**wrong, "tool_choice": "required"}), family),
                       GOOD[family])
