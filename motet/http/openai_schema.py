"""OpenAI request bodies → frozen requests, validated field by field. Pure: no I/O.

A bad field raises InvalidRequest naming it (`param`, e.g. `messages[0].content`), which
the app answers with a 400 in OpenAI's error shape; any JSON value in any field gives a
request or an InvalidRequest, nothing else (tests/test_fuzz.py). Fields OpenAI clients
send that do not change the answer (`user`, `metadata`, ...) are ignored; fields that
would change it and that motet cannot honour (`echo`, `best_of` > 1) are refused rather
than silently dropped. `Limits` bound what one request may ask: messages,
stop strings, prompt characters (before tokenizing), and `max_tokens`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeGuard

from ..runtime.api import MAX_LOGIT_BIAS, MAX_REPETITION_PENALTY, MAX_TOP_K, Grammar
from ..runtime.choices import MAX_CHOICES
from ..runtime.serve_settings import MAX_MESSAGES, MAX_PROMPT_CHARS, MAX_STOP_CHARS, MAX_STOPS
from .errors import InvalidRequest
from .structured import grammar_of
from .tools import Tools, parse_tools, tool_calls_field

MAX_TOP_LOGPROBS = 5
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


@dataclass(frozen=True)
class Limits:
    """What one request may ask for; past a limit, a 400 naming the field."""

    max_messages: int = MAX_MESSAGES
    max_stops: int = MAX_STOPS
    max_stop_chars: int = MAX_STOP_CHARS  # characters of one stop string
    max_prompt_chars: int = MAX_PROMPT_CHARS  # the prompt, or all messages' text together
    max_tokens: int | None = None  # the served context; None: no bound here


@dataclass(frozen=True)
class Options:
    """What both endpoints accept besides the prompt."""

    max_tokens: int | None = None  # None: the server's default
    temperature: float = 1.0  # OpenAI's default
    top_p: float = 1.0
    top_k: int = 0  # vLLM's and llama.cpp's extension: 0 (or -1) no cut
    min_p: float = 0.0  # likewise: 0 no cut
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # vLLM's extension: 1 none
    logit_bias: tuple[tuple[int, float], ...] = ()
    stop_token_ids: tuple[int, ...] = ()  # vLLM's extension
    grammar: Grammar | None = None  # response_format or structured_outputs (structured.py)
    template_kwargs: dict | None = None  # chat_template_kwargs (vLLM's): enable_thinking, ...
    stop: tuple[str, ...] = ()
    seed: int | None = None
    logprobs: bool = False  # report each token's logprob
    top_logprobs: int = 0  # and this many top candidates per token
    stream: bool = False
    include_usage: bool = False  # streaming: a usage chunk before [DONE]
    cache_slot: int | None = None  # pin the request to this KV slot
    n: int = 1  # answers to the one prompt (choices)


@dataclass(frozen=True)
class ChatRequest:
    model: str | None  # None: not given (answers carry the served model's name either way)
    messages: tuple[dict, ...]  # {"role", "content"}, content flattened to text (and tool_calls, tool_call_id)
    options: Options
    tools: Tools | None = None  # the tools the answer may call (None: none, or tool_choice "none")


@dataclass(frozen=True)
class CompletionRequest:
    model: str | None
    prompt: str
    options: Options


@dataclass(frozen=True)
class TokenizeRequest:
    """POST /tokenize: a text, or messages for the chat template (vLLM's fields)."""

    prompt: str | None
    messages: tuple[dict, ...] | None
    add_special: bool  # add_special_tokens: the BOS the model wants, as a prompt gets


def parse_chat(body: object, limits: Limits = Limits()) -> ChatRequest:
    body = _object(body)
    parsed = _messages(body, limits)
    logprobs = _bool(body, "logprobs")
    top = _int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS) or 0
    if top and not logprobs:
        raise InvalidRequest("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    max_tokens = _int(body, "max_completion_tokens", 1, limits.max_tokens)
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", 1, limits.max_tokens)
    options, tools = _options(body, limits, max_tokens, logprobs, top), parse_tools(body)
    if tools is not None and tools.forced and options.grammar is not None:
        raise InvalidRequest("a forced tool call ('tool_choice') and 'response_format' cannot both shape the "
                             "answer", "tool_choice")
    return ChatRequest(_model(body), parsed, options, tools)


def parse_completion(body: object, limits: Limits = Limits()) -> CompletionRequest:
    body = _object(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    prompt = _prompt(prompt, "prompt", limits, "a string (or an array of one string)")
    if body.get("echo") not in (None, False):
        raise InvalidRequest("'echo' is not supported", "echo")
    if body.get("best_of") not in (None, 1):
        raise InvalidRequest("only 'best_of': 1 is supported", "best_of")
    if body.get("suffix") not in (None, ""):
        raise InvalidRequest("'suffix' is not supported", "suffix")
    for name in ("tools", "tool_choice", "functions", "function_call"):
        if body.get(name) is not None:
            raise InvalidRequest(f"'{name}' is for the chat route (/v1/chat/completions)", name)
    top = _int(body, "logprobs", 0, MAX_TOP_LOGPROBS)  # completions: an integer, or null
    max_tokens = _int(body, "max_tokens", 1, limits.max_tokens)
    return CompletionRequest(_model(body), prompt,
                             _options(body, limits, max_tokens, top is not None, top or 0))


def parse_tokenize(body: object, limits: Limits = Limits()) -> TokenizeRequest:
    """`prompt` (llama.cpp's `content` too) or `messages`; `add_special_tokens` (default true)."""
    body = _object(body)
    _model(body)
    given = [name for name in ("prompt", "content", "messages") if body.get(name) is not None]
    if len(given) != 1:
        raise InvalidRequest("give one of 'prompt' (or 'content') and 'messages'", "prompt")
    add = body.get("add_special_tokens", True)
    if not isinstance(add, bool):
        raise InvalidRequest("'add_special_tokens' must be a boolean", "add_special_tokens")
    if given[0] == "messages":
        return TokenizeRequest(None, _messages(body, limits), add)
    return TokenizeRequest(_prompt(body[given[0]], given[0], limits, "a string"), None, add)


def parse_detokenize(body: object, limits: Limits = Limits()) -> tuple[int, ...]:
    """`tokens`: an array of token ids, at most as many as a prompt may have characters."""
    body = _object(body)
    _model(body)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(_is_int(t) and t >= 0 for t in tokens):
        raise InvalidRequest("'tokens' must be an array of token ids (integers >= 0)", "tokens")
    if len(tokens) > limits.max_prompt_chars:
        raise InvalidRequest(f"'tokens' holds {len(tokens)} ids; at most {limits.max_prompt_chars} "
                             "are allowed", "tokens")
    return tuple(tokens)


# ---- the fields ---------------------------------------------------------------------


def _object(body: object) -> dict:
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    return body


def _model(body: dict) -> str | None:
    """Optional, as on single-model servers: it may be left out. Any name is accepted
    (answers carry the served model's name), but one given is a non-empty string."""
    if "model" not in body:
        return None
    model = body["model"]
    if not isinstance(model, str) or not model:
        raise InvalidRequest("'model' must be a non-empty string", "model")
    return model


def _messages(body: dict, limits: Limits) -> tuple[dict, ...]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("'messages' must be a non-empty array of messages", "messages")
    if len(messages) > limits.max_messages:
        raise InvalidRequest(f"'messages' holds {len(messages)} messages; at most "
                             f"{limits.max_messages} are allowed", "messages")
    parsed = tuple(_message(m, f"messages[{i}]") for i, m in enumerate(messages))
    chars = sum(len(m["content"]) for m in parsed)
    if chars > limits.max_prompt_chars:
        raise InvalidRequest(f"the messages hold {chars} characters; at most "
                             f"{limits.max_prompt_chars} are allowed", "messages")
    return parsed


def _prompt(prompt: object, name: str, limits: Limits, what: str) -> str:
    if not isinstance(prompt, str):
        raise InvalidRequest(f"'{name}' must be {what}", name)
    if len(prompt) > limits.max_prompt_chars:
        raise InvalidRequest(f"'{name}' holds {len(prompt)} characters; at most "
                             f"{limits.max_prompt_chars} are allowed", name)
    return _text(prompt, name)


def _message(message: object, where: str) -> dict:
    if not isinstance(message, dict):
        raise InvalidRequest(f"'{where}' must be an object with 'role' and 'content'", where)
    role = message.get("role")
    if not isinstance(role, str) or role not in ROLES:  # a list or an object is no key
        raise InvalidRequest(
            f"'{where}.role' must be one of {', '.join(ROLES)}; got {role!r}", f"{where}.role"
        )
    calls = message.get("tool_calls") if role == "assistant" else None
    content = message.get("content")
    parsed: dict = {"role": ROLES[role], "content": "" if content is None and calls else
                    _content(content, f"{where}.content")}
    if calls:
        parsed["tool_calls"] = tool_calls_field(calls, f"{where}.tool_calls")
    if role == "tool" and isinstance(message.get("tool_call_id"), str):
        parsed["tool_call_id"] = message["tool_call_id"]
    return parsed


def _content(content: object, where: str) -> str:
    """A string, or a list of text parts (joined by newlines, as vLLM joins them)."""
    if isinstance(content, str):
        return _text(content, where)
    if isinstance(content, list):
        texts = []
        for i, part in enumerate(content):
            is_dict = isinstance(part, dict)
            if not (is_dict and part.get("type") == "text" and isinstance(part.get("text"), str)):
                kind = part.get("type") if is_dict else type(part).__name__
                raise InvalidRequest(
                    f"'{where}[{i}]' must be a text part {{\"type\": \"text\", \"text\": ...}}; "
                    f"got {kind!r} (only text is supported)", where,
                )
            texts.append(_text(part["text"], f"{where}[{i}].text"))
        return "\n".join(texts)
    raise InvalidRequest(f"'{where}' must be a string or an array of text parts", where)


def _text(text: str, where: str) -> str:
    """`text`, unless it holds a lone surrogate (JSON's `\\ud800` escape decodes to one):
    no UTF-8 spelling, no tokens."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequest(f"'{where}' holds a lone surrogate, which is not text", where) from None
    return text


def _options(body: dict, limits: Limits, max_tokens: int | None, logprobs: bool,
             top_logprobs: int) -> Options:
    n = _integral(body.get("n"))
    if n is not None and (not _is_int(n) or not 1 <= n <= MAX_CHOICES):
        raise InvalidRequest(f"'n' must be an integer in [1, {MAX_CHOICES}]; got {n!r}", "n")
    cache_slot = _int(body, "cache_slot", 0, None)
    if cache_slot is not None and n not in (None, 1):
        raise InvalidRequest("'cache_slot' pins one conversation: it cannot be given with 'n' > 1", "cache_slot")
    repetition = _number(body, "repetition_penalty", 0.0, MAX_REPETITION_PENALTY)
    if repetition == 0.0:
        raise InvalidRequest(f"'repetition_penalty' must be in (0, {MAX_REPETITION_PENALTY:g}]",
                             "repetition_penalty")
    stream = _bool(body, "stream")
    stream_options = body.get("stream_options")
    if stream_options is not None and not isinstance(stream_options, dict):
        raise InvalidRequest("'stream_options' must be an object", "stream_options")
    include_usage = _bool(stream_options or {}, "include_usage", "stream_options.include_usage")
    temperature = _number(body, "temperature", 0.0, 2.0)
    top_p = _number(body, "top_p", 0.0, 1.0)
    if top_p is not None and top_p == 0.0:
        raise InvalidRequest("'top_p' must be in (0, 1]", "top_p")
    top_k = _int(body, "top_k", -1, MAX_TOP_K)
    min_p = _number(body, "min_p", 0.0, 1.0)
    return Options(
        max_tokens=max_tokens,
        temperature=1.0 if temperature is None else temperature,
        top_p=1.0 if top_p is None else top_p,
        top_k=max(top_k or 0, 0),
        min_p=min_p or 0.0,
        presence_penalty=_number(body, "presence_penalty", -2.0, 2.0) or 0.0,
        frequency_penalty=_number(body, "frequency_penalty", -2.0, 2.0) or 0.0,
        repetition_penalty=1.0 if repetition is None else repetition,
        logit_bias=_logit_bias(body.get("logit_bias")),
        stop_token_ids=_token_ids(body.get("stop_token_ids"), "stop_token_ids"),
        grammar=grammar_of(body),
        template_kwargs=_template_kwargs(body.get("chat_template_kwargs")),
        stop=_stop(body.get("stop"), limits),
        seed=_int(body, "seed", 0, (1 << 63) - 1),
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        stream=stream,
        include_usage=stream and include_usage,
        cache_slot=cache_slot,
        n=n or 1,
    )


RESERVED_TEMPLATE_NAMES = frozenset({"messages", "add_generation_prompt", "bos_token", "eos_token"})


def _template_kwargs(value: object) -> dict | None:
    """vLLM's chat_template_kwargs: more variables for the chat template, none of the
    ones the server sets itself."""
    if value is None:
        return None
    if not isinstance(value, dict) or RESERVED_TEMPLATE_NAMES & value.keys():
        raise InvalidRequest("'chat_template_kwargs' must be an object of template variables other than "
                             f"{', '.join(sorted(RESERVED_TEMPLATE_NAMES))}", "chat_template_kwargs")
    return value


def _logit_bias(bias: object) -> tuple[tuple[int, float], ...]:
    """OpenAI's map of token ids (as strings) to a value added to their logits."""
    if bias is None:
        return ()
    what = (f"'logit_bias' must map token ids (strings of digits) to numbers in "
            f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
    if not isinstance(bias, dict):
        raise InvalidRequest(what, "logit_bias")
    pairs = []
    for key, value in bias.items():
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if not (key.isascii() and key.isdigit() and len(key) <= 10 and number
                and -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS):
            raise InvalidRequest(f"{what}; got {key!r}: {value!r}", "logit_bias")
        pairs.append((int(key), float(value)))
    return tuple(pairs)


def _token_ids(value: object, name: str) -> tuple[int, ...]:
    if value is None:
        return ()
    ids = [_integral(t) for t in value] if isinstance(value, list) else None
    if ids is None or not all(_is_int(t) and t >= 0 for t in ids):
        raise InvalidRequest(f"'{name}' must be an array of token ids (integers from 0); got {value!r}", name)
    return tuple(ids)  # type: ignore[arg-type]  # every one an int, checked above


def _stop(stop: object, limits: Limits) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if (not isinstance(stops, list) or len(stops) > limits.max_stops
            or not all(isinstance(s, str) and s for s in stops)):
        raise InvalidRequest(
            f"'stop' must be a non-empty string or an array of up to {limits.max_stops} of them", "stop"
        )
    for s in stops:
        if len(s) > limits.max_stop_chars:
            raise InvalidRequest(f"a stop string holds {len(s)} characters; at most "
                                 f"{limits.max_stop_chars} are allowed", "stop")
        _text(s, "stop")
    return tuple(stops)


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _integral(value: object) -> object:
    """A float with no fraction as the integer it is (JSON Schema's integers include
    `1.0`, and so does pydantic's lax mode, which OpenAI-style servers use); else as is."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _int(body: dict, name: str, lo: int, hi: int | None) -> int | None:
    value = _integral(body.get(name))
    if value is None:
        return None
    if not _is_int(value) or value < lo or (hi is not None and value > hi):
        bounds = f"in [{lo}, {hi}]" if hi is not None else f"at least {lo}"
        raise InvalidRequest(f"'{name}' must be an integer {bounds}; got {value!r}", name)
    return value


def _number(body: dict, name: str, lo: float, hi: float) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, int | float) or isinstance(value, bool) or not lo <= value <= hi:
        raise InvalidRequest(f"'{name}' must be a number in [{lo:g}, {hi:g}]; got {value!r}", name)
    return float(value)


def _bool(body: dict, name: str, param: str | None = None) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise InvalidRequest(f"'{param or name}' must be true or false; got {value!r}", param or name)
    return value
