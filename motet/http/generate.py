"""One completion request through the engine: the answer as a JSON object or as a stream
of server-sent events, for the chat and the legacy completions APIs alike.

A request is submitted before the response starts, so a refusal (full queue, busy slot,
prompt too long) is an HTTP status, not an event in a 200 stream. From then on leaving
the engine's stream block cancels the request: when the client disconnects, quart-trio
cancels the handler (non-streaming) or the body's iteration (streaming), and the
cancellation leaves the block, which tells the engine within one of its steps.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field, replace

import trio

from ..runtime.api import FinishEvent, TokenEvent, TurnReport
from ..runtime.engine_api import EngineAPI, Events
from ..runtime.errors import Cancelled, EngineError
from . import anthropic_schema as messages_shape
from . import openai_responses as shape
from . import reasoning, tool_calls
from .errors import ApiError, from_engine
from .openai_schema import Options
from .reasoning import ReasoningSplitter
from .tool_calls import ToolCall, ToolCallStream

Event = TokenEvent | FinishEvent


@dataclass
class Turn:
    """A request as its answer names it, and what it has produced so far."""

    chat: bool
    model: str
    options: Options
    started: float  # trio.current_time() when the request came in
    ident: str = ""
    created: int = 0
    texts: list[str] = field(default_factory=list)
    logprobs: list[TokenEvent] = field(default_factory=list)  # when asked
    last_token_at: float | None = None
    # a chat answer's reasoning apart from its content; opened: the prompt opened the block
    reasoning: ReasoningSplitter | None = None
    reasoning_opened: bool = False
    tools: ToolCallStream | None = None  # a chat answer's tool calls, read in their family's format
    call_ids: list[str] = field(default_factory=list)  # of the calls streamed so far
    index: int = 0  # which of the request's n choices

    def __post_init__(self):
        self.ident = ("chatcmpl-" if self.chat else "cmpl-") + secrets.token_hex(12)
        self.created = int(time.time())

    def choices(self) -> list[Turn]:
        """The turn of each of the request's n choices: this one, then fresh ones (their
        own text, reasoning and tool calls) under the same id."""
        turns = [self]
        for index in range(1, self.options.n):
            other = Turn(self.chat, self.model, self.options, self.started, index=index,
                         reasoning=None if self.reasoning is None else ReasoningSplitter(self.reasoning_opened),
                         reasoning_opened=self.reasoning_opened,
                         tools=None if self.tools is None else ToolCallStream(self.tools.family))
            other.ident, other.created = self.ident, self.created
            turns.append(other)
        return turns

    @property
    def prompt_param(self) -> str:
        return "messages" if self.chat else "prompt"

    @property
    def k(self) -> int:
        return self.options.top_logprobs

    def topk(self) -> list[list[dict]]:
        return [shape.top_candidates(e, self.k) for e in self.logprobs] if self.options.logprobs else []


def engine_kwargs(options: Options, default_max_tokens: int) -> dict:
    return dict(
        max_tokens=options.max_tokens or default_max_tokens, temperature=options.temperature,
        top_p=options.top_p, top_k=options.top_k, min_p=options.min_p, presence_penalty=options.presence_penalty,
        frequency_penalty=options.frequency_penalty, repetition_penalty=options.repetition_penalty,
        logit_bias=dict(options.logit_bias), stop_token_ids=options.stop_token_ids, grammar=options.grammar,
        seed=options.seed,
        slot=options.cache_slot, stop=options.stop,
        # a token's own logprob and text come with its candidates (a mux engine has no other)
        top_logprobs=max(1, options.top_logprobs) if options.logprobs else 0,
    )


class Generation:
    """Runs turns on the engine for one app; counts them in its metrics."""

    def __init__(self, engine: EngineAPI, metrics, decode_rate, default_max_tokens: int, retry_after_s: int):
        self.engine = engine
        self.metrics = metrics
        self.decode_rate = decode_rate
        self.default_max_tokens = default_max_tokens
        self.retry_after_s = retry_after_s
        self.last_report: TurnReport | None = None  # the last finished turn's (for /experts)

    # ---- bookkeeping ----------------------------------------------------------------

    def _token(self, turn: Turn, event: TokenEvent) -> None:
        now = trio.current_time()
        if turn.last_token_at is None:
            self.metrics.ttft.observe(now - turn.started)
        else:
            self.metrics.itl.observe(now - turn.last_token_at)
        turn.last_token_at = now
        self.decode_rate.add(now)
        turn.texts.append(event.text)
        if turn.options.logprobs:
            turn.logprobs.append(event)

    def _finish(self, event: FinishEvent) -> None:
        self.metrics.observe_turn(event.stats)
        if event.report is not None:
            self.last_report = event.report

    def _kwargs(self, turn: Turn) -> dict:
        kwargs = engine_kwargs(turn.options, self.default_max_tokens)
        if turn.reasoning_opened and turn.options.grammar is not None:  # the grammar is the answer's
            kwargs["grammar"] = replace(turn.options.grammar, after=reasoning.END)
        return kwargs

    def _error(self, turn: Turn, exc: EngineError):
        return from_engine(exc, turn.prompt_param, self.retry_after_s)

    # ---- non-streaming --------------------------------------------------------------

    async def answer(self, turn: Turn, prompt: str):
        """The whole answer as an OpenAI object (with n choices, all of them), or an ApiError."""
        turns = turn.choices()
        finishes = await self.collect(turns, prompt)
        if isinstance(finishes, ApiError):
            return finishes
        answers = [self._whole(t, finish) for t, finish in zip(turns, finishes)]
        return answers[0] if len(answers) == 1 else shape.choices_of(answers, [f.stats for f in finishes])

    def _whole(self, turn: Turn, finish: FinishEvent) -> dict:
        text, asked = "".join(turn.texts) + finish.text_tail, turn.options.logprobs
        if turn.chat:
            content = [shape.chat_logprob(e, turn.k) for e in turn.logprobs] if asked else None
            thought, text, calls = whole_parts(turn, text)
            entries = [shape.tool_call(call, call_id()) for call in calls]
            return shape.chat_completion(turn.ident, turn.created, turn.model, text, finish, content, turn.topk(),
                                         thought, entries)
        logprobs = shape.completion_logprobs(turn.logprobs, turn.k) if asked else None
        return shape.text_completion(turn.ident, turn.created, turn.model, text, finish, logprobs, turn.topk())

    @asynccontextmanager
    async def _submitted(self, turn: Turn, prompt: str) -> AsyncIterator[AsyncIterator[tuple[int, Event]]]:
        """The turn's request submitted (n > 1: its choices): its events as they come,
        with the index of the choice each is for."""
        if turn.options.n == 1:
            async with self.engine.stream(prompt, **self._kwargs(turn)) as events:
                yield _first_choice(events)
        else:
            async with self.engine.choices(prompt, turn.options.n, **self._kwargs(turn)) as choices:
                yield choices

    async def collect(self, turns: list[Turn], prompt: str) -> list[FinishEvent] | ApiError:
        """Run a request to its end: the FinishEvent of each choice (the texts are in
        its turn's texts), or an ApiError."""
        finishes: list[FinishEvent | None] = [None] * len(turns)
        refusal: EngineError | None = None
        entered = False
        try:
            async with self._submitted(turns[0], prompt) as events:
                entered = True
                async for index, event in events:
                    if isinstance(event, TokenEvent):
                        self._token(turns[index], event)
                    else:
                        finishes[index] = event
        except EngineError as exc:
            refusal = exc
        finally:
            # The client left (or the engine closed) mid-turn, or while the engine took the
            # request (a MuxEngine waits for the child's first frame then). A refusal at
            # entry is an HTTP status, not a finished request.
            if entered or refusal is None:
                for _ in range(finishes.count(None)):
                    self.metrics.requests.labels("cancelled").inc()
        if refusal is not None:
            return self._error(turns[0], refusal)
        done = [finish for finish in finishes if finish is not None]
        assert len(done) == len(turns)  # a stream that ends without raising ends with its FinishEvents
        for finish in done:
            self._finish(finish)
        if any(finish.stats.finish_reason == "cancelled" for finish in done):  # cancelled by someone else
            return self._error(turns[0], Cancelled())
        return done

    # ---- streaming ------------------------------------------------------------------

    async def open_stream(self, turn: Turn, prompt: str, anthropic: bool = False):
        """Submit the request; the SSE body to send (OpenAI's chunks, or Anthropic's
        events), or an ApiError when it is refused."""
        request = AsyncExitStack()  # the stream block, left by the body once the request is over
        try:
            events = await request.enter_async_context(self._submitted(turn, prompt))
        except EngineError as exc:  # refused: an HTTP status, not a finished request
            return self._error(turn, exc)
        except trio.Cancelled:  # the client left while the engine took the request
            self.metrics.requests.labels("cancelled").inc()
            raise
        return (self._anthropic_frames if anthropic else self._frames)(turn, request, events)

    async def _frames(self, turn: Turn, request: AsyncExitStack, events: AsyncIterator[tuple[int, Event]]):
        # The body owns the accepted request from here: however it ends (finished, the
        # client gone, the engine closed), leaving the stream block cancels a request still
        # in flight. A body never started (the client left between the headers and the
        # first byte) runs no finally; then the stream block is closed when it is
        # garbage-collected, by Trio's async-generator finalizer: a cancel all the same.
        # With n choices, each one's chunks carry its index; each ends as it finishes.
        turns = turn.choices()
        finishes: list[FinishEvent | None] = [None] * len(turns)
        try:
            if turn.chat:
                for t in turns:
                    yield shape.sse(self._chunk(t, {"role": "assistant", "content": ""}))
            sent = [0] * len(turns)  # characters sent (completions' logprob text offsets)
            async for index, event in events:
                t = turns[index]
                if isinstance(event, TokenEvent):
                    self._token(t, event)
                    delta = self._delta(t, event.text)
                    if delta or turn.options.logprobs:
                        yield shape.sse(self._chunk(t, delta, (event,), sent[index]))
                        sent[index] += len(event.text)
                    continue
                finishes[index] = finish = event
                self._finish(finish)
                if finish.stats.finish_reason == "cancelled":
                    yield shape.sse(self._error(turn, Cancelled()).body())
                    return
                tail = self._delta(t, finish.text_tail, end=True)
                if tail:
                    yield shape.sse(self._chunk(t, tail))
                yield shape.sse(self._chunk(t, "", finish=shape.finish_reason(finish.stats, bool(t.call_ids))))
            done = [finish for finish in finishes if finish is not None]
            assert len(done) == len(turns)  # a stream that ends without raising ends with its FinishEvents
            obj = "chat.completion.chunk" if turn.chat else "text_completion"
            if turn.options.include_usage:
                stats = [finish.stats for finish in done]
                yield shape.sse(shape.usage_chunk(turn.ident, obj, turn.created, turn.model, stats))
            yield shape.sse(shape.colibri_chunk(turn.ident, obj, turn.created, turn.model,
                                                shape.colibri(done[0], turn.topk())))
            yield shape.SSE_DONE
        except EngineError as exc:  # the engine closed under the stream: say so, in-band
            yield shape.sse(self._error(turn, exc).body())
        finally:
            for _ in range(finishes.count(None)):  # the client left (or the engine closed) mid-turn
                self.metrics.requests.labels("cancelled").inc()
            await request.aclose()

    async def _anthropic_frames(self, turn: Turn, request: AsyncExitStack,
                                events: AsyncIterator[tuple[int, Event]]):
        """As _frames, in Anthropic's events: message_start, each content block's start,
        deltas and stop (thinking, text, tool_use), message_delta with the stop reason
        and usage, message_stop."""
        finish: FinishEvent | None = None
        ident = messages_shape.message_id()
        blocks = messages_shape.Blocks()
        try:
            yield messages_shape.start_events(ident, turn.model, 0)
            async for _, event in events:  # Anthropic's Messages have one choice
                if isinstance(event, TokenEvent):
                    self._token(turn, event)
                    if frames := blocks.part(*self._parts(turn, event.text)):
                        yield frames
                else:
                    finish = event
            assert finish is not None  # a stream that ends without raising ends with its FinishEvent
            self._finish(finish)
            if finish.stats.finish_reason == "cancelled":
                yield messages_shape.event("error", messages_shape.error_body(self._error(turn, Cancelled())))
                return
            yield blocks.part(*self._parts(turn, finish.text_tail, end=True)) + blocks.end(finish)
        except EngineError as exc:  # the engine closed under the stream: say so, in-band
            yield messages_shape.event("error", messages_shape.error_body(self._error(turn, exc)))
        finally:
            if finish is None:
                self.metrics.requests.labels("cancelled").inc()
            await request.aclose()

    @staticmethod
    def _delta(turn: Turn, text: str, end: bool = False) -> str | dict:
        """A chat stream's delta for `text`: its reasoning, its content and its tool
        calls apart (end: and what the splitters held back); completions' text as it is."""
        if turn.reasoning is None:
            return text
        thought, content, calls = Generation._parts(turn, text, end)
        entries = []
        for call in calls:
            turn.call_ids.append(call_id())
            entries.append(shape.tool_call(call, turn.call_ids[-1], len(turn.call_ids) - 1))
        return ({"reasoning_content": thought, "reasoning": thought} if thought else {}) | (
            {"content": content} if content else {}) | ({"tool_calls": entries} if entries else {})

    @staticmethod
    def _parts(turn: Turn, text: str, end: bool = False) -> tuple[str, str, list[ToolCall]]:
        """A chat answer's next text as (reasoning, content, tool calls) ready to send."""
        thought, content = turn.reasoning.push(text) if turn.reasoning else ("", text)
        if end and turn.reasoning:
            more_thought, more_content = turn.reasoning.flush()
            thought, content = thought + more_thought, content + more_content
        calls: list[ToolCall] = []
        if turn.tools is not None:
            content, calls = turn.tools.push(content)
            if end:
                more_content, more_calls = turn.tools.flush()
                content, calls = content + more_content, calls + more_calls
        return thought, content, calls

    def _chunk(self, turn: Turn, content: str | dict, events: tuple[TokenEvent, ...] = (),
               sent: int = 0, finish: str | None = None) -> dict:
        """One stream chunk: a delta (chat) or a text (completions), the logprobs of
        `events` when asked, a finish reason on the last one."""
        usage = turn.options.include_usage
        logprobs = bool(events) and turn.options.logprobs
        if turn.chat:
            delta = content if isinstance(content, dict) else ({"content": content} if finish is None else {})
            entries = [shape.chat_logprob(e, turn.k) for e in events] if logprobs else None
            return shape.chat_chunk(turn.ident, turn.created, turn.model, delta, finish=finish,
                                    logprobs=entries, with_usage=usage, index=turn.index)
        assert isinstance(content, str)  # a dict delta is chat's alone
        lp = shape.completion_logprobs(list(events), turn.k, sent) if logprobs else None
        return shape.completion_chunk(turn.ident, turn.created, turn.model, content, finish=finish,
                                      logprobs=lp, with_usage=usage, index=turn.index)


def call_id() -> str:
    return "call_" + secrets.token_hex(12)


def whole_parts(turn: Turn, text: str) -> tuple[str, str, list[ToolCall]]:
    """A whole chat answer as (reasoning, content, tool calls)."""
    thought, text = reasoning.split(text, turn.reasoning_opened) if turn.reasoning else ("", text)
    if turn.tools is None:
        return thought, text, []
    text, calls = tool_calls.parse(turn.tools.family, text)
    return thought, text, calls


async def _first_choice(events: Events) -> AsyncIterator[tuple[int, Event]]:
    """One request's events as choice 0's."""
    async for event in events:
        yield 0, event
