"""A model's tool calls read out of its answer, in its family's format, whole or as the
text streams in. Pure.

- hermes (Qwen, Hermes, and the format motet asks for when the chat template has no
  place for tools): `<tool_call>{"name": …, "arguments": {…}}</tool_call>` blocks,
  anywhere in the answer;
- llama3_json (Llama 3.1 and later): the whole answer is a JSON object `{"name": …,
  "parameters": {…}}`, or several joined by `;` (the `<|python_tag|>` before it is a
  special token, which the answer's text leaves out);
- mistral: `[TOOL_CALLS]` and a JSON array of `{"name": …, "arguments": {…}}` (the
  marker is a control token the text may leave out, so an answer that is such an
  array counts too).

A call that does not read as one stays in the content as the model wrote it. Streamed,
content goes out as soon as it cannot be the start of a call, and each call once it
is whole (for the two formats that take the whole answer, at its end).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ..runtime.serve_settings import ToolFamily

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
MISTRAL_OPEN = "[TOOL_CALLS]"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text


def parse(family: ToolFamily, text: str) -> tuple[str, list[ToolCall]]:
    """A whole answer's (content, calls)."""
    return scan(family, text, final=True)


def scan(family: ToolFamily, text: str, final: bool) -> tuple[str, list[ToolCall]]:
    """(content, calls) of the text so far; final=False: only what more text cannot
    change (both grow as the text does)."""
    if family == "hermes":
        return _hermes(text, final)
    lead = text.lstrip()
    if family == "llama3_json":
        if not lead.startswith("{"):
            return (text, []) if final or lead else ("", [])
        if not final:
            return "", []
        objects = _all_calls(_split_objects(lead), "parameters")
        return ("", objects) if objects else (text, [])
    start = text.find(MISTRAL_OPEN)
    body = text[start + len(MISTRAL_OPEN):] if start >= 0 else None
    if start < 0 and (lead.startswith("[{") or (not final and lead == "[")):
        start, body = 0, lead
    if body is None:
        return (text, []) if final else (_hold(text, MISTRAL_OPEN), [])
    if not final:
        return text[:start], []
    calls = _calls_of(body.strip())
    return (text[:start], calls) if calls else (text, [])


def _hermes(text: str, final: bool) -> tuple[str, list[ToolCall]]:
    content: list[str] = []
    calls: list[ToolCall] = []
    pos = 0
    while (start := text.find(HERMES_OPEN, pos)) >= 0:
        end = text.find(HERMES_CLOSE, start)
        if end < 0 and not final:
            content.append(text[pos:start])
            return "".join(content), calls
        inner = text[start + len(HERMES_OPEN): end if end >= 0 else len(text)]
        after = end + len(HERMES_CLOSE) if end >= 0 else len(text)
        call = _call(inner.strip(), "arguments")
        content.append(text[pos:start] if call else text[pos:after])
        if call:
            calls.append(call)
        pos = after
    rest = text[pos:]
    content.append(rest if final else _hold(rest, HERMES_OPEN))
    return "".join(content), calls


def _hold(text: str, marker: str) -> str:
    """`text` less an end that could still grow into `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return text[:-k]
    return text


def _call(text: str | object, arguments_key: str) -> ToolCall | None:
    """A call from a JSON object's text (or the object): its name and its arguments
    (`arguments_key`, or `arguments`), an object or the text of one."""
    obj = _json(text) if isinstance(text, str) else text
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get(arguments_key, obj.get("arguments", {}))
    if isinstance(args, str):
        args = _json(args)
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _calls_of(text: str) -> list[ToolCall]:
    """Calls from a JSON array of call objects (or one object)."""
    value = _json(text)
    return _all_calls(value if isinstance(value, list) else [value], "arguments")


def _all_calls(items: list, arguments_key: str) -> list[ToolCall]:
    """A call from each item (a JSON object, or its text); none unless every one reads."""
    calls = [_call(item, arguments_key) for item in items]
    return [c for c in calls if c is not None] if calls and None not in calls else []


def _split_objects(text: str) -> list[str]:
    """JSON objects one after another, apart by `;` (and spaces), as text each."""
    decoder, parts, pos = json.JSONDecoder(), [], 0
    while pos < len(text):
        try:
            _, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return []
        parts.append(text[pos:end])
        pos = end
        while pos < len(text) and text[pos] in " \t\r\n;":
            pos += 1
    return parts


def _json(text: str) -> object:
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return None


class ToolCallStream:
    """push(text) → (content, calls) ready to send; flush() at the end for the rest."""

    def __init__(self, family: ToolFamily):
        self.family = family
        self.text = ""
        self.content_sent = 0
        self.calls_sent = 0

    def push(self, text: str) -> tuple[str, list[ToolCall]]:
        self.text += text
        return self._new(*scan(self.family, self.text, final=False))

    def flush(self) -> tuple[str, list[ToolCall]]:
        return self._new(*scan(self.family, self.text, final=True))

    def _new(self, content: str, calls: list[ToolCall]) -> tuple[str, list[ToolCall]]:
        fresh_content, fresh_calls = content[self.content_sent:], calls[self.calls_sent:]
        self.content_sent, self.calls_sent = len(content), len(calls)
        return fresh_content, fresh_calls
