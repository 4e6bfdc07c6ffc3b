"""LegacyBridge: the single-conversation serve protocol (`SERVE=1` without
`SERVE_BATCH`), for interactive front-ends. Plain lines are chat turns the engine renders
with the model's template; `\\x02PROMPT` carries a rendered prompt; answers are raw text
ended by the END sentinel and a STAT line. One answer at a time, in order."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import trio

from ..protocol import legacy, mux
from ..runtime.api import FinishEvent, TokenEvent
from ..runtime.engine_api import EngineAPI
from ..runtime.errors import ContextExceeded, EngineError
from .bridge import Intake, rss_gb

log = logging.getLogger(__name__)
READ_SIZE = 65536


@dataclass(frozen=True)
class LegacySettings:
    ngen: int = 256  # tokens per answer to a chat line (NGEN); \x02MORE continues
    temperature: float = 0.0
    top_p: float = 1.0


class LegacyBridge:
    def __init__(self, engine: EngineAPI, settings: LegacySettings, receive, send):
        self.engine = engine
        self.settings = settings
        self.input = receive
        self.output = send
        self.intake = Intake()
        self.messages: list[dict] = []  # the conversation, as chat messages
        self.cut_short = False  # the last answer stopped at NGEN: \x02MORE may continue it

    async def run(self) -> None:
        await self.output.send_all(
            mux.encode_ready() + mux.encode_telemetry("STAT", 0, "0.00", "0.0", f"{rss_gb():.2f}")
        )
        async with trio.open_nursery() as work:
            self.intake.work = work
            with self.intake.reading:
                await self._reader(work)

    async def _reader(self, work: trio.Nursery):
        decoder = legacy.LegacyDecoder()
        while not decoder.closed:
            data = await self.input.receive_some(READ_SIZE)
            if not data:
                return  # EOF: the answer in flight finishes
            for event in decoder.feed(data):
                # The answer runs in `work`, so a signal that stops the reading lets it end.
                answered = trio.Event()
                work.start_soon(self._handle, event, answered)
                await answered.wait()

    async def _handle(self, event, answered: trio.Event):
        try:
            match event:
                case legacy.UserLine(text):
                    self.messages.append({"role": "user", "content": text})
                    self.messages.append({"role": "assistant", "content": ""})
                    await self._continue()
                case legacy.More():
                    if self.cut_short:
                        await self._continue()
                    else:  # nothing to continue: an empty answer, as for an empty turn
                        await self.output.send_all(legacy.encode_end(0, 0.0, 100.0, rss_gb(), 0, False))
                case legacy.Reset():
                    self.messages.clear()
                    self.cut_short = False
                case legacy.RawPrompt(payload, max_tokens, temperature, top_p, slot):
                    await self._answer(payload.decode("utf-8", "replace"), max_tokens, temperature, top_p, slot)
                case mux.Malformed(_, reason):
                    log.warning("legacy protocol: %s", reason)
                    await self.output.send_all(legacy.encode_error("BAD_REQUEST"))
                case legacy.BadFrame():
                    await self.output.send_all(legacy.encode_error("BAD_FRAME"))
        finally:
            answered.set()

    async def _continue(self):
        """Answer the last user turn, or carry on the assistant text cut at NGEN."""
        *history, partial = self.messages
        prompt = self.engine.render_chat(history) + partial["content"]
        s = self.settings
        text, finish = await self._answer(prompt, s.ngen, s.temperature, s.top_p, 0)
        partial["content"] += text
        self.cut_short = finish is not None and finish.stats.finish_reason == "length"

    async def _answer(self, prompt: str, max_tokens: int, temperature: float, top_p: float,
                      slot: int) -> tuple[str, FinishEvent | None]:
        """Stream one answer as raw text, then END and STAT; an error replaces the text."""
        parts: list[str] = []
        try:
            async with self.engine.stream(prompt, max_tokens=max(1, max_tokens), temperature=temperature,
                                          top_p=top_p, slot=slot) as events:
                async for event in events:
                    text = event.text if isinstance(event, TokenEvent) else event.text_tail
                    if text:
                        parts.append(text)
                        await self.output.send_all(text.encode())
        except EngineError as exc:
            extra = (exc.used, exc.limit) if isinstance(exc, ContextExceeded) else ()
            await self.output.send_all(legacy.encode_error(exc.code, *extra))
            return "", None
        finish = events.finish
        # The stream ends only after its FinishEvent, and a turn the engine ends itself
        # carries its report (only a cancel from elsewhere leaves it out: none here).
        assert finish is not None and finish.report is not None
        stats, report = finish.stats, finish.report
        await self.output.send_all(
            legacy.encode_end(stats.emitted_tokens, stats.decode_tokens_per_s, report.hit_pct, rss_gb(),
                                stats.prompt_tokens, stats.finish_reason == "length")
        )
        return "".join(parts), finish
