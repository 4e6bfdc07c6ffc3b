"""KVSlot: one conversation's KV region. It knows which tokens' KV is resident, and on
a new request keeps the longest common prefix and hands back only the rest to prefill
(truncate-and-extend)."""

from __future__ import annotations

from dataclasses import dataclass

import trio

from ..runtime.actor import open_inbox
from ..runtime.slot_table import SlotView, reusable_prefix


@dataclass(frozen=True)
class Probe:
    reply: trio.MemorySendChannel  # gets a SlotView


@dataclass(frozen=True)
class Claim:
    request_id: int
    prompt: tuple[int, ...]
    reply: trio.MemorySendChannel  # gets the number of reused prompt tokens


@dataclass(frozen=True)
class Extend:
    tokens: tuple[int, ...]  # their KV has just been written after the resident ones


@dataclass(frozen=True)
class SetHistory:
    tokens: tuple[int, ...]  # the KV now resident (a restored session, or () once erased)


@dataclass(frozen=True)
class Release:
    request_id: int
    stamp: int  # the scheduler's clock: larger is more recent


class KVSlot:
    def __init__(self, index: int):
        self.index = index
        self.inbox = open_inbox()
        self.history: tuple[int, ...] = ()
        self.owner: int | None = None
        self.last_used = -1

    def view(self) -> SlotView:
        return SlotView(self.index, self.owner is not None, self.history, self.last_used)

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED):
        task_status.started()
        async for msg in self.inbox.receive:
            match msg:
                case Probe(reply):
                    reply.send_nowait(self.view())
                case Claim(request_id, prompt, reply):
                    if self.owner is not None:
                        reply.send_nowait(None)
                        continue
                    self.owner = request_id
                    keep = reusable_prefix(self.history, prompt)
                    self.history = self.history[:keep]
                    reply.send_nowait(keep)
                case Extend(tokens):
                    self.history += tokens
                case SetHistory(tokens):
                    self.history = tokens
                case Release(request_id, stamp):
                    if self.owner == request_id:
                        self.owner = None
                        self.last_used = stamp
