"""The reasoning splitter (http/reasoning.py): <think>…</think> apart from the content,
whatever pieces the text arrives in."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from motet.http.reasoning import ReasoningSplitter, opens_reasoning, split

CASES = [
    ("<think>why</think>so", False, ("why", "so")),
    ("\n<think>a<b</think>\n\nc", False, ("a<b", "\n\nc")),
    ("why</think>so", True, ("why", "so")),
    ("no block at all", False, ("", "no block at all")),
    ("text <think>later</think> is content", False, ("", "text <think>later</think> is content")),
    ("<think>never closed", False, ("never closed", "")),
    ("never closed", True, ("never closed", "")),
    ("<thin", False, ("", "<thin")),
    ("", True, ("", "")),
]


@pytest.mark.parametrize(("text", "inside", "parts"), CASES)
def test_whole_answers(text, inside, parts):
    assert split(text, inside) == parts


@given(st.sampled_from(CASES), st.lists(st.integers(0, 40), max_size=6))
def test_any_pieces_give_the_same_parts(case, cuts):
    text, inside, parts = case
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    splitter, reasoning, content = ReasoningSplitter(inside), "", ""
    for a, b in zip(bounds, bounds[1:]):
        r, c = splitter.push(text[a:b])
        reasoning, content = reasoning + r, content + c
    r, c = splitter.flush()
    assert (reasoning + r, content + c) == parts


def test_a_template_that_opens_the_block():
    assert opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
