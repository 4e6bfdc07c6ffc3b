"""Token ids to text one at a time, for streaming.

A byte-level token can hold part of a UTF-8 character (an emoji is often three or four
tokens), so text is released only once its bytes form whole characters. Working from each
token's bytes keeps a push O(1) in the length of the text so far, unlike re-decoding it.
"""

from __future__ import annotations

import codecs

from .tokenizer import Tokenizer


class IncrementalDetokenizer:
    """Feed token ids with `push`; each call returns the text completed by that token."""

    def __init__(self, tokenizer: Tokenizer, *, skip_special: bool = True):
        self._tokenizer = tokenizer
        self._skip_special = skip_special
        # Python's incremental UTF-8 decoder holds back an unfinished sequence and turns
        # bytes that can never be valid into U+FFFD, the same way the full decode does.
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        if self._skip_special and self._tokenizer.is_special(token_id):
            return ""
        return self._utf8.decode(self._tokenizer.token_bytes(token_id))

    def flush(self) -> str:
        """What is left at the end: an unfinished character becomes U+FFFD."""
        text = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return text
