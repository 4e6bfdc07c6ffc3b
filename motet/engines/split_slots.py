"""The split's view of the decode engine's KV slots: what each holds (token ids), which
are busy, and the requests waiting for one, first come first served. SplitEngine
chooses slots itself (so it knows how many new tokens the decode engine would read)
with the engine's own policy."""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Sequence

import trio

from ..actors.policy import SlotView, choose_slot, reusable_prefix
from ..runtime.errors import BadRequest, QueueFull, SlotBusy


class _Waiter:
    def __init__(self, ids: Sequence[int]):
        self.ids = ids
        self.slot: int | None = None
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
            if waiter.slot is None:
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
