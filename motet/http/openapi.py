"""The OpenAPI 3.1 document of motet's HTTP API, served at `/openapi.json`. Pure: a dict
built from the settings, so the limits it states (messages, stop strings, `max_tokens`,
`cache_slot`) are the ones the server enforces.

It describes every route with its request and response schemas, and is tested twice:
against OpenAPI's own schema, and by schemathesis calling the real server with requests
drawn from it (tests/test_fuzz.py), every answer checked against it.
"""

from __future__ import annotations

from functools import partial

from .. import __version__
from ..runtime.api import MAX_GRAMMAR_CHARS, MAX_LOGIT_BIAS, MAX_REPETITION_PENALTY, MAX_TOP_K
from ..runtime.choices import MAX_CHOICES
from ..runtime.serve_settings import ServeSettings
from . import anthropic_schema as messages_shape
from . import tools
from .openai_schema import MAX_TOP_LOGPROBS, RESERVED_TEMPLATE_NAMES, ROLES
from .slots import FILENAME_PATTERN, MAX_FILENAME_BYTES

OPENAPI_VERSION = "3.1.0"
_REF = "#/components/schemas/"


def _ref(name: str) -> dict:
    return {"$ref": _REF + name}


def _nullable(schema: dict) -> dict:
    return {"anyOf": [schema, {"type": "null"}]}


def _json(schema: dict, description: str) -> dict:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


ERROR = _json(_ref("Error"), "an error in OpenAI's shape")
ERRORS = {  # the statuses every generation route may answer besides 200
    "400": _json(_ref("Error"), "a bad field (`param` names it), an empty prompt, a prompt "
                 "over the context, a limit exceeded, or a body that is not JSON"),
    "401": _json(_ref("Error"), "no valid API key (only when the server has one)"),
    "408": _json(_ref("Error"), "the body did not arrive in time"),
    "409": _json(_ref("Error"), "the pinned `cache_slot` is busy (Retry-After)"),
    "413": _json(_ref("Error"), "the body is larger than the limit"),
    "429": _json(_ref("Error"), "the queue is full (Retry-After)"),
    "431": _json(_ref("Error"), "the request line and headers are larger than the limit"),
    "503": _json(_ref("Error"), "shutting down, or the engine is starting again (Retry-After)"),
}
UNAUTHORIZED = {"401": ERRORS["401"]}
SSE_EVENT = {  # one event of a stream: a chunk, an error object, or "[DONE]", as JSON text
    "type": "object", "required": ["data"],
    "properties": {"data": {"type": "string", "minLength": 1}, "event": {"const": "message"}},
}
HEAD_TOO_LARGE = {"431": ERRORS["431"]}  # any route


