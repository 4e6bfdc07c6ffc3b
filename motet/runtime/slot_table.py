"""Which KV slot a request gets, one rule for every engine: the idle slot whose history
shares the longest prefix with the prompt, else the least recently used idle one
(choose_slot). SlotTable keeps an engine's slots by that rule from outside it (the
split, the TCP worker): which are taken, what each holds as far as the holder knows,
and the requests waiting for one, first come first served."""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass

import trio

from .errors import BadRequest, QueueFull, SlotBusy


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass(frozen=True)
class SlotView:
    """What the scheduler knows of a slot when it picks one."""

    index: int
    busy: bool
    history: tuple[int, ...]
    last_used: int  # a counter: larger is more recent


def reusable_prefix(history: Sequence[int], prompt: Sequence[int]) -> int:
    """Prompt tokens whose KV a slot can keep. At least the last prompt token is always
    run again, since its logits pick the first new token."""
    return max(0, min(common_prefix(history, prompt), len(prompt) - 1))


def choose_slot(slots: Sequence[SlotView], prompt: Sequence[int]) -> int | None:
    """The idle slot whose history shares the longest prefix with the prompt, else the
    least recently used idle slot; None when every slot is busy."""
    idle = [s for s in slots if not s.busy]
    if not idle:
        return None
    best = max(idle, key=lambda s: (reusable_prefix(s.history, prompt), -s.last_used))
    if reusable_prefix(best.history, prompt) > 0:
        return best.index
    return min(idle, key=lambda s: s.last_used).index


class _Waiter:
    def __init__(self, ids: Sequence[int]):
        self.ids = ids
        self.slot = -1  # set just before granted is
        self.granted = trio.Event()


class SlotTable:
    """The slots of one engine: which the split's requests hold, and what each holds (token
    ids, as far as the split knows: the engine checks the real history before reusing
    any). A slot is chosen as the engine's scheduler chooses (choose_slot); with every
    slot taken, a request waits here, first come first served, up to `queue_limit`."""

    def __init__(self, n: int, queue_limit: float = math.inf):
        self.histories: list[tuple[int, ...]] = [()] * n
        self.used = [0] * n
        self.busy: set[int] = set()
        self.queue_limit = queue_limit
        self._queue: deque[_Waiter] = deque()
        self._clock = itertools.count(1)

    def __len__(self) -> int:
        return len(self.histories)

    @property
    def waiting(self) -> int:
        return len(self._queue)

    def _pick(self, ids: Sequence[int]) -> int | None:
        views = [SlotView(i, i in self.busy, h, u) for i, (h, u) in enumerate(zip(self.histories, self.used))]
        return choose_slot(views, ids)

    async def take(self, ids: Sequence[int], slot: int | None = None) -> int:
        """A slot for a prompt (`slot`: that one, SlotBusy when taken), held until give_back."""
        if slot is not None:
            if not 0 <= slot < len(self):
                raise BadRequest(f"slot must be in [0, {len(self) - 1}], got {slot}")
            if slot in self.busy:
                raise SlotBusy(slot)
            self.busy.add(slot)
            return slot
        if not self._queue and (slot := self._pick(ids)) is not None:
            self.busy.add(slot)
            return slot
        if len(self._queue) >= self.queue_limit:
            raise QueueFull(int(self.queue_limit))
        waiter = _Waiter(ids)
        self._queue.append(waiter)
        try:
            await waiter.granted.wait()
        except BaseException:
            if not waiter.granted.is_set():
                self._queue.remove(waiter)
            else:  # granted as it was cancelled: pass it on
                self.give_back(waiter.slot)
            raise
        return waiter.slot

    def give_back(self, slot: int, history: Sequence[int] | None = None) -> None:
        """Free a slot; `history`: what it holds now (None: as it was)."""
        self.busy.discard(slot)
        if history is not None:
            self.histories[slot] = tuple(history)
        self.used[slot] = next(self._clock)
        while self._queue and (free := self._pick(self._queue[0].ids)) is not None:
            waiter = self._queue.popleft()
            self.busy.add(free)
            waiter.slot = free
            waiter.granted.set()

    def reusable(self, slot: int, ids: Sequence[int]) -> int:
        return reusable_prefix(self.histories[slot], ids)

    @asynccontextmanager
    async def holding(self, ids: Sequence[int], slot: int | None = None) -> AsyncIterator[int]:
        """take() for the length of a block; given back (as it was) when it ends."""
        slot = await self.take(ids, slot)
        try:
            yield slot
        finally:
            self.give_back(slot)
