"""MuxStream: one request's events from a mux engine, as Engine's EventStream yields
them, and the mapping of the wire's ERROR codes to the Engine's typed errors.
MuxEngine's reader task routes frames here; iterating turns them into events. Also what
the wire allows of a prompt and a request id, and a slot command awaiting its answer."""

from __future__ import annotations

import codecs
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import trio

from ..actors.policy import StopMatcher
from ..model.errors import ModelError
from ..protocol import mux
from ..protocol.session_file import SessionError
from ..runtime.actor import open_stream
from ..runtime.api import (
    FinishEvent,
    FinishReason,
    GenerationRequest,
    Perf,
    TokenEvent,
    TopCandidate,
    TurnReport,
    TurnStats,
)
from ..runtime.errors import BadRequest, ContextExceeded, DuplicateId, EmptyPrompt, EngineClosed, EngineError, SlotBusy

if TYPE_CHECKING:
    from .mux_engine import MuxEngine


class EngineStartError(ModelError):
    """The mux engine did not start: it wrote LOAD_FAIL, or exited before READY."""

    def __init__(self, message: str, status: int, kind: str | None = None):
        super().__init__(message)
        self.status, self.kind = status, kind


class EngineExited(EngineClosed):
    """The child's output ended (it exited, or died) while requests were open."""

    code = "ENGINE_EXITED"

    def __init__(self, status: int | None):
        Exception.__init__(self, f"the mux engine exited with status {status}")
        self.status = status


ERRORS = {  # ERROR <id> <CODE> [args] → the Engine's typed error
    "SLOT_BUSY": lambda e, slot: SlotBusy(slot),
    "DUPLICATE_ID": lambda e, slot: DuplicateId(e.request_id),
    "EMPTY_PROMPT": lambda e, slot: EmptyPrompt(),
    "CONTEXT_EXCEEDED": lambda e, slot: ContextExceeded(int(e.args[0]), int(e.args[1])),
}


def check_wire_prompt(prompt) -> None:
    """What the mux wire cannot carry as a prompt, refused: nothing, token ids (the wire
    is text), a lone surrogate (no UTF-8 spelling), a NUL."""
    if not prompt:
        raise EmptyPrompt()
    if not isinstance(prompt, str):
        raise BadRequest("a mux engine takes text prompts, not token ids")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError:
        raise BadRequest("the prompt holds a lone surrogate, which has no UTF-8 spelling") from None
    if "\x00" in prompt:
        raise BadRequest("the prompt holds a NUL character, which the mux protocol does not carry")


def wire_request_id(request_id: int | None, in_flight, ids: Iterator[int]) -> int:
    """The caller's id, checked against those in flight and the wire's u64; or the next
    of `ids` not in flight."""
    if request_id is None:
        return next(i for i in ids if i not in in_flight)
    if request_id in in_flight:
        raise DuplicateId(request_id)
    if request_id >= 1 << 64:
        raise BadRequest(f"request ids are u64, got {request_id}")
    return request_id


def engine_error(error: mux.Error, slot: int | None) -> EngineError:
    try:
        return ERRORS[error.code](error, slot)
    except (KeyError, IndexError, ValueError):  # BAD_REQUEST, BAD_FRAME, codes to come
        return BadRequest(f"request {error.request_id}: {' '.join((error.code, *error.args))}")


@dataclass
class SlotCommand:
    """A SAVE, RESTORE or ERASE sent to the child: its slot is not chosen for requests
    until the answer comes (even when its caller has left)."""

    slot: int
    answered: trio.Event = field(default_factory=trio.Event)
    answer: object = None  # the child's reply event, or an EngineClosed when it is gone

    def result(self):
        """The child's answer; its refusal raised as Engine's."""
        match self.answer:
            case mux.SessionRefused(reason=reason):
                raise SessionError(reason)
            case mux.Error() as error:
                raise engine_error(error, self.slot)
            case EngineError() as error:
                raise error
        return self.answer


