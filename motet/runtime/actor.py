"""Actor primitives on Trio: an actor is a task that owns its state and is reached only
through its inbox, a bounded memory channel of small frozen dataclass messages."""

from __future__ import annotations

import math
from dataclasses import dataclass

import trio

from .api import FinishEvent, TokenEvent
from .errors import EngineClosed

# An inbox holds this many messages; a sender past it waits (backpressure), it is never dropped.
INBOX_SIZE = 256


@dataclass
class Inbox:
    send: trio.MemorySendChannel
    receive: trio.MemoryReceiveChannel


def open_inbox(size: int | float = INBOX_SIZE) -> Inbox:
    send, receive = trio.open_memory_channel(size)
    return Inbox(send, receive)


def open_reply() -> tuple[trio.MemorySendChannel, trio.MemoryReceiveChannel]:
    """A one-message reply channel: the replier never waits on it."""
    return trio.open_memory_channel(1)


def open_stream() -> tuple[trio.MemorySendChannel, trio.MemoryReceiveChannel]:
    """A request's event stream. Unbounded, so a slow reader never stalls the scheduler;
    its size is bounded by the request's max_tokens."""
    return trio.open_memory_channel(math.inf)


class EventStream:
    """A request's events: TokenEvents, then one FinishEvent, then the end."""

    def __init__(self, request_id: int, receive: trio.MemoryReceiveChannel):
        self.request_id = request_id
        self._receive = receive
        self.finish: FinishEvent | None = None

    def __aiter__(self):
        return self

    async def __anext__(self) -> TokenEvent | FinishEvent:
        if self.finish is not None:
            raise StopAsyncIteration
        try:
            event = await self._receive.receive()
        except (trio.EndOfChannel, trio.ClosedResourceError):
            raise EngineClosed() from None
        if isinstance(event, FinishEvent):
            self.finish = event
        return event
