"""RestartingEngine: the engine API over a mux engine child that is started again
whenever it exits on its own (a crash, an OOM kill).

Requests in flight when the child dies fail as the MuxEngine fails them (EngineExited:
a 503, or an error frame in a stream); until the new child is READY, new requests get a
503 (EngineUnavailable) and /health says the engine is restarting. A failure to start
the first child is the caller's error (the command exits); a later one (its model file
gone, say) is logged, kept as `start_error` for /health and the 503s to say, and tried
again.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import asynccontextmanager

import trio

from ..runtime.api import EngineStatistics, ExpertState, Health
from ..runtime.collect import Collected
from ..runtime.errors import EngineClosed, EngineUnavailable
from .supervisor import OpenEngine, Supervisor

RESTART_EVERY_S = 1.0  # at most one start a second, so a crash loop idles


class RestartingEngine(Collected):
    def __init__(self, open_engine: OpenEngine, *, kv_slots: int):
        """`open_engine()` returns a new MuxEngine (an async context manager)."""
        self.kv_slots = kv_slots
        self.name = ""  # the model's, once a child has started
        self._experts = ExpertState(0, 0, b"", b"", 0, ())  # the last child's, between two
        self._child = Supervisor("mux", open_engine, RESTART_EVERY_S, on_up=self._up, on_down=self._down)

    def _up(self, engine) -> None:
        self.name = engine.name

    def _down(self, engine) -> None:
        self._experts = engine.expert_state()

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED):
        """Keep a child running until close(); started once the first child is READY."""
        await self._child.run(task_status=task_status)

    def close(self) -> None:
        """Stop restarting: the running child drains and exits, then run() returns."""
        self._child.stop()

    @property
    def restarts(self) -> int:
        return self._child.restarts

    @property
    def start_error(self) -> str | None:
        """Why the last start failed; None once one works."""
        return self._child.start_error

    @property
    def current(self):
        """The running MuxEngine; None between two children."""
        return self._child.engine

    def _current(self):
        if self._child.engine is None:
            raise EngineClosed() if self._child.stopping.is_set() else EngineUnavailable(self.start_error)
        return self._child.engine

    # ---- the engine API, forwarded ----------------------------------------------------

    @asynccontextmanager
    async def stream(self, prompt, **kwargs):
        async with self._current().stream(prompt, **kwargs) as events:
            yield events

    def render_chat(self, messages: list[dict], **template_kwargs) -> str:
        return self._current().render_chat(messages, **template_kwargs)

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        return self._current().tokenize(text, add_special)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._current().detokenize(ids)

    async def cancel(self, request_id: int) -> None:
        await self._current().cancel(request_id)

    async def stop(self, request_id: int) -> None:
        await self._current().stop(request_id)

    async def save_slot(self, slot: int, path):
        return await self._current().save_slot(slot, path)

    async def restore_slot(self, slot: int, path):
        return await self._current().restore_slot(slot, path)

    async def erase_slot(self, slot: int) -> int:
        return await self._current().erase_slot(slot)

    def statistics(self) -> EngineStatistics:
        if self.current is None:  # between two children: nothing runs, nothing is taken
            return EngineStatistics(0, 0, self.kv_slots, True)
        return self.current.statistics()

    def expert_state(self) -> ExpertState:
        return self._experts if self.current is None else self.current.expert_state()

    def startup(self):
        """How the running child came up (None between two children)."""
        return None if self.current is None else self.current.startup()

    def health(self) -> Health:
        return Health.of(self.statistics().closing, self.startup(), start_error=self.start_error)
