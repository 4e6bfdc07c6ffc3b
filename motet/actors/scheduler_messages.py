"""The scheduler's inbox: what an engine sends it, and what it answers a message left
in the inbox when it stops."""

from __future__ import annotations

from dataclasses import dataclass

import trio

from ..runtime.api import GenerationRequest
from .slot_io import FreeSlot, HoldSlot, ReadLayers, WriteLayers
from .step_rows import TokenConstraint


@dataclass(frozen=True)
class Submit:
    request_id: int
    request: GenerationRequest
    prompt: tuple[int, ...]
    events: trio.MemorySendChannel  # first an Accepted or an EngineError, then the stream
    constraint: TokenConstraint | None = None  # the request's grammar, compiled (its matcher)
    # the other choices of an n > 1 request: each starts from a copy of this one's KV once
    # its prompt is prefilled, in a free slot (with none free, it queues and prefills alone)
    forks: tuple[Submit, ...] = ()


@dataclass(frozen=True)
class Cancel:
    request_id: int
    reply: trio.MemorySendChannel | None = None  # gets True, or False for an unknown id


@dataclass(frozen=True)
class StopNow:
    """End a request now through its normal finish (finish reason `stop`)."""

    request_id: int
    reply: trio.MemorySendChannel | None = None  # gets True, or False for an unknown id


@dataclass(frozen=True)
class Subscribe:
    """Send every turn's Telemetry and every step's StepRouting to this channel (dropped
    when it is full)."""

    channel: trio.MemorySendChannel


@dataclass(frozen=True)
class Drain:
    """Refuse new requests; reply once every request in flight has finished."""

    reply: trio.MemorySendChannel


@dataclass(frozen=True)
class Accepted:
    request_id: int


def refuse_queued(inbox: trio.MemoryReceiveChannel) -> None:
    """Answer every message still queued as a stopped scheduler would (a stream closed, a
    reply of False or None), then close the inbox: nobody waits forever."""
    while True:
        try:
            msg = inbox.receive_nowait()
        except (trio.WouldBlock, trio.ClosedResourceError):
            break
        match msg:
            case Submit(events=events, forks=forks):
                events.close()
                for fork in forks:
                    fork.events.close()
            case Cancel(reply=reply) | StopNow(reply=reply) if reply is not None:
                reply.send_nowait(False)
            case Drain(reply):
                reply.send_nowait(None)
            case HoldSlot(reply=reply) | ReadLayers(reply=reply) | WriteLayers(reply=reply):
                reply.close()
            case FreeSlot(reply=reply) if reply is not None:
                reply.close()
    inbox.close()
