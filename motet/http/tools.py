"""Tools on the chat routes: OpenAI's `tools`, `tool_choice` and `parallel_tool_calls`
read and checked, the messages that carry calls and their results, the prompt with
the tools in it, and the grammar that makes `required` and a named choice answer with
a call that parses and fits its schema. Pure but for rendering, which goes through
the engine's chat template.

The chat template renders the tools as transformers passes them (`tools`, a list of
`{"type": "function", "function": {...}}`). A template with no place for them (it
renders the same with and without) gets them in a system message of motet's own,
asking for the hermes format, and the calls and results of earlier turns as text in
that format. The format to read calls in is the one the rendered prompt names
(serve_settings.TOOL_FAMILIES), unless the server was told one.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from ..runtime.api import Grammar
from .errors import InvalidRequest
from .tool_calls import HERMES_CLOSE, HERMES_OPEN, MISTRAL_OPEN, ToolFamily

MAX_TOOLS = 128
# A forced call's JSON has at most one space between its tokens, as models write calls:
# any more is a model running out its max_tokens in whitespace.
CALL_WHITESPACE = "[ ]?"
NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


@dataclass(frozen=True)
class Tools:
    functions: tuple[dict, ...]  # {"name", "description", "parameters"} each
    choice: str  # "auto" or "required" (a named choice too; "none" reads as no tools)
    named: str | None = None  # the function a named choice asks for
    parallel: bool = True

    def for_template(self) -> list[dict]:
        return [{"type": "function", "function": f} for f in self.functions]

    @property
    def forced(self) -> bool:
        return self.choice == "required"


def parse_tools(body: dict) -> Tools | None:
    """The request's tools, or None (none given, or `tool_choice` "none")."""
    for name in ("functions", "function_call"):  # OpenAI's older names
        if body.get(name) is not None:
            raise InvalidRequest(f"'{name}' is not supported: use 'tools' and 'tool_choice'", name)
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise InvalidRequest("'parallel_tool_calls' must be true or false", "parallel_tool_calls")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise InvalidRequest("'tool_choice' needs 'tools'", "tool_choice")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise InvalidRequest(f"'tools' must be an array of at most {MAX_TOOLS} tools", "tools")
    functions = tuple(_function(tool, f"tools[{i}]") for i, tool in enumerate(tools))
    names = [f["name"] for f in functions]
    if len(set(names)) < len(names):
        raise InvalidRequest("two tools have the same name", "tools")
    if choice in (None, "auto"):
        return Tools(functions, "auto", parallel=parallel)
    if choice == "none":
        return None
    if choice == "required":
        return Tools(functions, "required", parallel=parallel)
    named = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not (isinstance(choice, dict) and choice.get("type") == "function" and isinstance(named, str)):
        raise InvalidRequest("'tool_choice' must be \"none\", \"auto\", \"required\" or "
                             "{\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")
    if named not in names:
        raise InvalidRequest(f"'tool_choice' names {named!r}, which is not among the tools", "tool_choice")
    return Tools(functions, "required", named, parallel)


def _function(tool: object, where: str) -> dict:
    function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
    if not isinstance(function, dict):
        raise InvalidRequest(f"'{where}' must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}", where)
    name = function.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise InvalidRequest(f"'{where}.function.name' must be 1 to 64 letters, digits, '_', '.' or '-'",
                             f"{where}.function.name")
    description = function.get("description", "")
    parameters = function.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(description, str):
        raise InvalidRequest(f"'{where}.function.description' must be a string", f"{where}.function.description")
    if not isinstance(parameters, dict):
        raise InvalidRequest(f"'{where}.function.parameters' must be a JSON schema (an object)",
                             f"{where}.function.parameters")
    return {"name": name, "description": description, "parameters": parameters}


def tool_calls_field(calls: object, where: str) -> list[dict]:
    """An assistant message's `tool_calls`, as templates read them: each function's
    arguments an object where they are the text of one (as vLLM hands them on)."""
    if not isinstance(calls, list):
        raise InvalidRequest(f"'{where}' must be an array of tool calls", where)
    out = []
    for i, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if not (isinstance(call, dict) and isinstance(function, dict) and isinstance(name, str)):
            raise InvalidRequest(f"'{where}[{i}]' must be {{\"type\": \"function\", \"function\": "
                                 "{\"name\": ..., \"arguments\": ...}}", f"{where}[{i}]")
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass  # the template gets the text as it came
        entry = {"type": "function", "function": {"name": name, "arguments": arguments}}
        if isinstance(call.get("id"), str):
            entry["id"] = call["id"]
        out.append(entry)
    return out


# ---- the prompt ----------------------------------------------------------------------


def family_of(prompt: str) -> ToolFamily:
    """The call format a prompt with tools in it asks for."""
    if MISTRAL_OPEN in prompt or "[AVAILABLE_TOOLS]" in prompt:
        return "mistral"
    if HERMES_OPEN in prompt:
        return "hermes"
    if '"parameters"' in prompt and ("ipython" in prompt or "<|python_tag|>" in prompt):
        return "llama3_json"
    return "hermes"


