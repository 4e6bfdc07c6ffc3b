"""Engine events → OpenAI response objects (chat.completion, text_completion and their
stream chunks), usage, logprobs, and motet's `colibri` telemetry object. Pure: the
caller passes the id, the creation time and the model name in.
"""

from __future__ import annotations

import json
from dataclasses import asdict

from .. import __version__
from ..runtime.api import FinishEvent, Perf, TokenEvent, TurnStats
from .tool_calls import ToolCall

SYSTEM_FINGERPRINT = f"motet-{__version__}"
SSE_DONE = b"data: [DONE]\n\n"
NO_LOGPROB = -9999.0  # what OpenAI reports for a logprob it cannot give


def sse(obj: dict) -> bytes:
    """One server-sent event carrying a JSON object."""
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def finish_reason(stats: TurnStats, called: bool = False) -> str:
    """OpenAI's "stop", "length" or "tool_calls" (called: the answer holds calls and
    ended on its own), or motet's "grammar": the request's grammar left no token to
    sample."""
    if stats.finish_reason in ("length", "grammar"):
        return stats.finish_reason
    return "tool_calls" if called else "stop"


def tool_call(call: ToolCall, ident: str, index: int | None = None) -> dict:
    """One entry of a message's `tool_calls` (streamed: with its index)."""
    entry = {"id": ident, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    return entry if index is None else {"index": index, **entry}


def usage(stats: TurnStats, *more: TurnStats) -> dict:
    """A request's usage; with n choices (stats of each), the prompt counts once."""
    completion = stats.emitted_tokens + sum(s.emitted_tokens for s in more)
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": stats.prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": stats.reused_tokens},
    }


def colibri(finish: FinishEvent, topk: list[list[dict]]) -> dict:
    """The turn's telemetry: TurnStats, Perf, per token its top candidates (when asked),
    per-layer routing entropy, per-device memory and experts, expert re-pins."""
    report = finish.report
    return {
        "stats": asdict(finish.stats),
        "perf": asdict(report.perf if report else Perf()),
        "topk": topk,
        "entropy": list(report.entropy) if report else [],
        "gpus": [list(g) for g in report.gpus] if report else [],
        "repin": [list(r) for r in report.repin] if report else [],
    }


# ---- per token ----------------------------------------------------------------------


def token_text(event: TokenEvent) -> str:
    """The sampled token's own text: its entry among the top candidates (the released
    text may be empty or joined with held-back bytes), else the released text."""
    if event.token_id is not None:
        for c in event.top:
            if c.token_id == event.token_id:
                return c.text
    return event.text


def token_logprob(event: TokenEvent) -> float:
    if event.logprob is not None:
        return event.logprob
    return event.top[0].logprob if event.top else NO_LOGPROB


def top_candidates(event: TokenEvent, k: int) -> list[dict]:
    """The `colibri.topk` entry of one token."""
    return [{"text": c.text, "logprob": c.logprob} for c in event.top[:k]]


def chat_logprob(event: TokenEvent, k: int) -> dict:
    """One `choices[].logprobs.content[]` entry."""
    text = token_text(event)
    return {
        "token": text, "logprob": token_logprob(event), "bytes": list(text.encode()),
        "top_logprobs": [{"token": c.text, "logprob": c.logprob, "bytes": list(c.text.encode())}
                         for c in event.top[:k]],
    }


def completion_logprobs(events: list[TokenEvent], k: int, offset: int = 0) -> dict:
    """`choices[].logprobs` of the legacy completions API; offsets count characters
    from `offset` (the text already sent, when streaming)."""
    tokens, offsets = [], []
    for event in events:
        offsets.append(offset)
        tokens.append(token_text(event))
        offset += len(event.text)
    return {
        "tokens": tokens,
        "token_logprobs": [token_logprob(e) for e in events],
        "top_logprobs": [{c.text: c.logprob for c in e.top[:k]} for e in events],
        "text_offset": offsets,
    }


# ---- whole objects ------------------------------------------------------------------


def _head(ident: str, obj: str, created: int, model: str) -> dict:
    return {"id": ident, "object": obj, "created": created, "model": model,
            "system_fingerprint": SYSTEM_FINGERPRINT}


def chat_completion(ident: str, created: int, model: str, text: str, finish: FinishEvent,
                    logprobs: list[dict] | None, topk: list[list[dict]], reasoning: str = "",
                    calls: list[dict] | None = None) -> dict:
    """calls: tool_call's entries (content is null when they are all the answer says)."""
    message: dict = {"role": "assistant", "content": None if calls and not text.strip() else text}
    if reasoning:  # vLLM's names for it, the older and the newer
        message |= {"reasoning_content": reasoning, "reasoning": reasoning}
    if calls:
        message["tool_calls"] = calls
    choice = {"index": 0, "message": message,
              "logprobs": None if logprobs is None else {"content": logprobs},
              "finish_reason": finish_reason(finish.stats, bool(calls))}
    return {**_head(ident, "chat.completion", created, model), "choices": [choice],
            "usage": usage(finish.stats), "colibri": colibri(finish, topk)}


def text_completion(ident: str, created: int, model: str, text: str, finish: FinishEvent,
                    logprobs: dict | None, topk: list[list[dict]]) -> dict:
    choice = {"index": 0, "text": text, "logprobs": logprobs,
              "finish_reason": finish_reason(finish.stats)}
    return {**_head(ident, "text_completion", created, model), "choices": [choice],
            "usage": usage(finish.stats), "colibri": colibri(finish, topk)}


def choices_of(objects: list[dict], stats: list[TurnStats]) -> dict:
    """The whole answers of n choices as one object: each one's choice in order, the
    usage of all (the `colibri` telemetry is the first's)."""
    choices = [{**obj["choices"][0], "index": i} for i, obj in enumerate(objects)]
    return {**objects[0], "choices": choices, "usage": usage(*stats)}


def chat_chunk(ident: str, created: int, model: str, delta: dict, *, finish: str | None = None,
               logprobs: list[dict] | None = None, with_usage: bool = False, index: int = 0) -> dict:
    choice = {"index": index, "delta": delta,
              "logprobs": None if logprobs is None else {"content": logprobs},
              "finish_reason": finish}
    chunk = {**_head(ident, "chat.completion.chunk", created, model), "choices": [choice]}
    if with_usage:
        chunk["usage"] = None  # OpenAI: null on every chunk but the usage one
    return chunk


def completion_chunk(ident: str, created: int, model: str, text: str, *, finish: str | None = None,
                     logprobs: dict | None = None, with_usage: bool = False, index: int = 0) -> dict:
    choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
    chunk = {**_head(ident, "text_completion", created, model), "choices": [choice]}
    if with_usage:
        chunk["usage"] = None
    return chunk


def usage_chunk(ident: str, obj: str, created: int, model: str, stats: list[TurnStats]) -> dict:
    """The last chunk when `stream_options.include_usage`: no choices, the usage (of
    every choice)."""
    return {**_head(ident, obj, created, model), "choices": [], "usage": usage(*stats)}


def colibri_chunk(ident: str, obj: str, created: int, model: str, telemetry: dict) -> dict:
    """The telemetry frame before `[DONE]`: shaped like the usage chunk (no choices), so
    clients that read a stream's chunks take it as one, plus the `colibri` object."""
    return {**_head(ident, obj, created, model), "choices": [], "colibri": telemetry}


def model_card(name: str, created: int) -> dict:
    return {"id": name, "object": "model", "created": created, "owned_by": "motet"}
