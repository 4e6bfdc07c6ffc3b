"""SUBMIT's options [extension]: `key=value` words after its positional fields, for the
engine's sampling fields the line has no place for (protocol/sampling_keys.py says how
each reads). Pure.

    SUBMIT 7 0 5 64 0.7 0.9 seed=42 top_k=40 logit_bias=13:-100,2:2.5

An engine refuses a key it does not know (it would answer otherwise than asked); a
server written for the protocol never sends one.
"""

from __future__ import annotations

from ..sampling_keys import SAMPLING_KEYS, fields_of


def parse_options(words: list[str]) -> tuple[tuple[str, str], ...]:
    """The options of a SUBMIT line, checked (ValueError naming the bad one)."""
    options: list[tuple[str, str]] = []
    for word in words:
        key, sep, value = word.partition("=")
        if not sep or key not in SAMPLING_KEYS:
            raise ValueError(f"unknown SUBMIT option {word!r} (known: {', '.join(SAMPLING_KEYS)})")
        if any(k == key for k, _ in options):
            raise ValueError(f"SUBMIT option {key!r} given twice")
        options.append((key, value))
    fields_of(options)  # every value reads
    return tuple(options)
