"""KVSlot: one conversation's KV region. It knows which tokens' KV is resident, and on
a new request keeps the longest common prefix and hands back only the rest to prefill
(truncate-and-extend). Whose it is, and when it was last used, is the scheduler's slot
table's to say (runtime/slot_table.py)."""

from __future__ import annotations

from dataclasses import dataclass

import trio

from ..runtime.actor import open_inbox
from ..runtime.slot_table import reusable_prefix


@dataclass(frozen=True)
class Claim:
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
    reply: trio.MemorySendChannel  # gets the history it holds now


class KVSlot:
    def __init__(self, index: int):
        self.index = index
        self.inbox = open_inbox()
        self.history: tuple[int, ...] = ()

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED):
        task_status.started()
        async for msg in self.inbox.receive:
            match msg:
                case Claim(prompt, reply):
                    keep = reusable_prefix(self.history, prompt)
                    self.history = self.history[:keep]
                    reply.send_nowait(keep)
                case Extend(tokens):
                    self.history += tokens
                case SetHistory(tokens):
                    self.history = tokens
                case Release(reply):
                    reply.send_nowait(self.history)
