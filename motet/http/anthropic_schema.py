"""Anthropic's Messages API (POST /v1/messages and /v1/messages/count_tokens): the
request read into the OpenAI routes' own ChatRequest, and the answer and its stream in
Anthropic's shapes. Pure: no I/O.

A request is turned into the chat body the OpenAI route reads (a `system` first, text
blocks as text parts, `stop_sequences` as `stop`), so both APIs take a field the same
way; an error names Anthropic's field. Text blocks only for now: `tool_use`,
`tool_result`, `image` and `thinking` blocks, `tools` and `thinking` are refused by name.
"""

from __future__ import annotations

import json
import secrets

from ..runtime.api import FinishEvent, TurnStats
from .errors import ApiError, InvalidRequest
from .openai_schema import ChatRequest, Limits, parse_chat

# OpenAI field → Anthropic's, for the errors parse_chat raises
PARAMS = {"stop": "stop_sequences", "max_tokens": "max_tokens", "messages": "messages"}
NOT_YET = ("tools", "tool_choice", "thinking")  # refused while motet has no tool calls or reasoning


def parse_messages(body: object, limits: Limits = Limits(), count_only: bool = False) -> ChatRequest:
    """A Messages request (count_only: /count_tokens', which has no max_tokens)."""
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    for name in NOT_YET:
        if body.get(name) not in (None, [], {"type": "disabled"}):
            raise InvalidRequest(f"'{name}' is not supported yet", name)
    if not count_only and body.get("max_tokens") is None:
        raise InvalidRequest("'max_tokens' is required", "max_tokens")
    temperature = body.get("temperature")
    if isinstance(temperature, int | float) and not isinstance(temperature, bool) and not 0 <= temperature <= 1:
        raise InvalidRequest(f"'temperature' must be in [0, 1]; got {temperature!r}", "temperature")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("'messages' must be a non-empty array", "messages")
    chat: list[object] = [_message(m, f"messages[{i}]") for i, m in enumerate(messages)]
    system = body.get("system")
    if system is not None:
        chat.insert(0, {"role": "system", "content": _blocks(system, "system")})
    translated = {"messages": chat, "max_tokens": 1 if count_only else body.get("max_tokens"),
                  "temperature": 1.0 if temperature is None else temperature, "stream": body.get("stream"),
                  "stop": body.get("stop_sequences") or None,
                  **{k: body[k] for k in ("model", "top_p", "top_k", "seed") if k in body}}
    try:
        return parse_chat(translated, limits)
    except InvalidRequest as exc:
        param = exc.param
        if param is not None and param.startswith("messages["):  # the system message came first
            param = _shifted(param, system is not None)
        raise InvalidRequest(exc.message.replace("'stop'", "'stop_sequences'"),
                             PARAMS.get(param or "", param)) from None


def _message(message: object, where: str) -> dict:
    if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
        raise InvalidRequest(f"'{where}' must be an object with 'role' (user or assistant) and 'content'",
                             f"{where}.role")
    return {"role": message["role"], "content": _blocks(message.get("content"), f"{where}.content")}


def _blocks(content: object, where: str) -> object:
    """A string, or text blocks as the OpenAI route's text parts; other blocks refused."""
    if not isinstance(content, list):
        return content  # a string, or what parse_chat refuses in its own words
    for i, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind != "text":
            raise InvalidRequest(f"'{where}[{i}]' is a {kind!r} block; only text blocks are supported yet",
                                 f"{where}[{i}]")
    return [{"type": "text", "text": block.get("text")} for block in content]


def _shifted(param: str, system: bool) -> str:
    """messages[i] of the translated body as the request named it."""
    if not system:
        return param
    index, rest = param[len("messages["):].split("]", 1)
    return "system" + rest if index == "0" else f"messages[{int(index) - 1}]{rest}"


# ---- answers ---------------------------------------------------------------------------

STOP_REASONS = {"length": "max_tokens", "grammar": "refusal"}


def message_id() -> str:
    return "msg_" + secrets.token_hex(12)


def stop_reason(finish: FinishEvent) -> str:
    if finish.stop_sequence is not None:
        return "stop_sequence"
    return STOP_REASONS.get(finish.stats.finish_reason, "end_turn")


def usage(stats: TurnStats) -> dict:
    return {"input_tokens": stats.prompt_tokens, "output_tokens": stats.emitted_tokens,
            "cache_read_input_tokens": stats.reused_tokens, "cache_creation_input_tokens": 0}


def message(ident: str, model: str, text: str, finish: FinishEvent) -> dict:
    return {"id": ident, "type": "message", "role": "assistant", "model": model,
            "content": [{"type": "text", "text": text}], "stop_reason": stop_reason(finish),
            "stop_sequence": finish.stop_sequence, "usage": usage(finish.stats)}


def event(name: str, data: dict) -> bytes:
    """One server-sent event, as Anthropic streams them: its type as the event name too."""
    return f"event: {name}\ndata: ".encode() + json.dumps(data, ensure_ascii=False).encode() + b"\n\n"


def start_events(ident: str, model: str, prompt_tokens: int) -> bytes:
    head: dict[str, object] = {"id": ident, "type": "message", "role": "assistant", "model": model, "content": [],
            "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": prompt_tokens, "output_tokens": 0}}
    return (event("message_start", {"type": "message_start", "message": head})
            + event("content_block_start", {"type": "content_block_start", "index": 0,
                                            "content_block": {"type": "text", "text": ""}})
            + event("ping", {"type": "ping"}))


def text_event(text: str) -> bytes:
    return event("content_block_delta", {"type": "content_block_delta", "index": 0,
                                         "delta": {"type": "text_delta", "text": text}})


def end_events(finish: FinishEvent) -> bytes:
    delta = {"type": "message_delta", "delta": {"stop_reason": stop_reason(finish),
                                                "stop_sequence": finish.stop_sequence},
             "usage": {"input_tokens": finish.stats.prompt_tokens, "output_tokens": finish.stats.emitted_tokens}}
    return (event("content_block_stop", {"type": "content_block_stop", "index": 0})
            + event("message_delta", delta) + event("message_stop", {"type": "message_stop"}))


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
    content = {"anyOf": [text, {"type": "array", "items": block}]}
    counts = {"type": "integer", "minimum": 0}
    request = {
        "type": "object", "required": ["messages"],
        "description": "Anthropic's Messages request; text blocks only (tools and thinking: not yet)",
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
        },
    }
    return {
        "MessagesRequest": {**request, "required": ["messages", "max_tokens"]},
        "CountTokensRequest": request,
        "AnthropicMessage": {
            "type": "object", "required": ["id", "type", "role", "model", "content", "stop_reason", "usage"],
            "properties": {
                "id": {"type": "string"}, "type": {"const": "message"}, "role": {"const": "assistant"},
                "model": {"type": "string"}, "content": {"type": "array", "items": block},
                "stop_reason": {"enum": ["end_turn", "max_tokens", "stop_sequence", "refusal"]},
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
