"""Where a prompt's prefix comes from when its own slot holds less of it: a device copy
of another slot's KV (prefix sharing), or the host-RAM store of prefixes that requests
pushed out of the slots (`prefix_cache_gb`), written back into the slot. Both only when
they save at least runner.copy_min_tokens of reading (timed at warm-up)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import trio

from ..runtime.slot_table import SlotTable, longest_prefix, reusable_prefix
from .active_request import Active
from .kv_slot import KVSlot, SetHistory
from .runner import ModelRunner

Layers = list[tuple[np.ndarray, np.ndarray]]  # per layer, K and V [tokens, kv_heads, head_dim]


@dataclass
class StoredPrefix:
    tokens: tuple[int, ...]
    layers: Layers
    nbytes: int


class PrefixStore:
    """Prefixes in host RAM up to a budget of bytes, the least recently used out first.
    A prefix that extends one it holds replaces it."""

    def __init__(self, budget: int):
        self.budget = budget
        self.entries: OrderedDict[tuple[int, ...], StoredPrefix] = OrderedDict()
        self.nbytes = 0

    def put(self, tokens: tuple[int, ...], layers: Layers) -> None:
        nbytes = sum(k.nbytes + v.nbytes for k, v in layers)
        if nbytes > self.budget:
            return
        for held in [held for held in self.entries if tokens[: len(held)] == held]:
            self._drop(held)
        self.entries[tokens] = StoredPrefix(tokens, layers, nbytes)
        self.nbytes += nbytes
        while self.nbytes > self.budget:
            self._drop(next(iter(self.entries)))

    def covers(self, tokens: Sequence[int]) -> bool:
        """Whether it holds these tokens already (or a prefix that extends them)."""
        return any(held[: len(tokens)] == tuple(tokens) for held in self.entries)

    def longest(self, prompt: Sequence[int]) -> tuple[StoredPrefix | None, int]:
        """The stored prefix that shares the most of the prompt, and how much it shares
        (reusable_prefix's count); it becomes the most recently used."""
        keys = list(self.entries)
        index, shared = longest_prefix(enumerate(keys), prompt)
        if index is None:
            return None, 0
        self.entries.move_to_end(keys[index])
        return self.entries[keys[index]], shared

    def _drop(self, tokens: tuple[int, ...]) -> None:
        self.nbytes -= self.entries.pop(tokens).nbytes


class PrefixCache:
    def __init__(self, runner: ModelRunner, table: SlotTable, slots: list[KVSlot], limiter: trio.CapacityLimiter,
                 share: bool, store_bytes: int):
        self.runner, self.table, self.slots, self.limiter = runner, table, slots, limiter
        self.share = share  # copy a prefix from another slot
        self.store = PrefixStore(store_bytes) if store_bytes > 0 else None

    async def keep(self, slot: int, prompt: Sequence[int]) -> None:
        """Before a request takes an idle slot: the store keeps the slot's history when
        the request would overwrite enough of it."""
        history = self.table.histories[slot]
        kept = reusable_prefix(history, prompt)
        if self.store is None or len(history) - kept < self.runner.copy_min_tokens or self.store.covers(history):
            return
        layers = await self._on_device(self.runner.read_layers, slot, 0, self.runner.model.config.n_layers,
                                       len(history))
        self.store.put(tuple(history), layers)

    async def fill(self, prompt: tuple[int, ...], slot: int, own: int, running: Iterable[Active]) -> int:
        """Give `slot`, which holds `own` tokens of the prompt, the longest prefix another
        slot (busy: as far as its request has read) or the store holds, when that saves
        enough; the prompt tokens the slot holds now."""
        holders: list[tuple[int, Sequence[int]]] = [(a.slot, a.submit.prompt[: a.cursor]) for a in running]
        holders += [(i, h) for i, h in enumerate(self.table.histories) if not self.table.held(i)]
        source, shared = longest_prefix([h for h in holders if h[0] != slot], prompt) if self.share else (None, 0)
        stored, restorable = self.store.longest(prompt) if self.store is not None else (None, 0)
        if max(shared, restorable) - own < self.runner.copy_min_tokens:
            return own
        if source is not None and shared >= restorable:
            await self._on_device(self.runner.copy_prefix, source, slot, shared)
        else:
            assert stored is not None  # restorable > shared >= 0
            shared = restorable
            await self._on_device(self.runner.write_layers, slot, 0,
                                  [(k[:shared], v[:shared]) for k, v in stored.layers])
        await self.slots[slot].inbox.send.send(SetHistory(prompt[:shared]))
        return shared

    @property
    def stored_bytes(self) -> int:
        return 0 if self.store is None else self.store.nbytes

    async def _on_device(self, call, *args):
        return await trio.to_thread.run_sync(call, *args, limiter=self.limiter)
