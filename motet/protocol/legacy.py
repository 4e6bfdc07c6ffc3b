"""The legacy serve protocol (one conversation, interactive), as a sans-IO codec.

server → engine: a plain line is the user's next chat turn; control frames start with
\\x02: `\\x02RESET` (forget the conversation), `\\x02MORE` (continue an answer cut by
the token limit), `\\x02PROMPT <bytes> <max_tokens> <temperature> <top_p> [kv_slot]`
followed by exactly <bytes> of already-rendered prompt and `\\n`.

engine → server: the answer as raw text, then `\\x01\\x01END\\x01\\x01` and a STAT line.
"""

from __future__ import annotations

from dataclasses import dataclass

from .mux import MAX_PAYLOAD, Malformed, RequestReader

END = b"\x01\x01END\x01\x01"
CONTROL = b"\x02"


@dataclass(frozen=True)
class UserLine:
    text: str


@dataclass(frozen=True)
class Reset:
    pass


@dataclass(frozen=True)
class More:
    pass


@dataclass(frozen=True)
class RawPrompt:
    payload: bytes
    max_tokens: int
    temperature: float
    top_p: float
    slot: int = 0


@dataclass(frozen=True)
class BadFrame:
    """A \\x02PROMPT payload not followed by `\\n`: the stream is out of step."""


class LegacyDecoder(RequestReader):
    """The engine's reader of chat lines and \x02 control frames."""

    def _next(self):
        if self.pending is not None:
            return self._payload()
        line = self.lines.line()
        if line is None:
            return None
        if isinstance(line, Exception):
            return Malformed(0, str(line))
        if not line.startswith(CONTROL):
            return UserLine(line.decode("utf-8", "replace")) if line.strip() else self._next()
        words = line[1:].split()
        match words:
            case [b"RESET"]:
                return Reset()
            case [b"MORE"]:
                return More()
            case [b"PROMPT", *args]:
                return self._prompt_header(args)
        return Malformed(0, f"unknown control frame {bytes(line[1:20])!r}")

    def _prompt_header(self, args: list[bytes]):
        if len(args) not in (4, 5):
            return Malformed(0, f"PROMPT takes 4 or 5 fields, got {len(args)}")
        try:
            n = int(args[0])
            if not 0 <= n <= MAX_PAYLOAD:
                raise ValueError("payload size out of range")
        except ValueError as exc:
            return Malformed(0, f"PROMPT: {exc}")
        try:
            fields = (int(args[1]), float(args[2]), float(args[3]), int(args[4]) if len(args) == 5 else 0)
            problem = None
        except ValueError as exc:
            fields, problem = None, str(exc)
        # the size is known: the payload is consumed, good fields or not
        return self._expect(n, lambda body: _prompt(body, fields, problem), BadFrame())


def _prompt(body: bytes, fields, problem: str | None):
    if problem is not None:
        return Malformed(0, f"PROMPT: {problem}")
    max_tokens, temperature, top_p, slot = fields
    return RawPrompt(body, max_tokens, temperature, top_p, slot)


def encode_prompt(p: RawPrompt) -> bytes:
    head = f"\x02PROMPT {len(p.payload)} {p.max_tokens} {p.temperature:g} {p.top_p:g} {p.slot}\n"
    return head.encode() + p.payload + b"\n"


def encode_end(emitted: int, tokens_per_s: float, hit_pct: float, rss_gb: float,
               prompt_tokens: int, length_limited: bool) -> bytes:
    """The end of an answer: the sentinel line, then the turn's STAT line."""
    return END + b"\n" + (
        f"STAT {emitted} {tokens_per_s:.2f} {hit_pct:.1f} {rss_gb:.2f} {prompt_tokens} {int(length_limited)}\n"
    ).encode()


def encode_error(code: str, *args) -> bytes:
    """[extension] An answer that could not be given: this line replaces its text."""
    return b"\x01\x01" + " ".join(["ERROR", code, *map(str, args)]).encode() + b"\x01\x01\n"
