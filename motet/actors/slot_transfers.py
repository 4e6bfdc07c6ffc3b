"""The scheduler's half of a slot's KV moving in or out (actors/slot_io.py: session
files, prefill handovers): which slots are held for a transfer, and each transfer call
run in the device thread."""

from __future__ import annotations

from collections.abc import Callable

import trio

from ..runtime.actor import open_reply
from ..runtime.errors import BadRequest, SlotBusy
from .kv_slot import KVSlot, Probe, SetHistory
from .runner import ModelRunner
from .slot_io import FreeSlot, HoldSlot, ReadLayers, WriteLayers


class SlotTransfers:
    def __init__(self, slots: list[KVSlot], runner: ModelRunner, limiter: trio.CapacityLimiter):
        self.slots = slots
        self.runner = runner
        self.limiter = limiter  # the scheduler's: the one thread that touches the device
        self.held: set[int] = set()  # slots whose KV is being saved or installed

    async def handle(self, msg: HoldSlot | ReadLayers | WriteLayers | FreeSlot, busy: Callable[[int], bool]) -> bool:
        """Answer one transfer message; True when it freed a slot (the scheduler then
        admits who waits). busy(slot): a request or a transfer has the slot."""
        match msg:
            case HoldSlot(slot, reply):
                if not 0 <= slot < len(self.slots):
                    reply.send_nowait(BadRequest(f"slot must be in [0, {len(self.slots) - 1}], got {slot}"))
                elif busy(slot):
                    reply.send_nowait(SlotBusy(slot))
                else:
                    self.held.add(slot)
                    probe, answer = open_reply()
                    await self.slots[slot].inbox.send.send(Probe(probe))
                    reply.send_nowait((await answer.receive()).history)
            case ReadLayers(slot, layers, tokens, reply) if slot in self.held:
                read = self.runner.read_layers
                reply.send_nowait(await self.device_io(read, slot, layers.start, len(layers), tokens))
            case WriteLayers(slot, first, pairs, reply) if slot in self.held:
                reply.send_nowait(await self.device_io(self.runner.write_layers, slot, first, list(pairs)))
            case ReadLayers(slot, reply=reply) | WriteLayers(slot, reply=reply):
                reply.send_nowait(BadRequest(f"slot {slot} is not held for a KV transfer"))
            case FreeSlot(slot, history, reply):
                if slot in self.held:
                    if history is not None:
                        await self.slots[slot].inbox.send.send(SetHistory(tuple(history)))
                    self.held.discard(slot)
                if reply is not None:
                    reply.send_nowait(None)
                return True
        return False

    async def device_io(self, call, *args):
        """A transfer call in the device thread: its result, or the exception it raised
        (a bad transfer fails the caller, not the scheduler)."""
        try:
            return await trio.to_thread.run_sync(call, *args, limiter=self.limiter)
        except Exception as exc:  # noqa: BLE001 - handed to the caller
            return exc
