"""The ExpertCache actor: owns the expert decisions. The scheduler tells it what each step
routed; it keeps the heat (ExpertPolicy), decides the pinned hot set between steps and
hands the placement back, and keeps the heat file so a restarted engine starts warm.

The hot path never waits for it: routing arrives with a non-blocking send (a full inbox
drops that step's heat, never stalls decode), and the scheduler picks up the newest
placement, if any, before its next device call.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import trio

from ..model.expert_pool import Placement
from ..runtime.actor import open_inbox
from .expert_policy import ExpertPolicy, load_heat, save_heat

log = logging.getLogger(__name__)

SAVE_EVERY_S = 30.0  # at a turn's end, the heat file is rewritten at most this often
ROUTING_INBOX = 1024  # steps of routing that may queue before one is dropped


@dataclass(frozen=True)
class Observe:
    counts: np.ndarray  # one step's routed tokens per (MoE layer, expert)


@dataclass(frozen=True)
class TurnEnded:
    pass


@dataclass(frozen=True)
class SaveHeat:
    reply: trio.MemorySendChannel | None = None  # gets the path written, or None


@dataclass(frozen=True)
class HeatFile:
    path: Path
    fingerprint: str  # what a heat file must be for (model, layers × experts)


class ExpertCache:
    def __init__(self, policy: ExpertPolicy, *, tiered: bool, heat_file: HeatFile | None):
        self.policy = policy
        self.tiered = tiered
        self.heat_file = heat_file
        self.inbox = open_inbox(ROUTING_INBOX)
        # The scheduler drains this before each device call and applies the newest.
        self._send_placement, self.placements = trio.open_memory_channel(16)
        self._saved_at = time.monotonic()
        self._dirty = False

    @staticmethod
    def read_heat(heat_file: HeatFile | None, shape: tuple[int, int]) -> np.ndarray | None:
        """The saved heat for this model (None: none, or a bad file, with a warning)."""
        if heat_file is None:
            return None
        heat = load_heat(heat_file.path, heat_file.fingerprint, shape)
        if heat is not None:
            log.info("expert heat from %s: starting warm", heat_file.path)
        return heat

    def observe_nowait(self, counts: np.ndarray) -> None:
        """The scheduler's per-step report; dropped when the inbox is full."""
        try:
            self.inbox.send.send_nowait(Observe(counts))
        except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
            pass

    def newest_placement(self) -> Placement | None:
        """The newest placement not yet applied (None when nothing changed)."""
        newest = None
        while True:
            try:
                newest = self.placements.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                return newest

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED):
        task_status.started()
        try:
            async for msg in self.inbox.receive:
                match msg:
                    case Observe(counts):
                        self._observe(counts)
                    case TurnEnded():
                        if time.monotonic() - self._saved_at >= SAVE_EVERY_S:
                            await self._save()
                    case SaveHeat(reply):
                        path = await self._save(force=True)
                        if reply is not None:
                            reply.send_nowait(path)
                    case _:
                        raise TypeError(f"the expert cache got an unknown message {msg!r}")
        finally:
            with trio.CancelScope(shield=True):
                await self._save()

    def _observe(self, counts: np.ndarray) -> None:
        self.policy.observe(counts)
        self._dirty = True
        if self.tiered and self.policy.placement_due():
            try:
                self._send_placement.send_nowait(self.policy.placement())
            except trio.WouldBlock:
                pass  # the scheduler has not drained the last ones; a newer one follows

    async def _save(self, force: bool = False) -> Path | None:
        if self.heat_file is None or not (self._dirty or force):
            return None
        heat, target = self.policy.heat.copy(), self.heat_file
        try:
            await trio.to_thread.run_sync(save_heat, target.path, target.fingerprint, heat)
        except OSError as exc:
            log.warning("could not write the expert heat file %s: %s", target.path, exc)
            return None
        self._saved_at, self._dirty = time.monotonic(), False
        return target.path
