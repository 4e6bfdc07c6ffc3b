"""Penalties, logit_bias and stop_token_ids through the Engine: greedy answers equal a
reference loop that applies vLLM's rules in numpy to the model's own logits, for rows
that mix in one batch, whether a step's tokens are fed on the device (resident, chained
steps) or from the host (tiered experts); and bad ids are refused."""

from __future__ import annotations

import numpy as np
import pytest
import trio

from motet.engines.engine import Engine
from motet.model.generate import decode_step, generate, prefill_slot
from motet.model.kv import KVGeometry, init_kv
from motet.runtime.api import Grammar
from motet.runtime.config import ExpertSettings
from motet.runtime.errors import BadRequest

TINY = dict(kv_slots=4, max_context=256, prefill_chunk=16, prefill_chunk_alone=16, warm_up=False)
TIMEOUT = 240
NEW = 16
# (prompt, penalties): one batch of rows, each its own mix
ROWS = (
    ("the sea is", dict(frequency_penalty=1.5)),
    ("rivers run to", dict(presence_penalty=-0.5, repetition_penalty=1.8)),
    ("once upon a time there was a", dict(logit_bias={7: 3.0, 11: -100.0}, repetition_penalty=0.7)),
    ("a quiet night", {}),
)


def reference(model, ids: list[int], fields: dict) -> list[int]:
    """Greedy tokens, each picked from the model's logits after vLLM's rules, in numpy."""
    geo = KVGeometry(n_slots=1, max_context=256, chunk=16)
    kv = init_kv(model.config, geo, model.kv_dtype)
    logits, kv = prefill_slot(model, kv, geo, 0, ids, 0)
    vocab = model.config.vocab_size
    counts, seen = np.zeros(vocab), np.zeros(vocab, bool)
    seen[ids] = True
    bias = np.zeros(vocab)
    for token, value in fields.get("logit_bias", {}).items():
        bias[token] = value
    out = []
    for position in range(len(ids), len(ids) + NEW):
        x = np.asarray(logits, np.float64).reshape(-1)
        rep = fields.get("repetition_penalty", 1.0)
        x = np.where(seen | (counts > 0), np.where(x > 0, x / rep, x * rep), x)
        x = x - fields.get("frequency_penalty", 0.0) * counts - fields.get("presence_penalty", 0.0) * (counts > 0)
        token = int(np.argmax(x + bias))
        if token in model.tokenizer.eos_ids:
            break
        out.append(token)
        counts[token] += 1
        logits, kv = decode_step(model, kv, geo, [token], [0], [position])
    return out


async def answers(engine: Engine) -> list[list[int]]:
    """ROWS at once, greedy: each row's token ids."""
    out: list[list[int]] = [[] for _ in ROWS]

    async def one(i: int):
        prompt, fields = ROWS[i]
        async with engine.stream(prompt, max_tokens=NEW, **fields) as events:
            out[i] = [e.token_id async for e in events if hasattr(e, "token_id")]

    async with trio.open_nursery() as nursery:
        for i in range(len(ROWS)):
            nursery.start_soon(one, i)
    return out


@pytest.mark.parametrize("experts", ("resident", "tiered"))
async def test_penalized_rows_answer_as_the_reference_in_one_batch(tiny_model, experts, tmp_path):
    model = tiny_model("qwen3_moe")
    settings = ExpertSettings(device_experts_per_layer=model.config.n_experts_per_tok, ram_gb=0.0001,
                              heat_file=tmp_path / "heat.json")
    with trio.fail_after(TIMEOUT):
        async with Engine(model, **TINY, experts=settings if experts == "tiered" else None) as engine:
            got = await answers(engine)
            assert engine.expert_plan.mode == experts
            want = [reference(model, list(engine.encode(prompt)), fields) for prompt, fields in ROWS]
    assert got == want
    plain = [reference(model, list(engine.encode(prompt)), {}) for prompt, _ in ROWS[:3]]
    assert all(a != b for a, b in zip(want, plain))  # each penalty changed its row's answer


