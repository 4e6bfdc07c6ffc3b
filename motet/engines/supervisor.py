"""Supervisor: one engine kept running until stop(). It opens the engine, waits until
its child process exits (or stop), leaves its block (which drains it) and opens it
again, at most one start per `every_s` so that a crash loop idles. RestartingEngine
keeps its mux child with one; SplitEngine keeps each of its two engines with one."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Any

import trio

log = logging.getLogger(__name__)

OpenEngine = Callable[[], AbstractAsyncContextManager]


@dataclass
class Supervisor:
    """`open()` gives a new engine (an async context manager). `must_start`: a first
    start that fails is the caller's error (run() raises it); otherwise it is logged, kept
    in `start_error` and tried again. `on_up(engine)` runs as each engine starts,
    `on_down(engine)` as it goes."""

    name: str
    open: OpenEngine
    every_s: float
    must_start: bool = True
    on_up: Callable[[Any], None] | None = None
    on_down: Callable[[Any], None] | None = None
    engine: Any = None  # the one running now
    starts: int = 0  # successful starts
    restarts: int = 0  # starts tried after an engine stopped (or failed to start)
    start_error: str | None = None  # why the last start failed; None once one works
    stopping: trio.Event = field(default_factory=trio.Event)
    tried: trio.Event = field(default_factory=trio.Event)  # the first start is over
    done: trio.Event = field(default_factory=trio.Event)  # run() has returned
    changed: trio.Event = field(default_factory=trio.Event)  # set (and replaced) as an engine comes or goes

    def changed_now(self) -> None:
        self.changed.set()
        self.changed = trio.Event()

    def alive(self):
        """The engine now, when it serves; else None."""
        engine = self.engine
        return engine if engine is not None and not engine.statistics().closing else None

    def stop(self) -> None:
        """Stop restarting: the running engine drains and ends, then run() returns."""
        self.stopping.set()

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Started once the first start is over (with an engine when `must_start`)."""
        last_start = -math.inf
        try:
            while not self.stopping.is_set():
                with trio.move_on_at(last_start + self.every_s):
                    await self.stopping.wait()
                if self.stopping.is_set():
                    break
                last_start = trio.current_time()
                await self._one_engine(task_status)
                if not self.tried.is_set():
                    self.tried.set()
                    task_status.started()
                if not self.stopping.is_set():
                    self.restarts += 1
                    log.warning("the %s engine has stopped; it starts again within %.0f s (restart %d)", self.name,
                                max(0.0, last_start + self.every_s - trio.current_time()), self.restarts)
        finally:
            self.done.set()

    async def _one_engine(self, task_status) -> None:
        try:
            async with self.open() as engine:
                self.engine, self.start_error = engine, None
                self.starts += 1
                if self.on_up is not None:
                    self.on_up(engine)
                self.changed_now()
                if not self.tried.is_set():
                    self.tried.set()
                    task_status.started()
                else:
                    log.info("the %s engine serves again", self.name)
                await self._until_exit_or_stop(engine)
        except Exception as exc:  # a start that failed, or a close (trio.Cancelled is no Exception)
            if self.must_start and not self.tried.is_set():
                raise
            self.start_error = str(exc)
            log.error("the %s engine failed: %s", self.name, exc)
        finally:
            if self.engine is not None and self.on_down is not None:
                self.on_down(self.engine)
            self.engine = None
            self.changed_now()

    async def _until_exit_or_stop(self, engine) -> None:
        process = getattr(engine, "process", None)  # a MuxEngine's child; an in-process Engine has none
        async with trio.open_nursery() as nursery:
            async def exited():
                await process.wait()
                nursery.cancel_scope.cancel()

            if process is not None:
                nursery.start_soon(exited)
            await self.stopping.wait()
            nursery.cancel_scope.cancel()
