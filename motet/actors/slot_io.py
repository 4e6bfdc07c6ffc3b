"""Messages that move one slot's KV in and out of the engine, layer by layer (session
files, prefill handovers). A slot is held first, so no request claims it meanwhile;
each layer is one short device call, so other slots keep decoding between them."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import trio


@dataclass(frozen=True)
class HoldSlot:
    slot: int
    reply: trio.MemorySendChannel  # gets the slot's history (token ids), or an EngineError


@dataclass(frozen=True)
class ReadLayer:
    slot: int
    layer: int
    tokens: int
    reply: trio.MemorySendChannel  # gets (K, V) [tokens, kv_heads, head_dim], or an exception


@dataclass(frozen=True)
class WriteLayer:
    slot: int
    layer: int
    k: np.ndarray
    v: np.ndarray
    reply: trio.MemorySendChannel  # gets None, or an exception


@dataclass(frozen=True)
class FreeSlot:
    slot: int
    history: tuple[int, ...] | None  # the tokens whose KV the slot now holds; None: unchanged
    reply: trio.MemorySendChannel | None = None  # gets None once requests may use the slot
