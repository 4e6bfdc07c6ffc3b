"""A request the scheduler is working on (Active): its slot, its place in the prompt,
what it has emitted, its sampling key and its turn's figures."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import trio

from ..model.detokenizer import IncrementalDetokenizer
from ..runtime.api import FinishEvent, FinishReason, GenerationRequest, Telemetry, TurnStats
from ..runtime.experts import REPIN_KEPT, device_moves
from .policy import StopMatcher
from .runner import ExpertStep
from .scheduler_messages import Submit
from .step_rows import SamplingRow

log = logging.getLogger("motet.actors.scheduler")


@dataclass
class Active:
    """A request the scheduler is working on."""

    submit: Submit
    slot: int
    reused: int
    detok: IncrementalDetokenizer
    stops: StopMatcher
    key: np.ndarray
    started: float
    expert_counts: np.ndarray  # per MoE layer, per expert: the tokens routed to it (and `routed`'s)
    cursor: int = 0  # prompt tokens whose KV is written
    target: int = 0  # prompt tokens to write: all, or all but the last (prefill_only)
    next_token: int | None = None  # sampled, not yet fed back
    position: int = 0  # where next_token goes
    emitted: int = 0
    first_token_at: float | None = None
    prefill_s: float = 0.0
    decode_s: float = 0.0
    sample_s: float = 0.0
    token_ids: list[int] = field(default_factory=list)
    pool_lookups: int = 0  # tiered experts: unique experts its steps needed
    pool_hits: int = 0  # of those, on the device already
    repin: list[tuple[int, int, int, int]] = field(default_factory=list)  # moves onto the device
    expert_wait_s: float = 0.0  # its steps' seconds moving experts
    expert_disk_s: float = 0.0  # of those, reading the model file
    copied: int = 0  # of the reused prompt tokens, those copied from another slot
    before_grammar: str | None = ""  # the answer's last characters until Grammar.after shows (then None)
    routed: list[np.ndarray] = field(default_factory=list)  # expert ids not yet in expert_counts
    # tokens the decode steps wrote, told to its slot at the turn's end: a message a token
    # took a quarter of the Trio thread's time at 16 streams
    decoded: list[int] = field(default_factory=list)

    @property
    def request(self) -> GenerationRequest:
        return self.submit.request

    @property
    def rid(self) -> int:
        return self.submit.request_id

    def count_experts(self, experts: np.ndarray) -> None:
        """Routed expert ids ([MoE layers, ...]), counted when the turn's telemetry is
        read: counted as they came (numpy's cost a call, twice a token with the
        publisher's) they took a quarter of the Trio thread's time."""
        self.routed.append(experts)

    def count_step(self, step: ExpertStep, decode_s: float = 0.0, sample_s: float = 0.0) -> None:
        """A device call's expert traffic, and the seconds a decode call took (its sampling apart)."""
        self.decode_s += decode_s
        self.sample_s += sample_s
        self.pool_lookups += step.lookups
        self.pool_hits += step.hits
        self.expert_wait_s += step.wait_s
        self.expert_disk_s += step.disk_s
        self.repin.extend(device_moves(step.moves))
        del self.repin[:-REPIN_KEPT]

    def turn_stats(self, reason: FinishReason, now: float) -> TurnStats:
        first = self.first_token_at or now
        decode_s = now - first
        return TurnStats(
            request_id=self.rid, slot=self.slot, finish_reason=reason,
            prompt_tokens=len(self.submit.prompt), reused_tokens=self.reused,
            emitted_tokens=self.emitted, time_to_first_token_s=first - self.started,
            decode_tokens_per_s=(self.emitted - 1) / decode_s if self.emitted > 1 and decode_s > 0 else 0.0,
            total_s=now - self.started, copied_tokens=self.copied,
        )

    def telemetry(self) -> Telemetry:
        add_routing(self.expert_counts, self.routed)
        self.routed.clear()
        counts = tuple(tuple(int(c) for c in layer) for layer in self.expert_counts)
        return Telemetry(self.rid, self.prefill_s, self.decode_s, self.sample_s, counts,
                         self.expert_wait_s, self.expert_disk_s)

    def sampling_row(self, masked: bool = True) -> SamplingRow:
        """The row the request samples its next token with; masked=False: without its
        grammar's bitmask (for a step whose sampling waits for it: runner.finish)."""
        r = self.request
        constraint = self.submit.constraint
        return SamplingRow(r.temperature, r.top_p, r.top_k, r.min_p, self.key, r.top_logprobs > 0,
                           r.presence_penalty, r.frequency_penalty, r.repetition_penalty, r.uses_history,
                           constraint.allowed() if masked and constraint is not None and self.grammar_on else None)

    @property
    def grammar_on(self) -> bool:
        """Whether the grammar applies to the next token: it has one and no Grammar.after,
        or the answer has written that text (a reasoning block's end) already."""
        grammar = self.request.grammar
        return grammar is not None and (not grammar.after or self.before_grammar is None)

    def watch(self, text: str) -> str:
        """The answer's text as it is emitted, watched for the grammar's `after` (returned
        as it is)."""
        grammar = self.request.grammar
        if grammar is not None and grammar.after and self.before_grammar is not None:
            seen = self.before_grammar + text
            self.before_grammar = None if grammar.after in seen else seen[-len(grammar.after):]
        return text

    def grammar_refuses(self, token: int) -> bool:
        """Whether the request's grammar, if it has one, ends it at this token: it had left
        no token to sample, or refuses this one (logged, with its reason)."""
        constraint = self.submit.constraint
        if constraint is None or not self.grammar_on or constraint.accept(token):
            return False
        log.warning("request %d: its grammar ends it: %s", self.rid, constraint.failure)
        return True

    def tail(self, reason: FinishReason, stop_matched: bool) -> str:
        """What was held back, released at the end: partial UTF-8, and a stop-string
        prefix that never completed (unless the rest of the text completes it)."""
        if reason == "cancelled" or stop_matched:
            return ""
        tail, matched = self.stops.push(self.detok.flush())
        return tail if matched else tail + self.stops.flush()

    def history_start(self) -> tuple[tuple[int, ...], tuple[tuple[int, float], ...]] | None:
        """What the runner resets the slot's LogitHistory with as the answer begins (the
        whole prompt, the bias), None when the request reads no history."""
        r = self.request
        return (tuple(self.submit.prompt), r.logit_bias) if r.uses_history else None


def add_routing(counts: np.ndarray, parts: list[np.ndarray]) -> None:
    """Add routed-expert ids (parts of [MoE layers, ...] each) to per-layer, per-expert
    counts, in one count over all of them."""
    layers, width = counts.shape
    ids = [part.reshape(layers, -1) for part in parts if part.size]
    if ids:
        flat = (np.arange(layers)[:, None] * width + np.concatenate(ids, axis=1)).reshape(-1)
        counts += np.bincount(flat, minlength=layers * width).reshape(layers, width)


def end_unstarted(sub: Submit, reason: FinishReason) -> None:
    """End a request that never started (withdrawn from the queue, or a fork whose
    first choice ended before its prompt was read)."""
    tell(sub, FinishEvent(TurnStats(sub.request_id, -1, reason, len(sub.prompt), 0, 0, 0.0, 0.0, 0.0)))
    sub.events.close()


def tell(sub: Submit, event) -> bool:
    """Put an event on a request's stream; False when its reader is gone (a cancel)."""
    try:
        sub.events.send_nowait(event)
        return True
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        return False
