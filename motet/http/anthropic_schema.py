"""Anthropic's Messages API (POST /v1/messages and /v1/messages/count_tokens): the
request read into the OpenAI routes' own ChatRequest, and the answer and its stream in
Anthropic's shapes. Pure: no I/O.

A request is turned into the chat body the OpenAI route reads (a `system` first, text
blocks as text parts, `stop_sequences` as `stop`, `tools` and `tool_choice` as OpenAI's,
`tool_use` blocks as an assistant's `tool_calls`, `tool_result` blocks as `tool`
messages, `thinking` as the template's `enable_thinking`), so both APIs take a field
the same way; an error names Anthropic's field. `image` blocks are refused; `thinking`
blocks sent back are dropped, as chat templates drop earlier reasoning.
"""

from __future__ import annotations

import json
import secrets

from ..runtime.api import FinishEvent, TurnStats
from .errors import ApiError, InvalidRequest
from .openai_schema import ChatRequest, Limits, parse_chat
from .tool_calls import ToolCall

# OpenAI field → Anthropic's, for the errors parse_chat raises
PARAMS = {"stop": "stop_sequences", "max_tokens": "max_tokens", "messages": "messages",
          "parallel_tool_calls": "tool_choice", "chat_template_kwargs": "thinking"}


def parse_messages(body: object, limits: Limits = Limits(), count_only: bool = False) -> ChatRequest:
    """A Messages request (count_only: /count_tokens', which has no max_tokens)."""
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    if not count_only and body.get("max_tokens") is None:
        raise InvalidRequest("'max_tokens' is required", "max_tokens")
    temperature = body.get("temperature")
    if isinstance(temperature, int | float) and not isinstance(temperature, bool) and not 0 <= temperature <= 1:
        raise InvalidRequest(f"'temperature' must be in [0, 1]; got {temperature!r}", "temperature")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("'messages' must be a non-empty array", "messages")
    chat: list[dict] = []
    origin: list[str] = []  # per translated message, the request's name for where it came from
    system = body.get("system")
    if system is not None:
        chat.append({"role": "system", "content": _blocks(system, "system")})
        origin.append("system")
    for i, m in enumerate(messages):
        for translated in _message(m, f"messages[{i}]"):
            chat.append(translated)
            origin.append(f"messages[{i}]")
    translated_body = {"messages": chat, "max_tokens": 1 if count_only else body.get("max_tokens"),
                       "temperature": 1.0 if temperature is None else temperature, "stream": body.get("stream"),
                       "stop": body.get("stop_sequences") or None, **_tools(body), **_thinking(body.get("thinking")),
                       **{k: body[k] for k in ("model", "top_p", "top_k", "seed") if k in body}}
    try:
        return parse_chat(translated_body, limits)
    except InvalidRequest as exc:
        message = exc.message.replace("'stop'", "'stop_sequences'")
        if exc.param is not None and exc.param.startswith("tools["):
            message = message.replace(exc.param, _named(exc.param, origin) or exc.param)
        raise InvalidRequest(message, _named(exc.param, origin)) from None


def _named(param: str | None, origin: list[str]) -> str | None:
    """A parse_chat error's param as the request named it."""
    if param is None:
        return None
    if param.startswith("messages["):  # a translated message: where it came from
        index, rest = param[len("messages["):].split("]", 1)
        return origin[int(index)] + rest
    if param.startswith("tools["):
        return param.replace(".function", "").replace(".parameters", ".input_schema")
    return PARAMS.get(param, param)


def _message(message: object, where: str) -> list[dict]:
    """A message as the OpenAI route's messages: a user's tool_result blocks as `tool`
    messages first (Anthropic puts them first), an assistant's tool_use blocks as its
    `tool_calls`; thinking blocks dropped."""
    if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
        raise InvalidRequest(f"'{where}' must be an object with 'role' (user or assistant) and 'content'",
                             f"{where}.role")
    role, content = message["role"], message.get("content")
    if not isinstance(content, list):
        return [{"role": role, "content": content}]  # a string, or what parse_chat refuses in its own words
    allowed = ("text", "tool_result") if role == "user" else ("text", "tool_use", "thinking", "redacted_thinking")
    texts, results, calls = [], [], []
    for i, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind not in allowed:
            raise InvalidRequest(f"'{where}.content[{i}]' is a {kind!r} block; a {role} message takes "
                                 f"{', '.join(allowed)} blocks", f"{where}.content[{i}]")
        assert isinstance(block, dict)  # its type was read
        if kind == "text":
            texts.append({"type": "text", "text": block.get("text")})
        elif kind == "tool_result":
            results.append({"role": "tool", "tool_call_id": block.get("tool_use_id"),
                            "content": _result_text(block.get("content"), f"{where}.content[{i}]")})
        elif kind == "tool_use":
            calls.append({"id": block.get("id"), "type": "function",
                          "function": {"name": block.get("name"), "arguments": block.get("input", {})}})
    if calls:
        return [{"role": role, "content": texts or None, "tool_calls": calls}]
    return results + ([{"role": role, "content": texts}] if texts or not results else [])


