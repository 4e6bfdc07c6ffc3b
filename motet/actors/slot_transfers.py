"""The scheduler's half of a slot's KV moving in or out (actors/slot_io.py: session
files, prefill handovers): which slots are held for a transfer, and each transfer call
run in the device thread."""

from __future__ import annotations

import trio

from ..runtime.errors import BadRequest, EngineError
from ..runtime.slot_table import SlotTable
from .kv_slot import KVSlot, SetHistory
from .runner import ModelRunner
from .scheduler_messages import Submit
from .slot_io import FreeSlot, HoldSlot, ReadLayers, WriteLayers


class Transfer:
    """A slot's holder while its KV is saved or installed."""


class SlotTransfers:
    def __init__(self, slots: list[KVSlot], table: SlotTable[Submit | Transfer], runner: ModelRunner,
                 limiter: trio.CapacityLimiter):
        self.slots = slots
        self.table = table  # the scheduler's
        self.runner = runner
        self.limiter = limiter  # the scheduler's: the one thread that touches the device

    def _held(self, slot: int) -> bool:
        return isinstance(self.table.holder(slot), Transfer)

    async def handle(self, msg: HoldSlot | ReadLayers | WriteLayers | FreeSlot) -> list[tuple[Submit | Transfer, int]]:
        """Answer one transfer message; returns the waiting requests a freed slot admitted
        (each now holds its slot, and the scheduler starts it)."""
        match msg:
            case HoldSlot(slot, reply):
                try:
                    self.table.check(slot)
                    self.table.hold(slot, Transfer())
                except EngineError as exc:
                    reply.send_nowait(exc)
                else:
                    reply.send_nowait(self.table.histories[slot])  # a free slot's table entry is current
            case ReadLayers(slot, layers, tokens, reply) if self._held(slot):
                read = self.runner.read_layers
                reply.send_nowait(await self.device_io(read, slot, layers.start, len(layers), tokens))
            case WriteLayers(slot, first, pairs, reply) if self._held(slot):
                reply.send_nowait(await self.device_io(self.runner.write_layers, slot, first, list(pairs)))
            case ReadLayers(slot, reply=reply) | WriteLayers(slot, reply=reply):
                reply.send_nowait(BadRequest(f"slot {slot} is not held for a KV transfer"))
            case FreeSlot(slot, history, reply):
                admitted = []
                if isinstance(transfer := self.table.holder(slot), Transfer):
                    if history is not None:
                        await self.slots[slot].inbox.send.send(SetHistory(tuple(history)))
                    admitted = self.table.release(slot, transfer, history, touch=False)
                if reply is not None:
                    reply.send_nowait(None)
                return admitted
        return []

    async def device_io(self, call, *args):
        """A transfer call in the device thread: its result, or the exception it raised
        (a bad transfer fails the caller, not the scheduler)."""
        try:
            return await trio.to_thread.run_sync(call, *args, limiter=self.limiter)
        except Exception as exc:  # noqa: BLE001 - handed to the caller
            return exc