def _schemas(settings: ServeSettings, slots: int) -> dict:
    text = {"type": "string", "maxLength": settings.max_prompt_chars}
    stop = {"type": "string", "minLength": 1, "maxLength": settings.max_stop_chars}
    common = {  # what both generation routes take
        "model": {"type": "string", "minLength": 1,
                  "description": "optional; any name (answers carry the served model's)"},
        "max_tokens": _nullable({"type": "integer", "minimum": 1, "maximum": settings.max_context}),
        "temperature": _nullable({"type": "number", "minimum": 0, "maximum": 2}),
        "top_p": _nullable({"type": "number", "exclusiveMinimum": 0, "maximum": 1}),
        "top_k": _nullable({"type": "integer", "minimum": -1, "maximum": MAX_TOP_K,
                            "description": "sample from the k likeliest tokens; 0 or -1: all (vLLM, llama.cpp)"}),
        "min_p": _nullable({"type": "number", "minimum": 0, "maximum": 1,
                            "description": "drop tokens less likely than min_p times the likeliest (vLLM, llama.cpp)"}),
        "stop": {"anyOf": [stop, {"type": "array", "items": stop, "maxItems": settings.max_stops},
                           {"type": "null"}]},
        "stream": _nullable({"type": "boolean"}),
        "stream_options": _nullable({"type": "object", "properties": {
            "include_usage": _nullable({"type": "boolean"})}}),
        "seed": _nullable({"type": "integer", "minimum": 0, "maximum": (1 << 63) - 1}),
        "n": _nullable({"type": "integer", "minimum": 1, "maximum": MAX_CHOICES,
                        "description": "answers to the prompt, read once (choices[i].index)"}),
        "presence_penalty": _nullable({"type": "number", "minimum": -2, "maximum": 2,
                                       "description": "minus this for each token the answer holds"}),
        "frequency_penalty": _nullable({"type": "number", "minimum": -2, "maximum": 2,
                                        "description": "minus this times how often the answer holds a token"}),
        "repetition_penalty": _nullable({
            "type": "number", "exclusiveMinimum": 0, "maximum": MAX_REPETITION_PENALTY,
            "description": "a token of the prompt or the answer: a positive logit divided by it, a negative "
                           "one multiplied; 1: none (vLLM)"}),
        "logit_bias": _nullable({
            "type": "object", "propertyNames": {"pattern": "^[0-9]{1,10}$"},
            "additionalProperties": {"type": "number", "minimum": -MAX_LOGIT_BIAS, "maximum": MAX_LOGIT_BIAS},
            "description": "token id → a value added to its logit before sampling"}),
        "stop_token_ids": _nullable({"type": "array", "items": {"type": "integer", "minimum": 0},
                                     "description": "sampling one of these ends the answer (vLLM)"}),
        "response_format": _nullable({"anyOf": [
            {"type": "object", "required": ["type"], "properties": {"type": {"enum": ["text", "json_object"]}}},
            {"type": "object", "required": ["type", "json_schema"], "properties": {
                "type": {"const": "json_schema"},
                "json_schema": {"type": "object", "properties": {
                    "name": {"type": "string"}, "description": {"type": "string"},
                    "schema": {"type": "object"}, "strict": _nullable({"type": "boolean"})}}}}],
            "description": "the answer is JSON: any object, or one that matches the schema"}),
        "structured_outputs": _nullable({
            "type": "object", "minProperties": 1, "maxProperties": 1, "properties": {
                "json": {"anyOf": [{"type": "object"}, {"type": "string", "maxLength": MAX_GRAMMAR_CHARS}]},
                "json_object": {"const": True},
                "regex": {"type": "string", "minLength": 1, "maxLength": MAX_GRAMMAR_CHARS},
                "choice": {"type": "array", "minItems": 1, "items": {"type": "string"}},
                "grammar": {"type": "string", "minLength": 1, "maxLength": MAX_GRAMMAR_CHARS}},
            "description": "vLLM's: the answer matches a JSON schema, any JSON object, a regex, one of "
                           "the choices, or a Lark or GBNF grammar (one of them)"}),
        "user": {"type": "string"},
        "cache_slot": _nullable({"type": "integer", "minimum": 0, "maximum": slots - 1,
                                 "description": "pin the request to this KV slot (motet)"}),
    }
    number = {"type": "number"}
    counts = {"type": "integer", "minimum": 0}
    head = {"id": {"type": "string"}, "object": {"type": "string"}, "created": {"type": "integer"},
            "model": {"type": "string"}, "system_fingerprint": {"type": "string"}}
    finish = _nullable({"enum": ["stop", "length", "grammar", "tool_calls"]})
    top_properties = {"token": {"type": "string"}, "logprob": number,
                      "bytes": {"type": "array", "items": {"type": "integer"}}}
    top = {"type": "object", "required": ["token", "logprob"], "properties": top_properties}
    return {
        "Error": {
            "type": "object", "required": ["error"],
            "properties": {"error": {
                "type": "object", "required": ["message", "type", "param", "code"],
                "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                               "param": _nullable({"type": "string"}), "code": _nullable({"type": "string"})},
            }},
        },
        "TextPart": {"type": "object", "required": ["type", "text"],
                     "properties": {"type": {"const": "text"}, "text": text}},
        "Message": {
            "type": "object", "required": ["role"],
            "properties": {"role": {"enum": list(ROLES)},
                           "content": {"anyOf": [text, {"type": "array", "items": _ref("TextPart")}, {"type": "null"}],
                                       "description": "null only beside an assistant's tool_calls"},
                           "tool_calls": {"type": "array", "items": tools.openapi_call()},
                           "tool_call_id": {"type": "string"}},
        },
        "ChatCompletionRequest": {
            "type": "object", "required": ["messages"],
            "description": "unknown fields are ignored; `top_logprobs` needs `logprobs: true`",
            "properties": {
                **common,
                "messages": {"type": "array", "minItems": 1, "maxItems": settings.max_messages,
                             "items": _ref("Message")},
                "max_completion_tokens": common["max_tokens"],
                **tools.openapi_fields(),
                "chat_template_kwargs": _nullable({
                    "type": "object",
                    "not": {"anyOf": [{"required": [name]} for name in sorted(RESERVED_TEMPLATE_NAMES)]},
                    "description": "more variables for the chat template (vLLM's): enable_thinking, ..."}),
                "logprobs": _nullable({"type": "boolean"}),
                "top_logprobs": _nullable({"type": "integer", "minimum": 0, "maximum": MAX_TOP_LOGPROBS}),
            },
        },
        "CompletionRequest": {
            "type": "object", "required": ["prompt"],
            "properties": {
                **common,
                "prompt": {"anyOf": [text, {"type": "array", "items": text, "minItems": 1, "maxItems": 1}]},
                "logprobs": _nullable({"type": "integer", "minimum": 0, "maximum": MAX_TOP_LOGPROBS}),
                "echo": _nullable({"const": False}),
                "best_of": _nullable({"const": 1}),
                "suffix": _nullable({"const": ""}),
            },
        },
        "Usage": {
            "type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
            "properties": {"prompt_tokens": counts, "completion_tokens": counts, "total_tokens": counts,
                           "prompt_tokens_details": {"type": "object", "properties": {"cached_tokens": counts}}},
        },
        "Colibri": {
            "type": "object", "description": "motet's telemetry of the turn",
            "required": ["stats", "perf", "topk", "entropy", "gpus", "repin"],
            "properties": {"stats": {"type": "object"}, "perf": {"type": "object"},
                           "topk": {"type": "array"}, "entropy": {"type": "array", "items": number},
                           "gpus": {"type": "array"}, "repin": {"type": "array"}},
        },
        "ChatCompletion": {
            "type": "object", "required": ["id", "object", "created", "model", "choices", "usage"],
            "properties": {
                **head, "object": {"const": "chat.completion"}, "usage": _ref("Usage"), "colibri": _ref("Colibri"),
                "choices": {"type": "array", "items": {
                    "type": "object", "required": ["index", "message", "finish_reason"],
                    "properties": {
                        "index": counts, "finish_reason": finish,
                        "message": {"type": "object", "required": ["role", "content"], "properties": {
                            "role": {"const": "assistant"}, "content": _nullable({"type": "string"}),
                            "tool_calls": {"type": "array", "items": tools.openapi_call()}}},
                        "logprobs": _nullable({"type": "object", "properties": {"content": {
                            "type": "array", "items": {**top, "properties": {
                                **top_properties, "top_logprobs": {"type": "array", "items": top}}}}}}),
                    }}},
            },
        },
        "TextCompletion": {
            "type": "object", "required": ["id", "object", "created", "model", "choices", "usage"],
            "properties": {
                **head, "object": {"const": "text_completion"}, "usage": _ref("Usage"), "colibri": _ref("Colibri"),
                "choices": {"type": "array", "items": {
                    "type": "object", "required": ["index", "text", "finish_reason"],
                    "properties": {"index": counts, "text": {"type": "string"}, "finish_reason": finish,
                                   "logprobs": _nullable({"type": "object"})}}},
            },
        },
        "Model": {
            "type": "object", "required": ["id", "object", "created", "owned_by"],
            "properties": {"id": {"type": "string"}, "object": {"const": "model"},
                           "created": {"type": "integer"}, "owned_by": {"type": "string"}},
        },
        "ModelList": {"type": "object", "required": ["object", "data"],
                      "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": _ref("Model")}}},
        "Health": {"type": "object", "required": ["status"],
                   "properties": {"status": {"enum": ["ok", "closing", "error"]}, "reason": {"type": "string"}}},
        "SlotFileRequest": {
            "type": "object", "description": "for save and restore (erase takes no body)",
            "properties": {"filename": {
                "type": "string", "minLength": 1, "maxLength": MAX_FILENAME_BYTES, "pattern": FILENAME_PATTERN,
                "description": f"a plain file name in the slot folder (at most {MAX_FILENAME_BYTES} bytes "
                               "in UTF-8): no '/', '\\', control characters, nor a leading '.'"}},
        },
        "SlotSaved": {
            "type": "object", "required": ["id_slot", "filename", "n_saved", "n_written", "timings"],
            "properties": {"id_slot": counts, "filename": {"type": "string"}, "n_saved": counts,
                           "n_written": counts, "timings": {"type": "object", "required": ["save_ms"],
                                                            "properties": {"save_ms": number}}},
        },
        "SlotRestored": {
            "type": "object", "required": ["id_slot", "filename", "n_restored", "n_read", "timings"],
            "properties": {"id_slot": counts, "filename": {"type": "string"}, "n_restored": counts,
                           "n_read": counts, "timings": {"type": "object", "required": ["restore_ms"],
                                                         "properties": {"restore_ms": number}}},
        },
        "SlotErased": {"type": "object", "required": ["id_slot", "n_erased"],
                       "properties": {"id_slot": counts, "n_erased": counts}},
        "TokenizeRequest": {
            "type": "object", "description": "one of `prompt` (or `content`) and `messages`",
            "properties": {"model": common["model"], "prompt": text, "content": text,
                           "messages": {"type": "array", "minItems": 1, "maxItems": settings.max_messages,
                                        "items": _ref("Message")},
                           "add_special_tokens": {"type": "boolean", "description": "the BOS a prompt gets "
                                                  "(default true)"}},
        },
        "Tokenized": {"type": "object", "required": ["count", "max_model_len", "tokens"],
                      "properties": {"count": counts, "max_model_len": counts,
                                     "tokens": {"type": "array", "items": counts}}},
        "DetokenizeRequest": {
            "type": "object", "required": ["tokens"],
            "properties": {"model": common["model"],
                           "tokens": {"type": "array", "maxItems": settings.max_prompt_chars, "items": counts}},
        },
        "Detokenized": {"type": "object", "required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
        "Experts": {
            "type": "object",
            "required": ["rows", "cols", "map", "hits", "seq", "gpus", "entropy", "repin",
                         "slots_busy", "slots_total", "tokens_per_s"],
            "properties": {"rows": counts, "cols": counts, "map": {"type": "string"}, "hits": {"type": "string"},
                           "seq": counts, "gpus": {"type": "array"}, "entropy": {"type": "array", "items": number},
                           "repin": {"type": "array"}, "slots_busy": counts, "slots_total": counts,
                           "tokens_per_s": number},
        },
    }


