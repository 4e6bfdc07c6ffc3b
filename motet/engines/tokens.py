"""Text to token ids and back, as an engine reads a prompt and writes an answer: the one
rule for every engine that holds a tokenizer (Engine's model, MuxEngine's files)."""

from __future__ import annotations

from collections.abc import Sequence

from ..model.detokenizer import IncrementalDetokenizer
from ..model.tokenizer import Tokenizer
from ..runtime.errors import BadRequest


def tokenize(tokenizer: Tokenizer, text: str, add_special: bool = True) -> list[int]:
    """`add_special`: with the BOS the model wants, as a prompt is read (Engine.encode);
    without, the text's own tokens alone."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: no text a tokenizer can read
        raise BadRequest("the prompt is not valid Unicode text (it holds a lone surrogate)") from None
    return tokenizer.encode_prompt(text) if add_special else tokenizer.encode(text)


def detokenize(tokenizer: Tokenizer, ids: Sequence[int]) -> str:
    """The text a stream gives for `ids` (the same detokenizer, token by token: special
    tokens write nothing)."""
    vocab = tokenizer.vocab_size
    if bad := [t for t in ids if not 0 <= t < vocab]:
        raise BadRequest(f"token id {bad[0]} is outside the vocabulary of {vocab}")
    detok = IncrementalDetokenizer(tokenizer)
    return "".join(detok.push(t) for t in ids) + detok.flush()