def _blocks(content: object, where: str) -> object:
    """The system prompt: a string, or text blocks as the OpenAI route's text parts."""
    if not isinstance(content, list):
        return content  # a string, or what parse_chat refuses in its own words
    for i, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind != "text":
            raise InvalidRequest(f"'{where}[{i}]' is a {kind!r} block; the system prompt takes text blocks",
                                 f"{where}[{i}]")
    return [{"type": "text", "text": block.get("text")} for block in content]


def _result_text(content: object, where: str) -> str:
    """A tool_result's content: a string, or its text blocks joined."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(b, dict) and b.get("type") == "text"
                                         and isinstance(b.get("text"), str) for b in content):
        return "\n".join(b["text"] for b in content)
    raise InvalidRequest(f"'{where}.content' must be a string or text blocks", f"{where}.content")


def _tools(body: dict) -> dict:
    """Anthropic's tools and tool_choice as OpenAI's fields."""
    out: dict = {}
    tools = body.get("tools")
    if isinstance(tools, list):
        for i, tool in enumerate(tools):
            if not isinstance(tool, dict) or tool.get("type") not in (None, "custom"):
                raise InvalidRequest(f"'tools[{i}]' must be a tool of motet's own: {{\"name\", \"input_schema\"}} "
                                     "(server tools are not run here)", f"tools[{i}]")
        out["tools"] = [{"type": "function", "function": {
            "name": tool.get("name"), "description": tool.get("description", ""),
            "parameters": tool.get("input_schema", {"type": "object"})}} for tool in tools]
    elif tools is not None:
        out["tools"] = tools  # refused in parse_chat's words
    choice = body.get("tool_choice")
    if choice is None:
        return out
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind not in ("auto", "any", "tool", "none"):
        raise InvalidRequest("'tool_choice' must be {\"type\": \"auto\"}, {\"type\": \"any\"}, "
                             "{\"type\": \"tool\", \"name\": ...} or {\"type\": \"none\"}", "tool_choice")
    assert isinstance(choice, dict)  # its type was read
    out["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(kind) or {
        "type": "function", "function": {"name": choice.get("name")}}
    if choice.get("disable_parallel_tool_use") is not None:
        out["parallel_tool_calls"] = not choice["disable_parallel_tool_use"] \
            if isinstance(choice["disable_parallel_tool_use"], bool) else choice["disable_parallel_tool_use"]
    return out


def _thinking(thinking: object) -> dict:
    """Anthropic's thinking switch as the template's enable_thinking (Qwen3's name);
    the budget is not enforced."""
    if thinking is None:
        return {}
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind not in ("enabled", "disabled"):
        raise InvalidRequest("'thinking' must be {\"type\": \"enabled\", \"budget_tokens\": ...} or "
                             "{\"type\": \"disabled\"}", "thinking")
    return {"chat_template_kwargs": {"enable_thinking": kind == "enabled"}}


# ---- answers ---------------------------------------------------------------------------

STOP_REASONS = {"length": "max_tokens", "grammar": "refusal"}


def message_id() -> str:
    return "msg_" + secrets.token_hex(12)


def stop_reason(finish: FinishEvent, called: bool = False) -> str:
    """called: the answer holds tool calls."""
    if finish.stop_sequence is not None:
        return "stop_sequence"
    reason = STOP_REASONS.get(finish.stats.finish_reason, "end_turn")
    return "tool_use" if called and reason == "end_turn" else reason


def tool_use(call: ToolCall) -> dict:
    return {"type": "tool_use", "id": "toolu_" + secrets.token_hex(12), "name": call.name,
            "input": json.loads(call.arguments)}


def thinking(text: str) -> dict:
    """A thinking block (motet signs nothing: the signature is empty)."""
    return {"type": "thinking", "thinking": text, "signature": ""}


def usage(stats: TurnStats) -> dict:
    return {"input_tokens": stats.prompt_tokens, "output_tokens": stats.emitted_tokens,
            "cache_read_input_tokens": stats.reused_tokens, "cache_creation_input_tokens": 0}


def message(ident: str, model: str, text: str, finish: FinishEvent, thought: str = "",
            calls: list[ToolCall] | None = None) -> dict:
    """The answer's blocks: its thinking, its text (kept when empty unless calls follow),
    its tool calls."""
    content = [thinking(thought)] if thought else []
    if text or not calls:
        content.append({"type": "text", "text": text})
    content += [tool_use(call) for call in calls or []]
    return {"id": ident, "type": "message", "role": "assistant", "model": model,
            "content": content, "stop_reason": stop_reason(finish, bool(calls)),
            "stop_sequence": finish.stop_sequence, "usage": usage(finish.stats)}


def event(name: str, data: dict) -> bytes:
    """One server-sent event, as Anthropic streams them: its type as the event name too."""
    return f"event: {name}\ndata: ".encode() + json.dumps(data, ensure_ascii=False).encode() + b"\n\n"


def start_events(ident: str, model: str, prompt_tokens: int) -> bytes:
    head: dict[str, object] = {"id": ident, "type": "message", "role": "assistant", "model": model, "content": [],
            "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": prompt_tokens, "output_tokens": 0}}
    return event("message_start", {"type": "message_start", "message": head}) + event("ping", {"type": "ping"})


class Blocks:
    """A streamed answer's content blocks, opened as its parts come (thinking, text, a
    tool call each) and each closed when the next opens: the events for them."""

    def __init__(self):
        self.index = -1
        self.open: str | None = None  # the kind of the block being streamed
        self.calls = 0

    def part(self, thought: str, text: str, calls: list[ToolCall]) -> bytes:
        out = b""
        if thought:
            out += self._delta("thinking", {"type": "thinking_delta", "thinking": thought})
        if text:
            out += self._delta("text", {"type": "text_delta", "text": text})
        for call in calls:
            block = tool_use(call)
            self.calls += 1
            out += self._start("tool_use", {**block, "input": {}}) + self._event(
                "content_block_delta", {"delta": {"type": "input_json_delta", "partial_json": call.arguments}})
        return out

    def end(self, finish: FinishEvent) -> bytes:
        out = self._delta("text", None) if self.index < 0 else b""  # an answer of nothing: one empty text block
        if self.open is not None:
            out += self._event("content_block_stop", {})
        delta = {"type": "message_delta", "delta": {"stop_reason": stop_reason(finish, self.calls > 0),
                                                    "stop_sequence": finish.stop_sequence},
                 "usage": {"input_tokens": finish.stats.prompt_tokens,
                           "output_tokens": finish.stats.emitted_tokens}}
        return out + event("message_delta", delta) + event("message_stop", {"type": "message_stop"})

    def _delta(self, kind: str, delta: dict | None) -> bytes:
        out = b""
        if self.open != kind:
            empty = {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" else \
                {"type": "text", "text": ""}
            out += self._start(kind, empty)
        return out + (self._event("content_block_delta", {"delta": delta}) if delta is not None else b"")

    def _start(self, kind: str, block: dict) -> bytes:
        out = self._event("content_block_stop", {}) if self.open is not None else b""
        self.index += 1
        self.open = kind
        return out + self._event("content_block_start", {"content_block": block})

    def _event(self, name: str, data: dict) -> bytes:
        return event(name, {"type": name, "index": self.index, **data})


def error_body(error: ApiError) -> dict:
    """An error in Anthropic's shape."""
    kind = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
            413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}.get(error.status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": error.message}}


# ---- the OpenAPI document's part ---------------------------------------------------------


def openapi_schemas(max_messages: int, max_prompt_chars: int, max_tokens: int) -> dict:
    """The Messages routes' schemas, for openapi.py's document."""
    text = {"type": "string", "maxLength": max_prompt_chars}
    block = {"type": "object", "required": ["type", "text"], "properties": {"type": {"const": "text"}, "text": text}}
    use = {"type": "object", "required": ["type", "id", "name", "input"], "properties": {
        "type": {"const": "tool_use"}, "id": {"type": "string"}, "name": {"type": "string"},
        "input": {"type": "object"}}}
    result = {"type": "object", "required": ["type", "tool_use_id"], "properties": {
        "type": {"const": "tool_result"}, "tool_use_id": {"type": "string"},
        "content": {"anyOf": [text, {"type": "array", "items": block}]}}}
    thought = {"type": "object", "required": ["type", "thinking"], "properties": {
        "type": {"const": "thinking"}, "thinking": {"type": "string"}, "signature": {"type": "string"}}}
    content = {"anyOf": [text, {"type": "array", "items": {"anyOf": [block, use, result, thought]}}]}
    counts = {"type": "integer", "minimum": 0}
    tool = {"type": "object", "required": ["name"], "properties": {
        "name": {"type": "string", "pattern": "^[A-Za-z0-9_.-]{1,64}$"}, "description": {"type": "string"},
        "input_schema": {"type": "object"}}}
    request = {
        "type": "object", "required": ["messages"],
        "description": "Anthropic's Messages request (image blocks and server tools: refused)",
        "properties": {
            "model": {"type": "string"},
            "max_tokens": {"type": "integer", "minimum": 1, "maximum": max_tokens},
            "messages": {"type": "array", "minItems": 1, "maxItems": max_messages, "items": {
                "type": "object", "required": ["role", "content"],
                "properties": {"role": {"enum": ["user", "assistant"]}, "content": content}}},
            "system": content,
            "stop_sequences": {"type": "array", "items": {"type": "string", "minLength": 1}},
            "stream": {"type": "boolean"},
            "temperature": {"type": "number", "minimum": 0, "maximum": 1},
            "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
            "top_k": {"type": "integer", "minimum": -1},
            "metadata": {"type": "object"},
            "tools": {"type": "array", "items": tool},
            "tool_choice": {"type": "object", "required": ["type"], "properties": {
                "type": {"enum": ["auto", "any", "tool", "none"]}, "name": {"type": "string"},
                "disable_parallel_tool_use": {"type": "boolean"}}},
            "thinking": {"type": "object", "required": ["type"], "properties": {
                "type": {"enum": ["enabled", "disabled"]}, "budget_tokens": {"type": "integer"}},
                "description": "the chat template's enable_thinking; the budget is not enforced"},
        },
    }
    return {
        "MessagesRequest": {**request, "required": ["messages", "max_tokens"]},
        "CountTokensRequest": request,
        "AnthropicMessage": {
            "type": "object", "required": ["id", "type", "role", "model", "content", "stop_reason", "usage"],
            "properties": {
                "id": {"type": "string"}, "type": {"const": "message"}, "role": {"const": "assistant"},
                "model": {"type": "string"}, "content": {"type": "array", "items": {"anyOf": [block, use, thought]}},
                "stop_reason": {"enum": ["end_turn", "max_tokens", "stop_sequence", "refusal", "tool_use"]},
                "stop_sequence": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                "usage": {"type": "object", "required": ["input_tokens", "output_tokens"],
                          "properties": {"input_tokens": counts, "output_tokens": counts}}}},
        "TokenCount": {"type": "object", "required": ["input_tokens"], "properties": {"input_tokens": counts}},
        "AnthropicError": {
            "type": "object", "required": ["type", "error"],
            "properties": {"type": {"const": "error"}, "error": {
                "type": "object", "required": ["type", "message"],
                "properties": {"type": {"type": "string"}, "message": {"type": "string"}}}}},
    }


def openapi_paths(security: list) -> dict:
    def error(what: str) -> dict:
        return {"description": what,
                "content": {"application/json": {"schema": {"$ref": "#/components/schemas/AnthropicError"}}}}

    errors = {"400": error("a bad field (Anthropic's shape)"), "401": error("no valid API key"),
              "408": error("the body did not arrive in time"), "409": error("a pinned slot is busy"),
              "413": error("the body is larger than the limit"), "429": error("the queue is full"),
              "431": error("the request line and headers are too large"),
              "503": error("shutting down, or the engine is starting again")}

    def post(summary: str, request: str, answer: str, stream: bool) -> dict:
        content: dict = {"application/json": {"schema": {"$ref": f"#/components/schemas/{answer}"}}}
        if stream:
            content["text/event-stream"] = {"schema": {"type": "object", "required": ["data"]}}
        return {"post": {"summary": summary, "security": security,
                         "requestBody": {"required": True, "content": {
                             "application/json": {"schema": {"$ref": f"#/components/schemas/{request}"}}}},
                         "responses": {"200": {"description": "the answer", "content": content}, **errors}}}

    return {"/v1/messages": post("an answer, as Anthropic's Messages API gives it (streamed: its events)",
                                 "MessagesRequest", "AnthropicMessage", True),
            "/v1/messages/count_tokens": post("the prompt tokens a Messages request reads", "CountTokensRequest",
                                              "TokenCount", False)}