def test_the_plain_generator_takes_the_penalties_the_bias_and_a_grammar(tiny_model):
    """model.generate, one step at a time: the same greedy tokens as the reference for
    each row's penalties, and a grammar's choice."""
    model = tiny_model("qwen3_moe")
    for prompt, fields in ROWS:
        ids = list(model.tokenizer.encode(prompt, add_special=True))
        bias = tuple(fields.get("logit_bias", {}).items())
        rest = {k: v for k, v in fields.items() if k != "logit_bias"}
        assert list(generate(model, ids, max_tokens=NEW, logit_bias=bias, **rest)) == reference(model, ids, fields)
    ids = list(model.tokenizer.encode("the sea is", add_special=True))
    chosen = model.tokenizer.decode(list(generate(model, ids, max_tokens=NEW,
                                                  grammar=Grammar("choice", '["blue", "green"]'))))
    assert chosen in ("blue", "green")


async def test_a_second_turn_in_the_slot_penalizes_the_whole_prompt(tiny_model):
    """The slot's history is the conversation so far: a request continuing it (its KV
    reused) is penalized for the reused tokens too."""
    model = tiny_model("llama")
    fields = dict(repetition_penalty=3.0)
    with trio.fail_after(TIMEOUT):
        async with Engine(model, **TINY) as engine:
            first = await engine.complete("the sea is", max_tokens=8, slot=0)
            prompt = list(engine.encode("the sea is")) + list(first.token_ids) + list(engine.encode(" and"))[1:]
            second = await engine.complete(prompt, max_tokens=NEW, slot=0, **fields)
            assert second.stats.reused_tokens > 0
    assert list(second.token_ids) == reference(model, prompt, fields)


async def test_stop_token_ids_end_the_answer_before_the_token(tiny_model):
    with trio.fail_after(TIMEOUT):
        async with Engine(tiny_model("llama"), **TINY) as engine:
            free = await engine.complete("the sea is", max_tokens=NEW)
            stop = free.token_ids[3]
            stopped = await engine.complete("the sea is", max_tokens=NEW, stop_token_ids=[stop, 0])
            forced = await engine.complete("the sea is", max_tokens=NEW, logit_bias={stop: 100.0},
                                           stop_token_ids=[stop])
    first = free.token_ids.index(stop)
    assert stopped.token_ids == free.token_ids[:first] and stopped.stats.finish_reason == "stop"
    assert forced.token_ids == () and forced.stats.finish_reason == "stop"


async def test_ids_outside_the_vocabulary_are_refused(tiny_model):
    model = tiny_model("llama")
    vocab = model.tokenizer.vocab_size
    with trio.fail_after(TIMEOUT):
        async with Engine(model, **TINY) as engine:
            for fields, words in ((dict(logit_bias={vocab: 1.0}), "logit_bias's token id"),
                                  (dict(stop_token_ids=[vocab]), "stop_token_ids' token id"),
                                  (dict(prompt=[1, vocab]), "the prompt's token id")):
                prompt = fields.pop("prompt", "the sea is")
                with pytest.raises(BadRequest, match=f"{words} {vocab} is outside the vocabulary"):
                    await engine.complete(prompt, max_tokens=2, **fields)
            assert (await engine.complete("the sea is", max_tokens=2)).token_ids  # and it goes on serving


@pytest.mark.parametrize(("fields", "words"), [
    (dict(presence_penalty=2.5), "presence_penalty must be in"),
    (dict(frequency_penalty=float("nan")), "frequency_penalty must be in"),
    (dict(repetition_penalty=0.0), "repetition_penalty must be in"),
    (dict(logit_bias={3: 101.0}), "logit_bias maps"),
    (dict(logit_bias={-1: 1.0}), "logit_bias maps"),
    (dict(stop_token_ids=[-2]), "stop_token_ids are token ids"),
])
def test_bad_values_are_refused_in_the_requests_words(fields, words):
    from motet.runtime.api import GenerationRequest

    with pytest.raises(BadRequest, match=words):
        GenerationRequest.of("hi", **fields)