def with_tool_prompt(messages: list[dict], tools: Tools) -> list[dict]:
    """The conversation for a template with no place for tools: motet's system message
    describing them in the hermes format first, and earlier calls and their results
    as text in that format."""
    described = "\n".join(json.dumps(f, ensure_ascii=False) for f in tools.functions)
    ask = (f"You may call functions to help with the user's request. They are listed here, one JSON "
           f"object each:\n<tools>\n{described}\n</tools>\nTo call one, answer with\n{HERMES_OPEN}\n"
           f'{{"name": <function name>, "arguments": <the arguments as a JSON object>}}\n{HERMES_CLOSE}\n'
           "once for each call.")
    if tools.named is not None:
        ask += f" Call {tools.named} now."
    elif tools.choice == "required":
        ask += " Call at least one of them now."
    out: list[dict] = []
    for m in messages:
        if m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"})
        elif m.get("tool_calls"):
            calls = "\n".join(f"{HERMES_OPEN}\n{json.dumps(c['function'], ensure_ascii=False)}\n{HERMES_CLOSE}"
                              for c in m["tool_calls"])
            out.append({"role": "assistant", "content": (m.get("content") or "") + calls})
        else:
            out.append(m)
    if out and out[0]["role"] == "system":
        return [{"role": "system", "content": out[0]["content"] + "\n\n" + ask}, *out[1:]]
    return [{"role": "system", "content": ask}, *out]


# ---- the grammar of a forced call -----------------------------------------------------


def call_grammar(tools: Tools, family: ToolFamily) -> Grammar:
    """The answer a `required` or named choice must give: one call (more than one when
    parallel calls are allowed) in the family's format, each a function's name and
    arguments that fit its parameters' schema."""
    key = "parameters" if family == "llama3_json" else "arguments"
    chosen = [f for f in tools.functions if tools.named in (None, f["name"])]
    options = [{"type": "object", "properties": {"name": {"const": f["name"]}, key: f["parameters"]},
                "required": ["name", key], "additionalProperties": False} for f in chosen]
    call: dict = options[0] if len(options) == 1 else {"anyOf": options}
    guidance = {"x-guidance": {"whitespace_pattern": CALL_WHITESPACE}}
    if family == "mistral":
        many = {"type": "array", "items": call, "minItems": 1, **({} if tools.parallel else {"maxItems": 1})}
        return Grammar("grammar", f'start: "{MISTRAL_OPEN}" %json {json.dumps(many | guidance)}')
    body = f"%json {json.dumps(call | guidance)}"
    if family == "llama3_json":
        return Grammar("grammar", f"start: {body}")
    # parallel calls follow each other with nothing between: a newline after one would
    # commit a model that wanted it to a second call
    calls = "call+" if tools.parallel else "call"
    return Grammar("grammar", f'start: {calls}\ncall: "{HERMES_OPEN}\\n" {body} "\\n{HERMES_CLOSE}"')


def render_with_tools(render, messages: list[dict], tools: Tools, family: ToolFamily | None,
                      **template_kwargs) -> tuple[str, ToolFamily]:
    """The prompt with the tools in it (render: the engine's render_chat), and the format
    to read calls in: `family` where the server was told one, else the one the prompt
    asks for (hermes where motet's own system message describes the tools)."""
    kwargs = {**template_kwargs, "tools": tools.for_template()}
    prompt = render(messages, **kwargs)
    if prompt == render(messages, **template_kwargs):  # the template has no place for tools
        return render(with_tool_prompt(messages, tools), **template_kwargs), family or "hermes"
    return prompt, family or family_of(prompt)


def openapi_fields() -> dict:
    """The chat request's tool fields, for openapi.py's document."""
    function = {"type": "object", "required": ["name"], "properties": {
        "name": {"type": "string", "pattern": "^[A-Za-z0-9_.-]{1,64}$"}, "description": {"type": "string"},
        "parameters": {"type": "object", "description": "a JSON schema of the arguments"}}}
    tool = {"type": "object", "required": ["type", "function"],
            "properties": {"type": {"const": "function"}, "function": function}}
    named = {"type": "object", "required": ["type", "function"], "properties": {
        "type": {"const": "function"},
        "function": {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}}}}
    return {
        "tools": {"anyOf": [{"type": "array", "maxItems": MAX_TOOLS, "items": tool}, {"type": "null"}]},
        "tool_choice": {"anyOf": [{"enum": ["none", "auto", "required"]}, named, {"type": "null"}],
                        "description": "required and a named function are enforced by a grammar; "
                                       "needs tools unless none or auto"},
        "parallel_tool_calls": {"anyOf": [{"type": "boolean"}, {"type": "null"}]},
    }


def openapi_call() -> dict:
    """One entry of an answer's `tool_calls`."""
    return {"type": "object", "required": ["id", "type", "function"], "properties": {
        "id": {"type": "string"}, "type": {"const": "function"}, "function": {
            "type": "object", "required": ["name", "arguments"],
            "properties": {"name": {"type": "string"}, "arguments": {"type": "string"}}}}}
