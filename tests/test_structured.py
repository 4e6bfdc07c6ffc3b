"""Constrained decoding through the Engine (model/constraint.py, sampling's bitmask): on
the default model, constrained and free rows in one batch each give what they must (a
schema-valid JSON object, one of the choices, a regex's match, the free row its own
greedy answer); resident and tiered experts agree; a grammar that cannot compile is a
BadRequest, and one that leaves no token ends its request "grammar"."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import trio
from conftest import mux_engine

from motet.engines.engine import Engine
from motet.model.constraint import GrammarCompiler
from motet.runtime.api import MAX_GRAMMAR_CHARS, Grammar
from motet.runtime.config import ExpertSettings
from motet.runtime.errors import BadRequest

SMOL = dict(kv_slots=4, max_context=512, prefill_chunk=64, prefill_chunk_alone=64, warm_up=False)
TINY = dict(kv_slots=4, max_context=256, prefill_chunk=16, prefill_chunk_alone=16, warm_up=False)
TIMEOUT = 240
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "languages"],
          "properties": {"name": {"type": "string", "maxLength": 20},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "languages": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                       "maxItems": 3}}}
ASK = [{"role": "user", "content": "Describe a person called Ann as JSON."}]
OK = [{"role": "user", "content": 'Reply with a JSON object with one key, "ok", set to true.'}]


async def one(engine: Engine, prompt, **fields):
    return await engine.chat(prompt, max_tokens=80, **fields) if isinstance(prompt, list) else \
        await engine.complete(prompt, max_tokens=80, **fields)


async def test_constrained_and_free_rows_in_one_batch(default_model):
    jobs = {
        "schema": (ASK, dict(grammar=Grammar("json_schema", json.dumps(PERSON)))),
        "object": (OK, dict(grammar=Grammar("json_object"))),
        "choice": ("Is the sky green? Answer:", dict(grammar=Grammar("choice", '["yes", "no", "maybe"]'),
                                                      temperature=1.0, seed=3)),
        "regex": ("Call me at", dict(grammar=Grammar("regex", r" [0-9]{3}-[0-9]{4}"))),
        "free": (ASK, {}),
    }
    got = {}
    with trio.fail_after(TIMEOUT):
        async with Engine(default_model, **SMOL) as engine:
            async with trio.open_nursery() as nursery:
                for name, (prompt, fields) in jobs.items():
                    async def run(name=name, prompt=prompt, fields=fields):
                        got[name] = await one(engine, prompt, **fields)
                    nursery.start_soon(run)
            alone = await one(engine, ASK)
    jsonschema.validate(json.loads(got["schema"].text), PERSON)
    assert isinstance(json.loads(got["object"].text), dict)
    assert got["choice"].text in ("yes", "no", "maybe")
    assert re.fullmatch(r" [0-9]{3}-[0-9]{4}", got["regex"].text)
    for name in ("schema", "object", "choice", "regex"):
        assert got[name].stats.finish_reason == "stop", name  # the grammar ended, then the model did
    assert got["free"].token_ids == alone.token_ids  # the constrained rows beside it changed nothing


@pytest.mark.parametrize("experts", ("resident", "tiered"))
async def test_a_gbnf_grammar_resident_and_tiered(tiny_model, experts, tmp_path):
    """The tiered experts' rows sample outside the step (the runner's own call), with the
    same bitmask: both answers match the grammar, and each other."""
    model = tiny_model("qwen3_moe")
    settings = ExpertSettings(device_experts_per_layer=model.config.n_experts_per_tok, ram_gb=0.0001,
                              heat_file=tmp_path / "heat.json")
    grammar = Grammar("grammar", 'root ::= "<" [a-c]+ ">" (" " [0-9])?')
    with trio.fail_after(TIMEOUT):
        async with Engine(model, **TINY, experts=settings if experts == "tiered" else None) as engine:
            answers = [await engine.complete(p, max_tokens=12, grammar=grammar) for p in ("the sea", "a cat")]
            assert engine.expert_plan.mode == experts
    for answer in answers:
        assert re.fullmatch(r"<[a-c]+>( [0-9])?", answer.text), answer.text


@pytest.mark.parametrize(("grammar", "words"), [
    (Grammar("regex", "[a-"), "the regex cannot be compiled"),
    (Grammar("json_schema", "{not json"), "the json_schema cannot be read: not JSON"),
    (Grammar("json_schema", '{"type": "integer", "minimum": 5, "maximum": 1}'), "Unsatisfiable schema"),
    (Grammar("json_schema", '{"$ref": "#/nowhere"}'), "cannot be compiled"),
    (Grammar("json_schema", "[1, 2]"), "a JSON schema is an object"),
    (Grammar("grammar", "root ::= missing"), "the grammar cannot be read"),
    (Grammar("choice", "[]"), "a choice is a non-empty JSON array of strings"),
])
async def test_a_grammar_that_cannot_compile_is_refused_and_the_engine_goes_on(default_model, grammar, words):
    with trio.fail_after(TIMEOUT):
        async with Engine(default_model, **SMOL) as engine:
            with pytest.raises(BadRequest, match=words):
                await engine.complete("hi", max_tokens=4, grammar=grammar)
            assert (await engine.complete("hi", max_tokens=2)).token_ids


def test_hostile_grammars_are_refused_or_bounded(default_model):
    """Deep recursion and a huge grammar compile within llguidance's limits or are
    refused; none runs away."""
    compiler = GrammarCompiler(default_model.tokenizer, default_model.config.vocab_size)
    recursive = {"type": "object", "properties": {"child": {"$ref": "#"}}, "required": ["child"]}
    deep = compiler.compile(Grammar("json_schema", json.dumps(recursive)))
    assert deep.allowed().any() and deep.failure is None
    nested = "root ::= " + "(" * 2000 + '"x"' + ")" * 2000
    with pytest.raises(BadRequest):
        compiler.compile(Grammar("grammar", nested))
    with pytest.raises(BadRequest, match="at most"):
        Grammar("grammar", "x" * (MAX_GRAMMAR_CHARS + 1))


async def test_a_grammar_that_leaves_no_token_ends_the_request(default_model):
    """A rule that only refers to itself matches no text: the request ends "grammar" at
    once, without a token, and the engine goes on serving."""
    with trio.fail_after(TIMEOUT):
        async with Engine(default_model, **SMOL) as engine:
            dead = await engine.complete("hi", max_tokens=8, grammar=Grammar("grammar", "start: start"))
            assert (await engine.complete("hi", max_tokens=2)).token_ids
    assert dead.stats.finish_reason == "grammar" and dead.token_ids == ()


@pytest.mark.parametrize("kind", ("engine", "mux"))
async def test_a_grammar_waits_for_its_after_text(tiny_model, kind):
    """Grammar.after (a reasoning block's end, on the chat route): the answer is free
    until it has written that text, then matches the grammar; the same through a mux
    child (SUBMIT's grammar_after option)."""
    with trio.fail_after(TIMEOUT):
        async with (Engine if kind == "engine" else mux_engine)(tiny_model("llama"), **TINY) as engine:
            free = await engine.complete("the sea is", max_tokens=12)
            marker = "".join(event.text for event in free.tokens[:2])
            waits = Grammar("choice", '["yes", "no"]', after=marker)
            answer = await engine.complete("the sea is", max_tokens=12, grammar=waits)
            never = await engine.complete("the sea is", max_tokens=12, grammar=Grammar("choice", '["yes"]',
                                                                                       after="never written"))
    assert answer.text.startswith(marker) and answer.text[len(marker):] in ("yes", "no"), answer.text
    assert never.text == free.text  # the grammar never applied
