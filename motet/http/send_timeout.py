"""A bound on each write of a response: a client that stops reading loses its request.

    SendTimeout(app, timeout_s)   an ASGI app: `app` with every HTTP `send` bounded

A client that keeps its connection open but stops reading fills the TCP buffers; the
server's next write then waits for room that never comes, and the request behind it
keeps its KV slot. A plain `move_on_after` around the `send` cannot end that wait:
Hypercorn's Trio worker writes the bytes in a shielded cancel scope (a write is never
left half done), so only closing the connection ends it. Hence one watchdog task per
response: each `send` arms it with a deadline and disarms it when the bytes are taken.
Past the deadline the watchdog tells Hypercorn the response is over (`send(None)`, its
own "the app is done" call), which closes the connection; that ends the blocked write,
Hypercorn hands the app an `http.disconnect` (so quart-trio cancels the handler and
closes the body generator, which cancels the engine request and frees its slot), and
the `send` raises `SendTimedOut` so the response fails whichever comes first.

Not covered: a write of the response's *headers* that blocks (the buffers already full
from an earlier response on the same keep-alive connection that the client did not read
either). Hypercorn has not yet recorded that the response started, so its `send(None)`
tries to answer 500 and fails instead of closing; the watchdog then only logs it.
"""

from __future__ import annotations

import logging
import math

import trio

log = logging.getLogger(__name__)


class SendTimedOut(Exception):
    """A write of the response waited past the limit: the client stopped reading."""


class SendTimeout:
    def __init__(self, app, timeout_s: float):
        self.app = app
        self.timeout_s = timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        guard = _Guard(send, self.timeout_s, f"{scope['method']} {scope['path']}")
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(guard.watch)
                try:
                    await self.app(scope, receive, guard.send)
                finally:
                    nursery.cancel_scope.cancel()
        except* SendTimedOut:
            pass  # the watchdog has said so; the connection is closed


class _Guard:
    """The `send` of one response, and its watchdog."""

    def __init__(self, send, timeout_s: float, what: str):
        self._send = send
        self._timeout_s = timeout_s
        self._what = what  # the request, for the log
        self._timer = trio.CancelScope()  # deadline: a write in progress, else +inf
        self.expired = False

    async def send(self, message) -> None:
        if self.expired:
            raise SendTimedOut()
        self._timer.deadline = trio.current_time() + self._timeout_s
        try:
            await self._send(message)
        finally:
            self._timer.deadline = math.inf
        if self.expired:  # the watchdog closed the connection under this write
            raise SendTimedOut()

    async def watch(self) -> None:
        """Sleeps until a write takes too long (cancelled when the response is over),
        then closes the connection."""
        with self._timer:
            await trio.sleep_forever()
        self.expired = True
        with trio.CancelScope(shield=True):  # the close must complete
            try:
                await self._send(None)
            except Exception:  # the headers' write blocked (see the module's note)
                log.warning("%s: the client took no bytes for %g s, while its headers were "
                            "written; the connection stays open", self._what, self._timeout_s,
                            exc_info=True)
                return
        log.info("%s: the client took no bytes for %g s; closed the connection, cancelled "
                 "the request", self._what, self._timeout_s)
