"""`async with` for the engines: a service started in a nursery of its own.

`start(nursery)` brings it up; leaving the block normally calls `_close()` (requests in
flight finish first); leaving on an error, or a cancel during `_close()`, cancels what
runs. Either way the nursery is exited, and an exception comes out as itself rather than
wrapped in a group."""

from __future__ import annotations

import trio


class Service:
    _nursery: trio.Nursery | None = None

    async def start(self, nursery: trio.Nursery) -> None:
        raise NotImplementedError

    async def _close(self) -> None:
        """The graceful end, when the block ends normally."""

    def _closed_now(self) -> None:
        """Called once the nursery is gone, however the block ended."""

    async def __aenter__(self):
        self._nursery_cm = trio.open_nursery()
        nursery = await self._nursery_cm.__aenter__()
        try:
            await self.start(nursery)
        except BaseException as exc:
            nursery.cancel_scope.cancel()
            try:
                await self._nursery_cm.__aexit__(type(exc), exc, exc.__traceback__)
            except BaseExceptionGroup as group:
                if group.exceptions != (exc,):
                    raise
            raise  # the start error itself (a model that cannot load), not a group
        return self

    async def __aexit__(self, exc_type, exc, tb):
        closing_error = None
        if exc is None:
            try:
                await self._close()
            except BaseException as err:  # noqa: BLE001 - cancelled while draining, say: cancel the rest
                closing_error = exc = err
                exc_type, tb = type(err), err.__traceback__
        try:
            self._nursery.cancel_scope.cancel()
            suppressed = await self._nursery_cm.__aexit__(exc_type, exc, tb)
        except BaseExceptionGroup as group:
            if exc is None or group.exceptions != (exc,):
                raise
            suppressed = False  # the block's own exception, unwrapped from the group
        finally:
            self._closed_now()
        if closing_error is not None and not suppressed:
            raise closing_error
        return suppressed
