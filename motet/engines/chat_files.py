"""A model's name, chat template and tokenizer, for an engine whose model lives in a
child process (MuxEngine is one): read from its files on first use (the tokenizer and
template only, no weights)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from . import tokens


class ChatFiles:
    def __init__(self, model_path: str | Path | None):
        self.path = model_path  # None: the default model
        self._chat = None  # (tokenizer, render), once read

    @property
    def name(self) -> str:
        """As Model.name: the file's stem, or the directory's name."""
        from ..model.loader import DEFAULT_MODEL_FILE

        path = Path(self.path or DEFAULT_MODEL_FILE)
        return path.stem if path.suffix == ".gguf" or path.is_file() else path.name

    def _read(self):
        if self._chat is None:
            from ..model.loader import load_chat

            self._chat = load_chat(self.path)
        return self._chat

    def render_chat(self, messages: list[dict], **template_kwargs) -> str:
        return self._read()[1](messages, **template_kwargs)

    def encode(self, prompt: str) -> list[int]:
        """As Engine.encode reads a text prompt."""
        return tokens.tokenize(self._read()[0], prompt)

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        return tokens.tokenize(self._read()[0], text, add_special)

    def detokenize(self, ids: Sequence[int]) -> str:
        return tokens.detokenize(self._read()[0], ids)
