"""Split serving (issue 7): one front over two engines. A prefill engine reads long
prompts; a decode engine makes every answer. A long prompt goes to the prefill engine,
which saves the slot it filled to a session file; the decode engine restores that file
into the request's own slot and resumes the prompt at its last token, while its other
slots keep decoding. Several handovers may be in progress at once, each with a file of
its own, deleted once restored.

    settings = SplitSettings.from_json('{"prefill_device": 0, "decode_device": 1}')
    async with open_split_engines(settings, model_path, kv_slots=8, max_context=8192) as engine:
        async with engine.stream("Once upon a time", max_tokens=32) as events:
            ...

`SplitEngine` offers what the HTTP app uses of an engine (stream, complete, render_chat,
name, statistics, expert_state, the async-with life cycle). It picks the decode slot
itself and keeps what each slot holds, as token ids, so it knows how many new tokens
the decode engine would read in place. Any failure on the way (the prefill engine dead
or raising, a file refused, fewer tokens restored than the prompt needs) is no error
for the client: the decode engine reads the prompt itself, only slower. A prefill
engine that dies is started again in the background, at most once a minute.

The settings are in runtime/split_settings.py; the state it keeps in split_state.py;
open_split_engines (split_children.py) starts it over two `motet mux` children.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import shutil
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from functools import partial
from pathlib import Path

import trio

from ..runtime.api import EngineStatistics, ExpertState, Handover, Health, SplitStatistics, TokenEvent
from ..runtime.collect import Collected
from ..runtime.errors import DuplicateId, EngineClosed, NotFound
from ..runtime.service import Service
from ..runtime.slot_table import SlotQueue
from ..runtime.split_settings import SplitSettings
from .split_state import HandoverCounts, HandoverFailed, Role, SplitRequest, SplitStream, SplitUnavailable
from .supervisor import OpenEngine

log = logging.getLogger(__name__)  # "motet.engines.split"

PREFILL_RESTART_EVERY_S = 60.0  # a prefill engine that died is started again at most this often
DECODE_RESTART_EVERY_S = 1.0  # the decode engine serves everything: again at once, but no busy loop

# ---- the engine --------------------------------------------------------------------------


class SplitEngine(Service, Collected):
    """The engine API over a prefill engine and a decode engine. `open_prefill()` and
    `open_decode()` each return a new engine (an async context manager: a MuxEngine, or
    an in-process Engine) with `prefill`, `save_slot`, `restore_slot` and `stream`; an
    engine with a `process` is watched, and opened again when it exits. `encode(prompt)`
    gives the token ids the engines will read (default: the decode engine's `encode`).
    `before_restore(path)`, awaited between a save and its restore, is for tests."""

    def __init__(self, open_prefill: OpenEngine, open_decode: OpenEngine, settings: SplitSettings = SplitSettings(),
                 *, encode: Callable | None = None, queue_limit: int = 64,
                 prefill_restart_every_s: float = PREFILL_RESTART_EVERY_S,
                 before_restore: Callable[[Path], Awaitable[None]] | None = None):
        self.settings = settings
        self.min_prompt_tokens = settings.min_prompt_tokens
        self.queue_limit = queue_limit
        # the decode engine's first start must succeed; the prefill engine's may come later
        self._prefill = Role("prefill", open_prefill, prefill_restart_every_s, must_start=False)
        self._decode = Role("decode", open_decode, DECODE_RESTART_EVERY_S)
        for role in (self._prefill, self._decode):
            role.on_up = partial(self._up, role)
        self._encode = encode
        self._before_restore = before_restore
        self._counts = HandoverCounts()
        self._requests: dict[int, SplitRequest] = {}
        self._ids = itertools.count(1)
        self._files = itertools.count(1)
        self._closing = False
        self.dir: Path | None = None
        self.name = ""  # the model's, once the decode engine has started
        self.kv_slots = 0

    # ---- life cycle -------------------------------------------------------------------

    async def start(self, nursery: trio.Nursery) -> None:
        """Start both engines at once; ready when the decode engine is (a prefill engine
        that cannot start is logged and tried again later: the decode engine serves)."""
        self.dir = self.settings.make_dir()
        try:
            nursery.start_soon(self._prefill.run)
            await nursery.start(self._decode.run)
            await self._prefill.tried.wait()
        except BaseException:
            shutil.rmtree(self.dir, ignore_errors=True)  # no _closed_now after a failed start
            raise
        self._nursery = nursery

    async def _close(self) -> None:
        await self.drain()
        for role in (self._prefill, self._decode):
            role.stop()  # it leaves its engine's block: the engine drains and ends
        for role in (self._prefill, self._decode):
            await role.done.wait()

    def _closed_now(self) -> None:
        self._closing = True
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)

    async def drain(self) -> None:
        """Refuse new requests and wait until every request in flight has ended."""
        self._closing = True
        for request in list(self._requests.values()):
            await request.ended.wait()

    def _up(self, role: Role, engine) -> None:
        waiting = self.queue_limit if role is self._decode else math.inf
        role.slots = SlotQueue(engine.kv_slots, waiting)
        if role is self._decode:
            self.name, self.kv_slots = engine.name, engine.kv_slots

    # ---- the engine API ---------------------------------------------------------------

    def _decode_engine(self):
        if self._closing:
            raise EngineClosed()
        engine = self._decode.alive()
        if engine is None:
            raise SplitUnavailable(self._decode.start_error)
        return engine

    @property
    def prefill(self):
        """The prefill engine now; None while it is down."""
        return self._prefill.engine

    @property
    def decode(self):
        """The decode engine now; None while it starts again."""
        return self._decode.engine

    async def wait_prefill(self, serving: bool = True) -> None:
        """Returns once a prefill engine serves (or, `serving=False`, once none does)."""
        while (self._prefill.alive() is not None) != serving:
            await self._prefill.changed.wait()

    @property
    def start_error(self) -> str | None:
        """Why the decode engine did not start again; None when it serves."""
        return self._decode.start_error if self._decode.engine is None else None

    def encode(self, prompt) -> tuple[int, ...]:
        if not isinstance(prompt, str):
            return tuple(int(t) for t in prompt)
        encode = self._encode or self._decode_engine().encode
        return tuple(encode(prompt))

    def render_chat(self, messages: list[dict], **template_kwargs) -> str:
        return self._decode_engine().render_chat(messages, **template_kwargs)

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        return self._decode_engine().tokenize(text, add_special)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._decode_engine().detokenize(ids)

    def statistics(self) -> EngineStatistics:
        """The decode side as the split's requests use it (a snapshot)."""
        slots = self._decode.slots
        if self._decode.alive() is None or slots is None or self._closing:
            return EngineStatistics(0, 0, self.kv_slots, True)
        return EngineStatistics(len(slots.busy), slots.waiting, len(slots), False)

    def expert_state(self) -> ExpertState:
        engine = self._decode.alive()
        return engine.expert_state() if engine is not None else ExpertState(0, 0, b"", b"", 0, ())

    def startup(self):
        """How the decode engine came up (it answers every request; None while it is down)."""
        engine = self._decode.alive()
        return engine.startup() if engine is not None else None

    def health(self) -> Health:
        return Health.of(self.statistics().closing, self.startup(), start_error=self.start_error,
                         split=self.split_statistics())

    def split_statistics(self) -> SplitStatistics:
        c = self._counts
        return SplitStatistics(
            c.requests, c.handovers, c.fallbacks, c.short, c.bytes, c.prefill_ms, c.save_ms, c.restore_ms,
            prefill_alive=self._prefill.alive() is not None, decode_alive=self._decode.alive() is not None,
            prefill_restarts=max(0, self._prefill.starts - 1), min_prompt_tokens=self.min_prompt_tokens,
            last=c.last,
        )

    # ---- slot files (POST /slots): the decode engine's slots, taken here first ---------

    async def save_slot(self, slot: int, path):
        return await self._on_slot(slot, lambda engine: engine.save_slot(slot, path), keep=True)

    async def restore_slot(self, slot: int, path):
        # What the file holds is not known here: counted as nothing, so a long prompt may be
        # handed over although the slot could have reused it (slower, never wrong).
        return await self._on_slot(slot, lambda engine: engine.restore_slot(slot, path), keep=False)

    async def erase_slot(self, slot: int) -> int:
        return await self._on_slot(slot, lambda engine: engine.erase_slot(slot), keep=False)

    async def _on_slot(self, slot: int, call, *, keep: bool):
        engine = self._decode_engine()
        slots = self._decode.table()
        await slots.take((), slot)
        try:
            result = await call(engine)
        except BaseException:
            slots.give_back(slot)
            raise
        slots.give_back(slot, None if keep else ())
        return result

    @asynccontextmanager
    async def stream(self, prompt, *, slot: int | None = None, request_id: int | None = None, **kwargs):
        """As Engine.stream (the same keywords): the answer comes from the decode engine,
        after a handover when the prompt is long enough."""
        decode = self._decode_engine()
        ids = self.encode(prompt)
        if request_id is None:
            request_id = next(i for i in self._ids if i not in self._requests)
        elif request_id in self._requests:
            raise DuplicateId(request_id)
        slots = self._decode.table()
        request = self._requests[request_id] = SplitRequest(request_id)
        target: int | None = None  # the decode slot
        history: tuple[int, ...] | None = None  # what it holds afterwards (None: as before)
        try:
            with request.cancellable():
                target = await slots.take(ids, slot)
            self._counts.requests += 1
            history = ()  # a handover cut short may leave the slot empty
            with request.cancellable():
                history = await self._prepare(request_id, decode, prompt, ids, target)
            async with AsyncExitStack() as stack:
                # The engines choose their own request ids: the split's would meet theirs
                with request.cancellable():
                    events = await stack.enter_async_context(decode.stream(prompt, slot=target, **kwargs))
                history = ()  # the request is in: the slot no longer holds what it held
                request.decode_id = events.request_id
                request.on_decode.set()
                split_events = SplitStream(events, request_id)
                try:
                    yield split_events
                finally:
                    history = self._held_after(prompt, ids, split_events.tokens)
        finally:
            if target is not None:
                slots.give_back(target, history)
            request.on_decode.set()
            request.ended.set()
            del self._requests[request_id]

    async def _prepare(self, request_id: int, decode, prompt, ids, target: int):
        """Hand the prompt over when the decode engine would read at least
        min_prompt_tokens itself; what the target slot holds now (None: as before)."""
        new = len(ids) - self._decode.table().reusable(target, ids)
        if new < self.min_prompt_tokens or len(ids) < 2:
            self._counts.short += 1
            return None
        try:
            figures = await self._hand_over(decode, prompt, ids, target)
        except HandoverFailed as exc:
            self._counts.fallbacks += 1
            log.warning("request %d: no handover (%s); the decode engine reads its %d new tokens itself",
                        request_id, exc, new)
            return ()
        c = self._counts
        c.handovers += 1
        c.bytes += figures.bytes
        c.prefill_ms += figures.prefill_ms
        c.save_ms += figures.save_ms
        c.restore_ms += figures.restore_ms
        c.last = figures
        return ids[:figures.tokens]

    async def _hand_over(self, decode, prompt, ids, target: int) -> Handover:
        """Prefill engine reads the prompt into a slot of its own and saves it; the decode
        engine restores the file into `target`. HandoverFailed with the reason."""
        prefill = self._prefill.alive()
        if prefill is None:
            raise HandoverFailed("the prefill engine is not running")
        slots = self._prefill.table()
        assert self.dir is not None  # made by start()
        path = self.dir / f"handover-{os.getpid()}-{next(self._files)}-{uuid.uuid4().hex[:8]}.session"
        own, held = None, ()
        try:
            own = await slots.take(ids)
            started = time.perf_counter()
            await prefill.prefill(prompt, slot=own)
            prefill_ms = (time.perf_counter() - started) * 1000
            saved = await prefill.save_slot(own, path)
            held = ids[:saved.tokens]
            if self._before_restore is not None:
                await self._before_restore(path)
            restored = await decode.restore_slot(target, path)
        except Exception as exc:  # noqa: BLE001 - any failure here only costs the client time
            raise HandoverFailed(f"{type(exc).__name__}: {exc}") from exc
        finally:
            if own is not None:
                slots.give_back(own, held)
            path.unlink(missing_ok=True)
        if restored.tokens != len(ids) - 1:
            raise HandoverFailed(f"the decode engine restored {restored.tokens} tokens, not the {len(ids) - 1} "
                                 "the prompt needs")
        return Handover(restored.tokens, saved.bytes, prefill_ms, saved.ms, restored.ms)

    def _held_after(self, prompt, ids, tokens: list[TokenEvent]) -> tuple[int, ...]:
        """What the decode slot holds after a turn (near enough: the engine checks)."""
        if all(t.token_id is not None for t in tokens):
            return tuple(ids) + tuple(t.token_id for t in tokens)
        if isinstance(prompt, str):  # a mux engine gives text only
            return self.encode(prompt + "".join(t.text for t in tokens))
        return tuple(ids)

    async def cancel(self, request_id: int) -> None:
        """Cancel a request; during its handover the stream raises Cancelled at entry."""
        request = self._requests.get(request_id)
        if request is None:
            raise NotFound(request_id)
        if request.decode_id is None:
            request.cancel()
            await request.ended.wait()
        else:
            await self._decode_engine().cancel(request.decode_id)

    async def stop(self, request_id: int) -> None:
        """End a request through its normal finish (after its handover, if one runs)."""
        request = self._requests.get(request_id)
        if request is None:
            raise NotFound(request_id)
        await request.on_decode.wait()
        if request.decode_id is not None:  # else it ended before the decode engine had it
            await self._decode_engine().stop(request.decode_id)


