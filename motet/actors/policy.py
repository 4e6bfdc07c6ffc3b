"""Scheduling policy: plain synchronous decisions, no Trio and no JAX, so it is tested
exhaustively on its own. The actors around it only move messages; the runner computes.
Which slot a request gets is runtime/slot_table.py's (every engine shares it)."""

from __future__ import annotations

from collections.abc import Sequence

from ..runtime.errors import BadRequest, ContextExceeded, DuplicateId, EmptyPrompt, EngineClosed, EngineError, SlotBusy


class StopMatcher:
    """Finds stop strings in streamed text without ever releasing part of a match.

    `push(text)` returns (text safe to emit, stopped). Text that could still become the
    start of a stop string is held back until it cannot.
    """

    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(s for s in stops if s)
        self.pending = ""
        self.matched: str | None = None  # the stop string found, once one is

    def push(self, text: str) -> tuple[str, bool]:
        if not self.stops:
            return text, False
        buf = self.pending + text
        # The match that ends first wins (ties: the one that starts first), so the result
        # does not depend on how the text arrived, even when one stop contains another.
        hits = [(i + len(s), i, s) for s, i in ((s, buf.find(s)) for s in self.stops) if i >= 0]
        if hits:
            _, start, self.matched = min(hits)
            self.pending = ""
            return buf[:start], True
        hold = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(buf)), 0, -1):
                if buf.endswith(stop[:k]):
                    hold = max(hold, k)
                    break
        self.pending = buf[len(buf) - hold :] if hold else ""
        return buf[: len(buf) - hold], False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


def refusal(request_id: int, slot: int | None, prompt_tokens: int, *, closing: bool, in_flight: set[int],
            max_context: int, slots: int, busy: bool) -> EngineError | None:
    """Why the scheduler refuses a request at once, or None. busy: its slot (when it names
    one) is taken."""
    if closing:
        return EngineClosed()
    if request_id in in_flight:
        return DuplicateId(request_id)
    if prompt_tokens == 0:
        return EmptyPrompt()
    if prompt_tokens >= max_context:
        return ContextExceeded(prompt_tokens, max_context)
    if slot is not None and not 0 <= slot < slots:
        return BadRequest(f"slot must be in [0, {slots - 1}], got {slot}")
    if slot is not None and busy:
        return SlotBusy(slot)
    return None
