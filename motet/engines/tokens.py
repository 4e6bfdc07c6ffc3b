"""Text to token ids and back, as an engine reads a prompt and writes an answer: the one
rule for every engine that holds a tokenizer (Engine's model, MuxEngine's files)."""

from __future__ import annotations

from collections.abc import Sequence

from ..model.detokenizer import IncrementalDetokenizer
from ..model.tokenizer import Tokenizer
from ..runtime.api import GenerationRequest
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
    _in_vocabulary(tokenizer, ids, "token id")
    detok = IncrementalDetokenizer(tokenizer)
    return "".join(detok.push(t) for t in ids) + detok.flush()


def check_ids(tokenizer: Tokenizer, request: GenerationRequest, prompt: Sequence[int]) -> None:
    """BadRequest for a token id of the request (its prompt, logit_bias, stop_token_ids)
    outside the vocabulary: the device would clamp it to another token, not refuse it."""
    _in_vocabulary(tokenizer, prompt, "the prompt's token id")
    _in_vocabulary(tokenizer, [t for t, _ in request.logit_bias], "logit_bias's token id")
    _in_vocabulary(tokenizer, request.stop_token_ids, "stop_token_ids' token id")


def _in_vocabulary(tokenizer: Tokenizer, ids: Sequence[int], what: str) -> None:
    vocab = tokenizer.vocab_size
    if bad := [t for t in ids if not 0 <= t < vocab]:
        raise BadRequest(f"{what} {bad[0]} is outside the vocabulary of {vocab}")
