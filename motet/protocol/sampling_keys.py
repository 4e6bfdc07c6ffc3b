"""The engine's sampling fields as `key=value` text, for the wires whose requests carry
them so (mux SUBMIT's options, the TCP worker's message keys). Pure.

    seed=42 top_k=40 min_p=0.05 presence_penalty=0.5 frequency_penalty=0.5
    repetition_penalty=1.1 logit_bias=13:-100,2:2.5 stop_token_ids=2,7
"""

from __future__ import annotations

import math
from typing import Any

SAMPLING_KEYS = ("seed", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
                 "logit_bias", "stop_token_ids")
_DEFAULTS: dict[str, object] = {"seed": None, "top_k": 0, "min_p": 0.0, "presence_penalty": 0.0,
                                "frequency_penalty": 0.0, "repetition_penalty": 1.0, "logit_bias": (),
                                "stop_token_ids": ()}


def fields_of(pairs) -> dict:
    """The engine's stream() fields that (key, value) text pairs of SAMPLING_KEYS say
    (ValueError naming a value that does not read; the engine checks the ranges)."""
    fields: dict = {}
    for key, value in pairs:
        if key in ("seed", "top_k"):
            fields[key] = _whole(value, key)
        elif key == "logit_bias":
            fields[key] = dict(_pair(item) for item in _items(value))
        elif key == "stop_token_ids":
            fields[key] = tuple(_whole(item, key) for item in _items(value))
        else:
            fields[key] = read_real(value, key)
    return fields


def pairs_of(fields: dict) -> tuple[tuple[str, str], ...]:
    """The (key, value) text pairs that carry a request's fields (SAMPLING_KEYS of them),
    those at their defaults left out. logit_bias: pairs or a mapping."""
    pairs = []
    for key in SAMPLING_KEYS:
        value: Any = fields.get(key, _DEFAULTS[key])
        if value == _DEFAULTS[key] or (key == "logit_bias" and not value):
            continue
        if key == "logit_bias":
            items = value.items() if isinstance(value, dict) else value
            pairs.append((key, ",".join(f"{t}:{b!r}" for t, b in items)))
        elif key == "stop_token_ids":
            pairs.append((key, ",".join(map(str, value))))
        else:
            pairs.append((key, repr(value) if isinstance(value, float) else str(value)))
    return tuple(pairs)


def _items(value: str) -> list[str]:
    return value.split(",") if value else []


def _pair(item: str) -> tuple[int, float]:
    token, sep, bias = item.partition(":")
    if not sep:
        raise ValueError(f"logit_bias: {item!r} is not token:value")
    return _whole(token, "logit_bias"), read_real(bias, "logit_bias")


def _whole(value: str, key: str) -> int:
    if not (value.isascii() and value.isdigit() and len(value) <= 19):
        raise ValueError(f"{key}: {value!r} is not a whole number")
    return int(value)


def read_real(value: str, key: str) -> float:
    """A finite number, or ValueError naming `key`."""
    try:
        number = float(value)
    except ValueError:
        number = math.nan
    if not math.isfinite(number):
        raise ValueError(f"{key}: {value!r} is not a number")
    return number
