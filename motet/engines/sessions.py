"""A slot's KV out of the engine and back in: session files (save / restore / erase) and
the layer-by-layer transfers a prefill handover streams. The Engine's slot methods are
these functions over its scheduler inbox."""

from __future__ import annotations

import hashlib
import time
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import numpy as np
import trio

from .. import __version__
from ..actors.slot_io import FreeSlot, HoldSlot, ReadLayers, WriteLayers
from ..model.model import Model
from ..protocol.session_file import Session, SessionHeader, layer_arrays, read_session, write_session
from ..runtime.api import SlotFile
from ..runtime.kv_format import kv_layout

Ask = Callable[[Callable], Awaitable]  # Engine._ask: send a message with a reply channel, await the answer


def model_fingerprint(model: Model) -> str:
    """Names the weights without reading them: the config, the file names and sizes. Two
    engines started from the same files agree; a different quantization or a retrained
    checkpoint of another size does not."""
    files = [model.path] if model.path.is_file() else sorted(p for p in model.path.iterdir() if p.is_file())
    h = hashlib.sha256(repr(model.config).encode())
    for f in files:
        h.update(f"{f.name}:{f.stat().st_size}\n".encode())
    return f"{model.name}:{h.hexdigest()[:32]}"


def session_header(model: Model, max_context: int) -> SessionHeader:
    cfg, layout = model.config, kv_layout(model.kv_dtype)
    return SessionHeader(
        model=model_fingerprint(model), engine_version=__version__,
        dtype=model.kv_dtype, layers=cfg.n_layers,
        kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim, k_layout=layout, v_layout=layout,
        max_context=max_context, rope_theta=cfg.rope_theta, rope_scaling="",
        settings=(("backend", model.backend), ("weights", model.weight_format)),
    )


def _answer(value):
    if isinstance(value, BaseException):
        raise value
    return value


@asynccontextmanager
async def held_slot(ask: Ask, slot: int) -> AsyncIterator[SlotHold]:
    """Hold `slot` against requests; yields its SlotHold (its history, its layers). Leaving
    frees it with the history unchanged unless the body set `new_history`."""
    hold = SlotHold(ask, slot, _answer(await ask(lambda reply: HoldSlot(slot, reply))))
    try:
        yield hold
    finally:
        with trio.CancelScope(shield=True):
            await ask(lambda reply: FreeSlot(slot, hold.new_history, reply))


class SlotHold:
    def __init__(self, ask: Ask, slot: int, history: tuple[int, ...]):
        self.ask = ask
        self.slot = slot
        self.history = history
        self.new_history: tuple[int, ...] | None = None  # set: the slot holds these once freed

    async def read(self, layer: int, tokens: int) -> tuple[np.ndarray, np.ndarray]:
        return (await self.read_many(range(layer, layer + 1), tokens))[0]

    async def read_many(self, layers: range, tokens: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """Several layers in one device call (between two decode steps)."""
        return _answer(await self.ask(lambda reply: ReadLayers(self.slot, layers, tokens, reply)))

    async def write(self, layer: int, k: np.ndarray, v: np.ndarray) -> None:
        await self.write_many(layer, ((k, v),))

    async def write_many(self, first: int, pairs) -> None:
        """Layers first, first + 1, ... in one device call."""
        # Until the install completes the slot counts as empty, so a failure part way
        # leaves nothing a request would reuse.
        self.new_history = ()
        _answer(await self.ask(lambda reply: WriteLayers(self.slot, first, tuple(pairs), reply)))


async def save_slot(ask: Ask, header: SessionHeader, slot: int, path: Path) -> SlotFile:
    started = time.perf_counter()
    async with held_slot(ask, slot) as hold:
        tokens = hold.history
        pairs = await hold.read_many(range(header.layers), len(tokens))
    # the slot serves requests again while the file is written
    layers = ((k.tobytes(), v.tobytes()) for k, v in pairs)
    size = await trio.to_thread.run_sync(write_session, path, header, tokens, layers)
    return SlotFile(slot, len(tokens), size, (time.perf_counter() - started) * 1000)


async def restore_slot(ask: Ask, header: SessionHeader, slot: int, path: Path) -> SlotFile:
    """The whole file is read and verified before the slot is touched: a refused file
    (SessionError, with the reason) leaves the slot as it was."""
    started = time.perf_counter()
    session: Session = await trio.to_thread.run_sync(read_session, path, header)
    arrays = [layer_arrays(header, len(session.tokens), k, v) for k, v in session.layers]
    async with held_slot(ask, slot) as hold:
        await hold.write_many(0, arrays)
        hold.new_history = tuple(session.tokens)
    size = (await trio.Path(path).stat()).st_size
    return SlotFile(slot, len(session.tokens), size, (time.perf_counter() - started) * 1000)


async def install(ask: Ask, slot: int, tokens, layers: AsyncIterable[tuple[np.ndarray, np.ndarray]]) -> None:
    """Write each layer into `slot` as it comes; the slot's history becomes `tokens` only
    when every layer is in (a failure part way leaves the slot empty)."""
    async with held_slot(ask, slot) as hold:
        async for i, (k, v) in _enumerate(layers):
            await hold.write(i, k, v)
        hold.new_history = tuple(tokens)


async def _enumerate(items):
    i = 0
    async for item in items:
        yield i, item
        i += 1


async def erase_slot(ask: Ask, slot: int) -> int:
    """Forget the slot's history (its KV is simply no longer reused); the tokens it held."""
    async with held_slot(ask, slot) as hold:
        hold.new_history = ()
        return len(hold.history)

