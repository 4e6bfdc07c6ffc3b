"""SUBMIT's options [extension]: `key=value` words after its positional fields, for the
engine's sampling fields the line has no place for (protocol/sampling_keys.py says how
each reads). Pure.

    SUBMIT 7 0 5 64 0.7 0.9 seed=42 top_k=40 logit_bias=13:-100,2:2.5

and `grammar_after`: the text after which the line's grammar applies (a reasoning
block's end: the answer thinks freely first), percent-encoded where it holds a space,
`%` or a control character. An engine refuses a key it does not know (it would answer
otherwise than asked); a server written for the protocol never sends one.
"""

from __future__ import annotations

from urllib.parse import quote, unquote

from ..sampling_keys import SAMPLING_KEYS, fields_of

GRAMMAR_AFTER = "grammar_after"
OPTION_KEYS = (*SAMPLING_KEYS, GRAMMAR_AFTER)
_PLAIN = "".join(chr(c) for c in range(0x21, 0x7F) if chr(c) != "%")  # kept as they are


def parse_options(words: list[str]) -> tuple[tuple[str, str], ...]:
    """The options of a SUBMIT line, checked (ValueError naming the bad one)."""
    options: list[tuple[str, str]] = []
    for word in words:
        key, sep, value = word.partition("=")
        if not sep or key not in OPTION_KEYS:
            raise ValueError(f"unknown SUBMIT option {word!r} (known: {', '.join(OPTION_KEYS)})")
        if any(k == key for k, _ in options):
            raise ValueError(f"SUBMIT option {key!r} given twice")
        if key == GRAMMAR_AFTER and not grammar_after_of(value):
            raise ValueError(f"SUBMIT option {GRAMMAR_AFTER} is empty")
        options.append((key, value))
    sampling_fields(options)  # every value reads
    return tuple(options)


def sampling_fields(options: tuple[tuple[str, str], ...] | list[tuple[str, str]]) -> dict:
    """The engine's stream() fields the sampling options say."""
    return fields_of([(key, value) for key, value in options if key != GRAMMAR_AFTER])


def grammar_after(options: tuple[tuple[str, str], ...]) -> str | None:
    """The text the grammar waits for, when the options say one."""
    return next((grammar_after_of(value) for key, value in options if key == GRAMMAR_AFTER), None)


def grammar_after_of(value: str) -> str:
    return unquote(value, errors="strict")


def grammar_after_option(after: str) -> tuple[str, str]:
    """The option that carries a grammar's `after` text."""
    return GRAMMAR_AFTER, quote(after, safe=_PLAIN)
