"""What a SplitEngine keeps: each role's engine, kept running, and its slots (Role), a request until
it reaches the decode engine (SplitRequest) and its events after (SplitStream), and the
handovers' counts."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import trio

from ..runtime.api import Handover, TokenEvent
from ..runtime.errors import Cancelled, EngineUnavailable
from ..runtime.slot_table import SlotQueue
from .supervisor import Supervisor


class SplitUnavailable(EngineUnavailable):
    """The decode engine is starting again: the split serves nothing meanwhile."""

    def __init__(self, start_error: str | None):
        super().__init__(start_error, "the split's decode engine")


class HandoverFailed(Exception):
    """Why a handover did not happen; the decode engine reads the prompt itself."""


@dataclass
class Role(Supervisor):
    """One of the two engines, kept running (Supervisor), and its slots."""

    slots: SlotQueue | None = None  # set as each engine starts, before it is seen

    def table(self) -> SlotQueue:
        """Its engine's slots: there once an engine has started (alive() gave one)."""
        if self.slots is None:
            raise RuntimeError(f"the {self.name} engine has not started")
        return self.slots


@dataclass
class SplitRequest:
    """A request of the split's, until it ends. Before it reaches the decode engine
    (waiting for a slot, or in its handover) cancel() ends it here."""

    request_id: int
    decode_id: int | None = None  # its id in the decode engine, once there
    cancelled: bool = False
    scope: trio.CancelScope | None = None  # the step it is in before the decode engine
    on_decode: trio.Event = field(default_factory=trio.Event)  # in the decode engine, or ended
    ended: trio.Event = field(default_factory=trio.Event)

    def cancel(self) -> None:
        self.cancelled = True
        if self.scope is not None:
            self.scope.cancel()

    @contextmanager
    def cancellable(self):
        """A step cancel() may end: then Cancelled comes out of it."""
        self.scope = trio.CancelScope()
        if self.cancelled:
            self.scope.cancel()
        try:
            with self.scope:
                yield
        finally:
            self.scope = None
        if self.cancelled:
            raise Cancelled(self.request_id)


@dataclass
class HandoverCounts:
    requests: int = 0
    handovers: int = 0
    fallbacks: int = 0
    short: int = 0
    bytes: int = 0
    prefill_ms: float = 0.0
    save_ms: float = 0.0
    restore_ms: float = 0.0
    last: Handover | None = None


class SplitStream:
    """The decode engine's events, passed on; the token events are kept, for what the
    slot holds afterwards."""

    def __init__(self, events, request_id: int):
        self._events = events
        self.request_id = request_id  # the split's id (the decode engine's is its own)
        self.tokens: list[TokenEvent] = []

    @property
    def finish(self):
        return self._events.finish

    def __aiter__(self):
        return self

    async def __anext__(self):
        event = await self._events.__anext__()
        if isinstance(event, TokenEvent):
            self.tokens.append(event)
        return event