class MuxStream:
    """A request's events, as Engine's EventStream yields them. The reader task routes
    the request's frames here and notes what the wire says of it (slot, TURN, PERF...);
    iterating turns the frames into TokenEvents and a FinishEvent."""

    def __init__(self, engine: MuxEngine, rid: int, prompt: str, request: GenerationRequest):
        self.request_id, self.prompt, self.request = rid, prompt, request
        self.finish: FinishEvent | None = None
        self.send, self._receive = open_stream()  # frames, or an EngineClosed at the end
        self.slot: int | None = None  # None while it waits here for a slot
        self.sent_at = self.ended_at = 0.0
        self.first_at: float | None = None
        self.answer = bytearray()  # all its text, for the slot's history
        self.turn: mux.Turn | None = None
        self.perf: Perf | None = None
        # the ENTROPY and GPUS lines of its turn
        self.entropy_gpus: tuple[tuple[float, ...], tuple[tuple[float, float, int], ...]] = ((), ())
        self.repin: list[tuple[int, int, int, int]] = []
        self.ended = trio.Event()  # its last frame has come
        self.cancelled = False  # its caller left it: CANCEL sent, the slot busy until CANCELLED
        self._engine = engine
        self._ready: deque[TokenEvent | FinishEvent] = deque()
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self._stops = StopMatcher(request.stop)
        self._held: str | None = None  # a DATA's text waiting for its TOPK
        self._stopped = False  # a stop string matched: later frames are dropped
        self._emitted = 0

    def __aiter__(self):
        return self

    async def __anext__(self) -> TokenEvent | FinishEvent:
        if self.finish is not None:
            raise StopAsyncIteration
        await self._fill()
        event = self._ready.popleft()
        if isinstance(event, FinishEvent):
            self.finish = event
        return event

    async def _fill(self) -> None:
        """Read frames until an event is ready; a refusal or a dead child raises here."""
        while not self._ready:
            try:
                frame = await self._receive.receive()
            except (trio.EndOfChannel, trio.ClosedResourceError):
                raise self._engine._closed_error() from None
            if isinstance(frame, EngineError):
                raise frame
            if self._take(frame):  # a stop string matched: the child ends it through DONE
                self._engine._send(mux.encode_stop(self.request_id), quiet=True)

    def _take(self, frame) -> bool:
        """Turn one frame into events; True when a stop string has just matched."""
        topk = self._engine.topk
        match frame:
            case mux.Data() | mux.TopK() if self._stopped:
                pass
            case mux.Data(_, data) if topk:
                # A token ends with its TOPK; a DATA that got none is a token at the next one.
                stopped = self._held is not None and self._token(self._held)
                self._held = None if stopped else self._utf8.decode(data)
                return stopped
            case mux.Data(_, data):
                return self._token(self._utf8.decode(data))
            case mux.TopK(_, candidates) if topk:
                text, self._held = self._held or "", None
                return self._token(text, candidates)
            case mux.Done() | mux.Error(code="CANCELLED"):
                self._ready.append(self._finish(frame))
            case mux.Prefilled(_, slot, tokens, reused, ms):  # [extension] a prefill-only request
                stats = TurnStats(self.request_id, slot, "prefilled", tokens + 1, reused, 0, 0.0, 0.0, ms / 1000)
                self._ready.append(FinishEvent(stats))
            case mux.Error():
                raise engine_error(frame, self.slot)
        return False

    def _token(self, text: str, candidates=()) -> bool:
        n, logprob = self.request.top_logprobs, None
        top: tuple[TopCandidate, ...] = ()
        if n and candidates:
            cands = [TopCandidate(None, raw.decode("utf-8", "replace"), lp) for lp, raw in candidates]
            top = tuple(cands[:n])
            logprob = next((c.logprob for c in cands if c.text == text), None)
        out, self._stopped = self._stops.push(text)
        self._emitted += 1
        self._ready.append(TokenEvent(self.request_id, out, None, logprob, top))
        return self._stopped

    def _finish(self, frame: mux.Done | mux.Error) -> FinishEvent:
        done, tail, turn = frame if isinstance(frame, mux.Done) else None, "", self.turn
        if done and not self._stopped:
            # What came after the last token (a partial character, text the child held
            # back) is the tail, as the in-process Engine releases it.
            tail, matched = self._stops.push(self._utf8.decode(b"", final=True) + (self._held or ""))
            tail += "" if matched else self._stops.flush()
        reason: FinishReason = ("stop" if self._stopped else "cancelled" if done is None
                                else "length" if done.length_limited else "stop")
        start = self.sent_at or self.ended_at  # one cancelled while it waited was never sent
        stats = TurnStats(
            self.request_id, turn.slot if turn else -1 if self.slot is None else self.slot, reason,
            done.prompt_tokens if done else 0, turn.reused_tokens if turn else 0,
            # After a stop string the child ran on until STOP reached it: count what we kept.
            done.emitted if done and not self._stopped else self._emitted,
            turn.ttft_s if turn else (self.first_at or self.ended_at) - start,
            done.tokens_per_s if done else 0.0, self.ended_at - start,
        )
        if done is None:
            return FinishEvent(stats)
        # the REPIN entries as the child wrote them (four fields on a well-formed line),
        # passed on unchecked: mux_report reads them as tuples of any length
        report = TurnReport(self.perf or Perf(dt=stats.total_s), *self.entropy_gpus, tuple(self.repin))
        return FinishEvent(stats, tail, None, report, self._stops.matched)
