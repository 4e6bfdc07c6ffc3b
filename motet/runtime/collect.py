"""What every engine offers on top of its own `stream()`, `render_chat()`, `statistics()`
and `startup()`: the answer collected (`complete`, `chat`), a chat streamed
(`stream_chat`), n answers side by side (`choices`; the in-process engine has its own),
its health, and a prompt read without an answer (`prefill`). One copy for all four
engines."""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Any

from .api import Completion, EngineStatistics, FinishEvent, Health, StartupReport, TokenEvent, TurnStats
from .choices import independent_choices
from .errors import Cancelled, EngineClosed

if TYPE_CHECKING:
    from .engine_api import Events


class Collected:
    if TYPE_CHECKING:  # what each engine writes itself
        def stream(self, *args: Any, **kwargs: Any) -> AbstractAsyncContextManager[Events]: ...
        def render_chat(self, messages: list[dict], **template_kwargs: Any) -> str: ...
        def statistics(self) -> EngineStatistics: ...
        def startup(self) -> StartupReport | None: ...

    async def complete(self, prompt, **kwargs) -> Completion:
        """The same as stream(), collected. A request cancelled meanwhile raises Cancelled.
        Token ids are there when the engine reports them (not over the mux wire)."""
        async with self.stream(prompt, **kwargs) as events:
            tokens = [e async for e in events if isinstance(e, TokenEvent)]
        finish = finished(events)
        stats = finish.stats
        if stats.finish_reason == "cancelled":
            raise Cancelled(events.request_id)
        text = "".join(t.text for t in tokens) + finish.text_tail
        ids = tuple(t.token_id for t in tokens if t.token_id is not None)
        ids = ids if len(ids) == len(tokens) else ()  # all or none: a mux engine reports none
        return Completion(text, ids, stats, tuple(tokens))

    def choices(self, prompt, n: int, **kwargs):
        """n answers to one prompt (EngineAPI.choices): here n requests side by side, each
        reading the prompt itself (the in-process engine reads it once)."""
        return independent_choices(self, prompt, n, **kwargs)

    async def chat(self, messages: list[dict], **kwargs) -> Completion:
        return await self.complete(self.render_chat(messages), **kwargs)

    def stream_chat(self, messages: list[dict], **kwargs):
        return self.stream(self.render_chat(messages), **kwargs)

    def health(self) -> Health:
        return Health.of(self.statistics().closing, self.startup())

    async def prefill(self, prompt, *, slot: int | None = None, request_id: int | None = None) -> TurnStats:
        """Read a prompt up to its last token (n - 1 tokens into the slot's KV, where a
        request continuing it resumes) without generating; its TurnStats (finish reason
        "prefilled")."""
        async with self.stream(prompt, max_tokens=1, slot=slot, request_id=request_id,
                               prefill_only=True) as events:
            async for _ in events:
                pass
        stats = finished(events).stats
        if stats.finish_reason == "cancelled":
            raise Cancelled(events.request_id)
        return stats


def finished(events: Events) -> FinishEvent:
    """A stream's finish, once read to its end; EngineClosed for one that ended without
    (the engine went away)."""
    if events.finish is None:
        raise EngineClosed()
    return events.finish
