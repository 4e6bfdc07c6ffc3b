"""What a request's answer must match, as the OpenAI routes take it: OpenAI's
`response_format` (`text`, `json_object`, `json_schema` with `schema` and `strict`) or
vLLM's `structured_outputs` (one of `json`, `json_object`, `regex`, `choice`, `grammar`).
Pure: a request body in, a runtime Grammar (or None) out, InvalidRequest naming the
field otherwise. Whether the grammar compiles is the engine's to say (a 400 too)."""

from __future__ import annotations

import json

from ..runtime.api import MAX_GRAMMAR_CHARS, Grammar
from .errors import InvalidRequest

# vLLM's structured_outputs keys → Grammar kinds
STRUCTURED_KEYS = {"json": "json_schema", "json_object": "json_object", "regex": "regex", "choice": "choice",
                   "grammar": "grammar"}


def grammar_of(body: dict) -> Grammar | None:
    response_format = _object_or_none(body, "response_format")
    structured = _object_or_none(body, "structured_outputs")
    if response_format is not None and structured is not None:
        raise InvalidRequest("give 'response_format' or 'structured_outputs', not both", "structured_outputs")
    if response_format is not None:
        return _response_format(response_format)
    if structured is not None:
        return _structured_outputs(structured)
    return None


def _response_format(value: dict) -> Grammar | None:
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return Grammar("json_object")
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict | bool):
            raise InvalidRequest("'response_format.json_schema' must be an object whose 'schema' is a JSON schema",
                                 "response_format.json_schema")
        if not isinstance(spec.get("strict", False), bool | None):
            raise InvalidRequest("'response_format.json_schema.strict' must be true or false",
                                 "response_format.json_schema.strict")
        # without a schema OpenAI accepts any JSON object, as json_object
        if "schema" not in spec:
            return Grammar("json_object")
        return _grammar("json_schema", json.dumps(spec["schema"]), "response_format.json_schema.schema")
    raise InvalidRequest(f"'response_format.type' must be text, json_object or json_schema; got {kind!r}",
                         "response_format.type")


def _structured_outputs(value: dict) -> Grammar:
    given = [key for key in STRUCTURED_KEYS if value.get(key) not in (None, False)]
    if len(given) != 1:
        raise InvalidRequest(f"'structured_outputs' takes exactly one of {', '.join(STRUCTURED_KEYS)}; "
                             f"got {', '.join(given) or 'none'}", "structured_outputs")
    key = given[0]
    item, where = value[key], f"structured_outputs.{key}"
    if key == "json_object":
        if item is not True:
            raise InvalidRequest(f"'{where}' must be true", where)
        return Grammar("json_object")
    if key == "json":  # a schema, as an object or as its JSON text
        if isinstance(item, str):
            try:
                item = json.loads(item)
            except json.JSONDecodeError:
                raise InvalidRequest(f"'{where}' must be a JSON schema (an object, or its JSON text)", where) from None
        if not isinstance(item, dict | bool):
            raise InvalidRequest(f"'{where}' must be a JSON schema (an object, or its JSON text)", where)
        return _grammar("json_schema", json.dumps(item), where)
    if key == "choice":
        if not (isinstance(item, list) and item and all(isinstance(c, str) for c in item)):
            raise InvalidRequest(f"'{where}' must be a non-empty array of strings", where)
        return _grammar("choice", json.dumps(item), where)
    if not isinstance(item, str) or not item:
        raise InvalidRequest(f"'{where}' must be a non-empty string", where)
    return _grammar(STRUCTURED_KEYS[key], item, where)


def _grammar(kind: str, text: str, where: str) -> Grammar:
    if len(text) > MAX_GRAMMAR_CHARS:
        raise InvalidRequest(f"'{where}' holds {len(text)} characters; at most {MAX_GRAMMAR_CHARS}", where)
    return Grammar(kind, text)  # type: ignore[arg-type]  # one of GRAMMAR_KINDS, by the callers


def _object_or_none(body: dict, name: str) -> dict | None:
    value = body.get(name)
    if value is not None and not isinstance(value, dict):
        raise InvalidRequest(f"'{name}' must be an object", name)
    return value