def _generation(summary: str, request: str, answer: str, security: list) -> dict:
    return {"post": {
        "summary": summary,
        "security": security,
        "requestBody": {"required": True, "content": {"application/json": {"schema": _ref(request)}}},
        "responses": {
            "200": {"description": "the answer; with `stream: true`, server-sent events (a JSON "
                                   "chunk per `data:` line, `data: [DONE]` last)",
                    "content": {"application/json": {"schema": _ref(answer)},
                                "text/event-stream": {"schema": SSE_EVENT}}},
            **ERRORS,
        },
    }}


def _post(summary: str, request: str, answer: str, security: list) -> dict:
    return {"post": {
        "summary": summary, "security": security,
        "requestBody": {"required": True, "content": {"application/json": {"schema": _ref(request)}}},
        "responses": {"200": _json(_ref(answer), "the answer"),
                      **{code: ERRORS[code] for code in ("400", "401", "408", "413", "431", "503")}},
    }}


def _get(summary: str, responses: dict, *, security: list | None = None, parameters=()) -> dict:
    """`security`: a protected route's (None: open, no key ever)."""
    operation = {"summary": summary,
                 "responses": {**responses, **(UNAUTHORIZED if security else {}), **HEAD_TOO_LARGE},
                 "security": security or []}
    if parameters:
        operation["parameters"] = list(parameters)
    return {"get": operation}


