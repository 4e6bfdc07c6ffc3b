"""Several answers to one prompt (OpenAI's `n`): their events merged into one stream.

    async with engine.choices(prompt, 3, temperature=0.8) as choices:
        async for index, event in choices:
            ...

The in-process engine prefills the prompt once and starts the other choices from a copy
of its KV (actors/scheduler.py); the other engines run n requests side by side
(`independent_choices`). Choice i samples with seed + i when a seed is given, so the
choices differ and a seeded request repeats.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import trio

from .api import FinishEvent, TokenEvent
from .errors import BadRequest, EngineClosed, EngineError

if TYPE_CHECKING:
    from .engine_api import Events

MAX_CHOICES = 16  # as many as an engine has KV slots at most


class Choices:
    """n choices' events as they come, as (index, event): each choice's TokenEvents, then
    its FinishEvent; the iteration ends after the last FinishEvent. Anything else the
    channel carries (an engine's acknowledgement) is skipped; an EngineError is raised."""

    def __init__(self, request_ids: Sequence[int], receive: trio.MemoryReceiveChannel):
        self.request_ids = list(request_ids)
        self.finishes: list[FinishEvent | None] = [None] * len(self.request_ids)
        self._index = {rid: i for i, rid in enumerate(self.request_ids)}
        self._receive = receive

    @property
    def finished(self) -> bool:
        return all(finish is not None for finish in self.finishes)

    def __aiter__(self):
        return self

    async def __anext__(self) -> tuple[int, TokenEvent | FinishEvent]:
        while not self.finished:
            try:
                event = await self._receive.receive()
            except (trio.EndOfChannel, trio.ClosedResourceError):
                raise EngineClosed() from None
            if isinstance(event, EngineError):
                raise event
            if isinstance(event, TokenEvent):
                return self._index[event.request_id], event
            if isinstance(event, FinishEvent):
                index = self._index[event.stats.request_id]
                self.finishes[index] = event
                return index, event
        raise StopAsyncIteration


def choice_fields(n: int, fields: dict[str, Any]) -> list[dict[str, Any]]:
    """Each choice's request fields: the same, but choice i's seed is seed + i. A
    BadRequest for what n choices cannot share (a pinned slot holds one conversation)."""
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_CHOICES:
        raise BadRequest(f"n must be an integer in [1, {MAX_CHOICES}], got {n!r}")
    if n > 1:
        for name, why in (("slot", "a slot holds one conversation"), ("prefill_only", "a prefill has no answers"),
                          ("request_id", "the engine numbers the choices")):
            if fields.get(name) not in (None, False):
                raise BadRequest(f"{name} cannot be given with n > 1: {why}")
    seed = fields.get("seed")
    return [fields if seed is None else {**fields, "seed": seed + i} for i in range(n)]


@asynccontextmanager
async def independent_choices(engine: Any, prompt: str | Sequence[int], n: int,
                              **fields: Any) -> AsyncIterator[Choices]:
    """n requests for one prompt side by side, each prefilling it, through the engine's
    own `stream`; leaving the block cancels those still in flight."""
    each = choice_fields(n, fields)
    send, receive = trio.open_memory_channel(0)
    async with AsyncExitStack() as requests:
        streams: list[Events] = [await requests.enter_async_context(engine.stream(prompt, **f)) for f in each]
        async with trio.open_nursery() as nursery:
            with send, receive:
                for events in streams:
                    nursery.start_soon(_forward, events, send.clone())
                yield Choices([events.request_id for events in streams], receive)
                nursery.cancel_scope.cancel()


async def _forward(events: Events, send: trio.MemorySendChannel) -> None:
    """One stream's events onto the merged channel, named by its own request id."""
    rid = events.request_id
    async with send:
        try:
            async for event in events:
                if isinstance(event, TokenEvent):
                    event = replace(event, request_id=rid)
                else:
                    event = replace(event, stats=replace(event.stats, request_id=rid))
                await send.send(event)
        except EngineError as exc:
            await send.send(exc)
