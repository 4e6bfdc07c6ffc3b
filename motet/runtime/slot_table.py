"""Which KV slot a request gets, one rule and one record for every engine.

choose_slot is the rule: the idle slot whose history shares the longest prefix with the
prompt, else the least recently used idle one. SlotTable is the record, pure code: which
slot is whose, what each holds as far as its keeper knows, when each was last used, and
who waits for one, first come first served. The scheduler keeps its KV slots in one, the
stdio bridge its wire claims, MuxEngine its child's slots; SlotQueue is the table for
tasks that wait their turn (the split, the TCP worker)."""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import AsyncIterator, Iterable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Generic, TypeVar

import trio

from .errors import BadRequest, QueueFull, SlotBusy


def common_prefix(a: Sequence, b: Sequence) -> int:
    """How many leading items two sequences share (token ids, or text)."""
    n = min(len(a), len(b))
    i = 0
    while i < n:  # blocks compared by slices first: the scheduler asks this of every slot
        j = min(i + 256, n)
        if a[i:j] != b[i:j]:
            break
        i = j
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass(frozen=True)
class SlotView:
    """What the scheduler knows of a slot when it picks one."""

    index: int
    busy: bool
    history: Sequence  # token ids, or text where the keeper sees only text (SlotTable)
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


def longest_prefix(holders: Iterable[tuple[int, Sequence]], prompt: Sequence) -> tuple[int | None, int]:
    """Of (slot, what its KV holds) pairs, the slot that holds the longest reusable
    prefix of the prompt, and its length; (None, 0) when none holds any."""
    best: tuple[int | None, int] = (None, 0)
    for slot, history in holders:
        shared = reusable_prefix(history, prompt)
        if shared > best[1]:
            best = (slot, shared)
    return best


T = TypeVar("T")


class SlotTable(Generic[T]):
    """Slots, their holders (any object: a request, a wire id, a transfer) and a queue of
    would-be holders. A slot is free when nobody holds it. Holds are exclusive, except
    where the keeper forwards a named slot to an engine that arbitrates it (MuxEngine's
    child): then holders share. The histories are sequences of anything comparable: token
    ids, or text where the keeper sees only text (MuxEngine)."""

    def __init__(self, n: int, queue_limit: float = math.inf):
        self.histories: list[Sequence] = [()] * n
        self.used = [0] * n  # larger is more recent; 0: never, or forgotten
        self.holders: dict[int, list[T]] = {}  # only held slots, each with its holders
        self.queue_limit = queue_limit
        self.queue: deque[tuple[T, Sequence]] = deque()  # (holder, prompt), oldest first
        self._clock = itertools.count(1)

    def __len__(self) -> int:
        return len(self.histories)

    def check(self, slot: int) -> None:
        if not 0 <= slot < len(self):
            raise BadRequest(f"slot must be in [0, {len(self) - 1}], got {slot}")

    def held(self, slot: int) -> bool:
        return slot in self.holders

    def holder(self, slot: int) -> T | None:
        """Who holds it (the first, where holders share), or None."""
        return self.holders[slot][0] if slot in self.holders else None

    def pick(self, prompt: Sequence) -> int | None:
        """The slot the rule gives a prompt now, or None when every slot is held."""
        views = [SlotView(i, i in self.holders, h, u) for i, (h, u) in enumerate(zip(self.histories, self.used))]
        return choose_slot(views, prompt)

    def hold(self, slot: int, holder: T, share: bool = False) -> None:
        """That slot for `holder`; SlotBusy when someone holds it (unless `share`)."""
        if slot in self.holders and not share:
            raise SlotBusy(slot)
        self.holders.setdefault(slot, []).append(holder)

    def take(self, holder: T, prompt: Sequence) -> int | None:
        """A slot by the rule, held for `holder`; None when it joined the queue (admit()
        hands it one later); QueueFull when the queue is full."""
        if not self.queue and (slot := self.pick(prompt)) is not None:
            self.holders[slot] = [holder]
            return slot
        if len(self.queue) >= self.queue_limit:
            raise QueueFull(int(self.queue_limit))
        self.queue.append((holder, prompt))
        return None

    def withdraw(self, holder: T) -> bool:
        """Take a holder out of the queue; False when it was not there."""
        for entry in self.queue:
            if entry[0] == holder:
                self.queue.remove(entry)
                return True
        return False

    def release(self, slot: int, holder: T, history: Sequence | None = None,
                touch: bool = True) -> list[tuple[T, int]]:
        """`holder` lets go of a slot: `history`, what it holds now (None: as it was);
        `touch`, count it as used now. Returns who in the queue got a slot by it (each now
        held); nothing happens when `holder` did not hold it."""
        holders = self.holders.get(slot, [])
        if holder not in holders:
            return []
        holders.remove(holder)
        if not holders:
            del self.holders[slot]
        if history is not None:  # text stays text (MuxEngine's); token ids become a tuple
            self.histories[slot] = history if isinstance(history, str) else tuple(history)
        if touch:
            self.used[slot] = next(self._clock)
        return self.admit()

    def forget(self, slot: int) -> None:
        """It holds nothing, and is the first choice for a new conversation."""
        self.histories[slot] = ()
        self.used[slot] = 0

    def admit(self) -> list[tuple[T, int]]:
        """Hand free slots to the queue, oldest first, while the rule gives its head one."""
        admitted = []
        while self.queue and (slot := self.pick(self.queue[0][1])) is not None:
            holder, _ = self.queue.popleft()
            self.holders[slot] = [holder]
            admitted.append((holder, slot))
        return admitted

    def reusable(self, slot: int, prompt: Sequence) -> int:
        return reusable_prefix(self.histories[slot], prompt)


class _Waiter:
    def __init__(self) -> None:
        self.slot = -1  # set just before granted is
        self.granted = trio.Event()


class SlotQueue:
    """A SlotTable for tasks: take() waits, first come first served, for a slot."""

    def __init__(self, n: int, queue_limit: float = math.inf):
        self.table: SlotTable[_Waiter] = SlotTable(n, queue_limit)

    def __len__(self) -> int:
        return len(self.table)

    @property
    def waiting(self) -> int:
        return len(self.table.queue)

    @property
    def busy(self) -> set[int]:
        return set(self.table.holders)

    async def take(self, ids: Sequence[int], slot: int | None = None) -> int:
        """A slot for a prompt (`slot`: that one, SlotBusy when taken), held until give_back."""
        waiter = _Waiter()
        if slot is not None:
            self.table.check(slot)
            self.table.hold(slot, waiter)
            return slot
        if (got := self.table.take(waiter, ids)) is not None:
            return got
        try:
            await waiter.granted.wait()
        except BaseException:
            if not self.table.withdraw(waiter):  # granted as it was cancelled: pass it on
                self.give_back(waiter.slot)
            raise
        return waiter.slot

    def give_back(self, slot: int, history: Sequence[int] | None = None) -> None:
        """Free a slot; `history`: what it holds now (None: as it was)."""
        holder = self.table.holder(slot)
        if holder is None:
            return
        for waiter, got in self.table.release(slot, holder, history):
            waiter.slot = got
            waiter.granted.set()

    def reusable(self, slot: int, ids: Sequence[int]) -> int:
        return self.table.reusable(slot, ids)

    @asynccontextmanager
    async def holding(self, ids: Sequence[int], slot: int | None = None) -> AsyncIterator[int]:
        """take() for the length of a block; given back (as it was) when it ends."""
        slot = await self.take(ids, slot)
        try:
            yield slot
        finally:
            self.give_back(slot)
