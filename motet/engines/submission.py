"""A request handed to the scheduler, and cancelled if its caller leaves before it ends:
one request (Engine.stream), or the n choices of one prompt (Engine.choices), which
share one event stream and the first one's prefill."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from contextlib import asynccontextmanager

import trio

from ..actors.scheduler import Cancel, Submit
from ..model.model import Model
from ..runtime.actor import open_stream
from ..runtime.api import GenerationRequest
from ..runtime.errors import EngineClosed, EngineError
from . import tokens


def submit_of(model: Model, ids: tuple[int, ...], requests: Sequence[GenerationRequest],
              request_ids: Sequence[int]) -> tuple[Submit, trio.MemoryReceiveChannel]:
    """The Submit of the first request, carrying the others as its forks, and the one
    stream all their events come on. Each compiles its own grammar: a matcher follows
    one answer."""
    tokens.check_ids(model.tokenizer, requests[0], ids)
    send, receive = open_stream()
    with send:
        subs = [Submit(rid, request, ids, send.clone(),
                       None if request.grammar is None else model.grammars.compile(request.grammar))
                for rid, request in zip(request_ids, requests)]
    first, *forks = subs
    return Submit(first.request_id, first.request, ids, first.events, first.constraint, tuple(forks)), receive


@asynccontextmanager
async def submitted(send: Callable[[object], Awaitable[None]], submit: Submit, receive: trio.MemoryReceiveChannel,
                    unfinished: Callable[[], list[int]]):
    """Send `submit` and wait for its answer: a refusal raises here; once accepted, the
    block runs, and leaving it cancels the requests `unfinished` names then."""
    await send(submit)
    refused = False
    with receive:
        try:
            try:
                first = await receive.receive()
            except trio.EndOfChannel:
                raise EngineClosed() from None
            if isinstance(first, EngineError):
                refused = True
                raise first
            yield
        finally:
            if not refused:
                with trio.CancelScope(shield=True):
                    for rid in unfinished():
                        try:
                            await send(Cancel(rid))
                        except EngineClosed:
                            pass
