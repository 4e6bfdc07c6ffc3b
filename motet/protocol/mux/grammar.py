"""SUBMIT's seventh field: the grammar's bytes, as colibri's gateway sends them: a JSON
schema (JSON text), or a grammar in llama.cpp's GBNF (Lark is read too). Pure."""

from __future__ import annotations

import json

from ...runtime.api import Grammar
from ...runtime.errors import BadRequest

ANY_OBJECT = json.dumps({"type": "object"})


def grammar_from_wire(data: bytes) -> Grammar:
    """The Grammar a SUBMIT carries: JSON text is a schema, anything else a grammar."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise BadRequest("the grammar is not UTF-8 text") from None
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return Grammar("grammar", text)
    return Grammar("json_schema", text)


def grammar_to_wire(grammar: Grammar) -> bytes:
    """A Grammar as the seventh field carries it: a schema as JSON, the other kinds as
    the Lark grammar that accepts the same strings."""
    if grammar.kind == "json_schema":
        text = grammar.text
    elif grammar.kind == "json_object":
        text = ANY_OBJECT
    elif grammar.kind == "regex":
        text = "start: /" + grammar.text.replace("/", "\\/") + "/"
    elif grammar.kind == "choice":
        text = "start: " + " | ".join(json.dumps(choice) for choice in json.loads(grammar.text))
    else:
        text = grammar.text
    return text.encode("utf-8")
