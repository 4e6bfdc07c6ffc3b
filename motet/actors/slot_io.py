"""Messages that move one slot's KV in and out of the engine, layer by layer (session
files, prefill handovers). A slot is held first, so no request claims it meanwhile.
One message is one device call between two decode steps: a whole file's layers go in
one (a step's worth of waiting for the other slots, not one step per layer), a
handover's layers one by one as they arrive."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import trio


@dataclass(frozen=True)
class HoldSlot:
    slot: int
    reply: trio.MemorySendChannel  # gets the slot's history (token ids), or an EngineError


@dataclass(frozen=True)
class ReadLayers:
    slot: int
    layers: range
    tokens: int
    reply: trio.MemorySendChannel  # gets [(K, V) [tokens, kv_heads, head_dim]] per layer, or an exception


@dataclass(frozen=True)
class WriteLayers:
    slot: int
    first: int  # the layer of the first pair
    pairs: tuple[tuple[np.ndarray, np.ndarray], ...]  # (K, V) per layer
    reply: trio.MemorySendChannel  # gets None, or an exception


@dataclass(frozen=True)
class FreeSlot:
    slot: int
    history: tuple[int, ...] | None  # the tokens whose KV the slot now holds; None: unchanged
    reply: trio.MemorySendChannel | None = None  # gets None once requests may use the slot