def _path_param(name: str, description: str) -> dict:
    return {"name": name, "in": "path", "required": True, "description": description,
            "schema": {"type": "string", "minLength": 1}}


def _slot_action(settings: ServeSettings, slots: int, security: list) -> dict:
    """POST /slots/{id_slot}: without a slot folder only erase is offered (save and
    restore answer 501)."""
    actions = ["save", "restore", "erase"] if settings.slot_save_path is not None else ["erase"]
    error = partial(_json, _ref("Error"))
    return {"post": {
        "summary": "save a KV slot to a file in the slot folder, restore it from one, or erase it",
        "security": security,
        "parameters": [
            {"name": "id_slot", "in": "path", "required": True, "description": "the KV slot",
             "schema": {"type": "integer", "minimum": 0, "maximum": slots - 1}},
            {"name": "action", "in": "query", "required": True, "schema": {"enum": actions},
             "description": "save and restore need the server's --slot-save-path"},
        ],
        "requestBody": {"required": False, "content": {"application/json": {"schema": _ref("SlotFileRequest")}}},
        "responses": {
            "200": _json({"anyOf": [_ref("SlotSaved"), _ref("SlotRestored"), _ref("SlotErased")]},
                         "what was saved, restored or erased"),
            "400": error("a bad slot id, action or filename, a body that is not JSON, or a file the "
                         "engine refuses to restore (the reason)"),
            "401": ERRORS["401"],
            "404": error("restore: no such file in the slot folder"),
            "408": ERRORS["408"],
            "409": error("the slot is busy (Retry-After)"),
            "413": ERRORS["413"],
            "431": ERRORS["431"],
            "500": error("the file system failed (the file named; the folder is in the server's log)"),
            "501": error("save or restore on a server started without --slot-save-path"),
            "503": ERRORS["503"],
        },
    }}


