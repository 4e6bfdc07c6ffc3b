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

import logging
from contextlib import asynccontextmanager

import trio

from ..runtime.api import EngineStatistics, ExpertState, Health
from ..runtime.collect import Collected
from ..runtime.errors import EngineClosed, EngineUnavailable

log = logging.getLogger(__name__)
RESTART_DELAY_S = 1.0  # between a child's death and the next start, so a crash loop idles


class RestartingEngine(Collected):
    def __init__(self, open_engine, *, kv_slots: int):
        """`open_engine()` returns a new MuxEngine (an async context manager)."""
        self._open = open_engine
        self.kv_slots = kv_slots
        self.name = ""  # the model's, once a child has started
        self.restarts = 0
        self.start_error: str | None = None  # why the last start failed; None once one works
        self._engine = None
        self._stopping = trio.Event()
        self._experts = ExpertState(0, 0, b"", b"", 0, ())

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED):
        """Keep a child running until close(); started once the first child is READY."""
        started = False
        while not self._stopping.is_set():
            try:
                async with self._open() as engine:
                    self._engine, self.name, self.start_error = engine, engine.name, None
                    if not started:
                        started = True
                        task_status.started()
                    await self._wait_exit_or_close(engine)
            except Exception as exc:  # a start that failed (Cancelled is no Exception)
                if not started:
                    raise
                self.start_error = str(exc)
                log.error("the mux engine did not start again: %s", exc)
            finally:
                if self._engine is not None:
                    self._experts = self._engine.expert_state()
                self._engine = None
            if not self._stopping.is_set():
                self.restarts += 1
                log.warning("the mux engine exited; starting it again (restart %d)", self.restarts)
                await trio.sleep(RESTART_DELAY_S)

    async def _wait_exit_or_close(self, engine) -> None:
        async with trio.open_nursery() as nursery:
            async def exited():
                await engine.process.wait()
                nursery.cancel_scope.cancel()

            nursery.start_soon(exited)
            await self._stopping.wait()
            nursery.cancel_scope.cancel()
        # leaving the MuxEngine block drains its requests and lets the child exit

    def close(self) -> None:
        """Stop restarting: the running child drains and exits, then run() returns."""
        self._stopping.set()

    @property
    def current(self):
        """The running MuxEngine; None between two children."""
        return self._engine

    def _current(self):
        if self._engine is None:
            raise EngineClosed() if self._stopping.is_set() else EngineUnavailable(self.start_error)
        return self._engine

    # ---- the engine API, forwarded ----------------------------------------------------

    @asynccontextmanager
    async def stream(self, prompt, **kwargs):
        async with self._current().stream(prompt, **kwargs) as events:
            yield events

    def render_chat(self, messages: list[dict]) -> str:
        return self._current().render_chat(messages)

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
        if self._engine is None:  # between two children: nothing runs, nothing is taken
            return EngineStatistics(0, 0, self.kv_slots, True)
        return self._engine.statistics()

    def expert_state(self) -> ExpertState:
        return self._experts if self._engine is None else self._engine.expert_state()

    def startup(self):
        """How the running child came up (None between two children)."""
        return None if self._engine is None else self._engine.startup()

    def health(self) -> Health:
        return Health.of(self.statistics().closing, self.startup(), start_error=self.start_error)
