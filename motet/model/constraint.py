"""Constrained decoding on the host: a request's Grammar compiled by llguidance into a
matcher that says, before each token, which tokens may come next, as a bitmask (bit t
of word t // 32 set: token t allowed). The sampler applies the bitmask on the device
(sampling.sample's `allowed`); the matcher then takes the token sampled.

llguidance over xgrammar: it installs with no dependencies (xgrammar's wheel requires
torch, triton and transformers), reads any vocabulary from its tokens' bytes, and takes
every form a request may carry (JSON schema, regex, choice, Lark and GBNF). Its mask
for a JSON schema took 0.16 ms a token on the default model, far under a decode step
(`benchmarks/structured.py`; the README's "Structured outputs").
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import llguidance
import numpy as np

from ..runtime.api import Grammar
from ..runtime.errors import BadRequest
from .tokenizer import Tokenizer

if TYPE_CHECKING:  # a TypedDict of llguidance's stubs only
    from llguidance._lib import JsonCompileOptions

# llguidance's own limits, made tighter where a request could make one mask step slow:
# a grammar or a regex past these is refused, or ends its request ("grammar"), never hangs.
def _limits() -> llguidance.LLParserLimits:
    return llguidance.LLParserLimits(step_lexer_fuel=200_000, step_max_items=50_000, max_grammar_size=200_000)


# JSON may have whitespace between its tokens, at most this much in one place: a model
# that favours whitespace cannot loop on it until max_tokens (a schema may set its own,
# llguidance's "x-guidance" options).
JSON_OPTIONS: JsonCompileOptions = {"whitespace_pattern": r"[\x20\x0A\x0D\x09]{0,24}"}


class _Vocabulary:
    """The tokenizer as llguidance's TokenizerWrapper reads it: each id's bytes."""

    def __init__(self, tokenizer: Tokenizer, vocab: int):
        self.eos_token_id = min(tokenizer.eos_ids) if tokenizer.eos_ids else 0
        self.bos_token_id = tokenizer.bos_id
        self.tokens = [tokenizer.token_bytes(i) if i < tokenizer.vocab_size else b"" for i in range(vocab)]
        self.special_token_ids = sorted(tokenizer.special_ids)
        self._tokenizer = tokenizer

    def __call__(self, text: str) -> list[int]:
        return self._tokenizer.encode(text)


class GrammarCompiler:
    """One per model: compiles requests' grammars against its vocabulary (built on first
    use: 0.1 s for the default model's 49152 tokens)."""

    def __init__(self, tokenizer: Tokenizer, vocab: int):
        self._tokenizer = tokenizer
        self.vocab = vocab
        self._ll: llguidance.LLTokenizer | None = None

    def _llg(self) -> llguidance.LLTokenizer:
        if self._ll is None:
            wrapper = llguidance.TokenizerWrapper(_Vocabulary(self._tokenizer, self.vocab))
            self._ll = llguidance.LLTokenizer(wrapper, n_vocab=self.vocab,
                                              eos_token=sorted(self._tokenizer.eos_ids) or None)
        return self._ll

    def compile(self, grammar: Grammar) -> Constraint:
        """A fresh matcher for one request; BadRequest naming what is wrong with the grammar."""
        try:
            definition = _definition(grammar)
        except (ValueError, TypeError) as exc:
            raise BadRequest(f"the {grammar.kind} cannot be read: {_first_line(exc)}") from None
        limits = _limits()
        problem = llguidance.LLMatcher.validate_grammar(definition, self._llg(), limits=limits)
        if problem:
            raise BadRequest(f"the {grammar.kind} cannot be compiled: {_first_line(problem)}")
        matcher = llguidance.LLMatcher(self._llg(), definition, log_level=0, limits=limits)
        if matcher.is_error():
            raise BadRequest(f"the {grammar.kind} cannot be compiled: {_first_line(matcher.get_error())}")
        return Constraint(matcher, (self.vocab + 31) // 32)


class Constraint:
    """One request's matcher: `allowed()` before each token, `accept(token)` after."""

    def __init__(self, matcher: llguidance.LLMatcher, words: int):
        self._matcher = matcher
        self._words = words
        self.failure: str | None = None  # why the grammar left no token, once it has

    def allowed(self) -> np.ndarray:
        """The bitmask of the next token, int32 [words]. One that allows nothing (a
        grammar no token can continue) sets `failure`."""
        mask = np.zeros(self._words, np.int32)
        self._matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
        if self._matcher.is_error() or not mask.any():
            self.failure = f"no token can continue the grammar ({_first_line(self._matcher.get_error())})"
        return mask

    def accept(self, token: int) -> bool:
        """Take the token sampled; False when the grammar had already failed or refuses it."""
        if self.failure is None and not self._matcher.consume_token(token):
            self.failure = _first_line(self._matcher.get_error()) or f"the grammar refuses token {token}"
        return self.failure is None


def _definition(grammar: Grammar) -> str:
    """llguidance's grammar for a Grammar."""
    if grammar.kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema(json.dumps({"type": "object"}), defaults=JSON_OPTIONS)
    if grammar.kind in ("json_schema", "choice"):
        try:
            value = json.loads(grammar.text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"not JSON: {exc}") from None
        if grammar.kind == "choice" and not (isinstance(value, list) and value
                                             and all(isinstance(v, str) for v in value)):
            raise ValueError("a choice is a non-empty JSON array of strings")
        if grammar.kind == "json_schema":
            if not isinstance(value, dict | bool):
                raise ValueError("a JSON schema is an object")
            return llguidance.LLMatcher.grammar_from_json_schema(grammar.text, defaults=JSON_OPTIONS)
    return llguidance.grammar_from(grammar.kind, grammar.text)


def _first_line(message: object) -> str:
    return str(message).strip().splitlines()[0] if str(message).strip() else "unknown error"