def openapi_document(settings: ServeSettings, model: str, slots: int) -> dict:
    """The document for a server with `settings`, serving `model` on `slots` KV slots."""
    any_body: dict[str, dict[str, object]] = {"*/*": {"schema": {}}}
    # With a key, a protected route takes it either way; without one, it takes none ({}).
    key: list[dict[str, list[str]]] = [{"bearer": []}, {"apiKey": []}] if settings.api_key is not None else [{}]
    return {
        "openapi": OPENAPI_VERSION,
        "info": {"title": "motet", "version": __version__,
                 "description": f"An OpenAI-compatible API over {model}, and motet's own routes."},
        "paths": {
            "/v1/chat/completions": _generation("a chat answer", "ChatCompletionRequest",
                                                "ChatCompletion", key),
            "/v1/completions": _generation("a text completion", "CompletionRequest", "TextCompletion", key),
            **messages_shape.openapi_paths(key),
            "/v1/models": _get("the served model", {"200": _json(_ref("ModelList"), "one model")},
                               security=key),
            "/v1/models/{model_id}": _get(
                "one model", {"200": _json(_ref("Model"), "the served model"),
                              "404": _json(_ref("Error"), "no such model")},
                security=key, parameters=[_path_param("model_id", "the served model's name")]),
            "/tokenize": _post("the token ids of a prompt, or of messages through the chat template",
                               "TokenizeRequest", "Tokenized", key),
            "/detokenize": _post("the text of token ids, as a stream writes it", "DetokenizeRequest",
                                 "Detokenized", key),
            "/health": _get("whether the engine serves", {
                "200": _json(_ref("Health"), "serving"),
                "503": _json(_ref("Health"), "closing, starting again, or unable to start (`reason`)")}),
            "/experts": _get("the expert map", {"200": _json(_ref("Experts"), "the map")}, security=key),
            "/metrics": _get("Prometheus metrics", {"200": {
                "description": "the text format", "content": {"text/plain": {"schema": {"type": "string"}}}}},
                security=key),
            "/slots/{id_slot}": _slot_action(settings, slots, key),
            "/openapi.json": _get("this document", {"200": _json({"type": "object"}, "OpenAPI 3.1")}),
            "/": _get("the web page", {"200": {"description": "index.html", "content": {
                "text/html": {"schema": {"type": "string"}}}}}),
            "/{path}": _get(
                "a file of the web folder; a path without an extension is the page",
                {"200": {"description": "the file", "content": any_body},
                 "404": _json(_ref("Error"), "no such file, or a path that would leave the folder")},
                parameters=[_path_param("path", "a file's path in the web folder")]),
        },
        "components": {
            "schemas": {**_schemas(settings, slots), **messages_shape.openapi_schemas(
                settings.max_messages, settings.max_prompt_chars, settings.max_context)},
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"},
                                "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"}},
        },
    }
