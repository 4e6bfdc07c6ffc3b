"""A step's rows on the host: what each samples with (SamplingRow), what it drew
(Sampled), a decode step dispatched and not yet read (DecodeInFlight), and the
conversions between them and the device's arrays."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol, TypeVar

import numpy as np

from ..runtime.api import GenerationRequest


class TokenConstraint(Protocol):
    """A request's grammar as the scheduler drives it (model/constraint.py's Constraint)."""

    failure: str | None  # why the grammar left no token, once it has

    def allowed(self) -> np.ndarray:
        """The next token's bitmask, int32 [ceil(vocab / 32)]."""
        ...

    def accept(self, token: int) -> bool:
        """Take the token sampled; False once the grammar has failed."""
        ...


@dataclass(frozen=True)
class SamplingRow:
    """One row of a sampling call: the request's parameters and its current PRNG key."""

    temperature: float
    top_p: float
    top_k: int
    min_p: float
    key: np.ndarray  # uint32[2]
    want_top: bool
    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0
    uses_history: bool = False  # it reads its slot's LogitHistory (a penalty or a bias)
    allowed: np.ndarray | None = None  # a constrained row's bitmask of the tokens it may draw


# What a padding row of a batch samples (greedy; the result is dropped).
FILLER_ROW = SamplingRow(0.0, 1.0, 0, 0.0, np.zeros(2, np.uint32), False)
# What the warm-up's decode rows sample: every branch of the sampler runs, and with the
# second every branch of logit_history's too.
WARM_ROW = SamplingRow(0.7, 0.9, 40, 0.05, np.zeros(2, np.uint32), True)
WARM_PENALIZED_ROW = replace(WARM_ROW, presence=0.5, frequency=0.5, repetition=1.1, uses_history=True)


def warm_constrained_row(vocab: int) -> SamplingRow:
    """WARM_PENALIZED_ROW with a bitmask that allows all but token 0."""
    allowed = np.full((vocab + 31) // 32, -1, np.int32)
    allowed[0] = ~1
    return replace(WARM_PENALIZED_ROW, allowed=allowed)


@dataclass(frozen=True)
class Sampled:
    token: int
    logprob: float
    next_key: np.ndarray
    top: tuple[tuple[int, float], ...]  # (token id, logprob) best first; empty unless asked
    experts: np.ndarray  # the experts that computed the token fed in: [MoE layers, k...]


@dataclass(frozen=True)
class DecodeInFlight:
    """A decode step dispatched and not yet read back: its rows, and its output on the
    device (tiered: its results, sampled already). deferred: a step whose rows are yet
    to be sampled again with their history and masks (ModelRunner.finish): its logits,
    what its rows fed and its padded slots. steps: more than one for a burst (its
    packed output holds a step's in each row)."""

    rows: tuple[SamplingRow, ...]
    packed: object = None
    results: tuple[Sampled, ...] = ()
    deferred: tuple = ()
    steps: int = 1


def sampling_arrays(rows: list[SamplingRow], bucket: int):
    """sample's (temperature, top_p, top_k, min_p, keys) for `rows`, their penalties
    (logit_history.penalize's) and their bitmasks of allowed tokens (None when no row is
    constrained; a row that is not, all ones), then padding rows up to `bucket` (sampled
    greedily, dropped: one compiled sampler per batch bucket, not per number of rows)."""
    padded = rows + [FILLER_ROW] * (bucket - len(rows))

    def column(name: str, dtype) -> np.ndarray:
        return np.asarray([getattr(r, name) for r in padded], dtype)

    penalties = (column("presence", np.float32), column("frequency", np.float32),
                 column("repetition", np.float32), column("uses_history", np.bool_))
    masks = [r.allowed for r in padded if r.allowed is not None]
    allowed = None
    if masks:
        allowed = np.full((bucket, masks[0].shape[0]), -1, np.int32)
        for i, r in enumerate(padded):
            if r.allowed is not None:
                allowed[i] = r.allowed
    return (column("temperature", np.float32), column("top_p", np.float32), column("top_k", np.int32),
            column("min_p", np.float32), np.stack([r.key for r in padded]).astype(np.uint32), penalties, allowed)


def sampled_rows(rows: list[SamplingRow], drawn, experts: np.ndarray) -> list[Sampled]:
    """sample's outputs (host arrays over the padded batch) as one Sampled per row.
    experts: per row, the routing of what it fed in, [rows, MoE layers, ...]."""
    tokens, logprobs, keys, top_ids, top_lp = drawn
    return [
        Sampled(
            token=int(tokens[i]),
            logprob=float(logprobs[i]),
            next_key=keys[i],
            top=tuple(zip(top_ids[i].tolist(), top_lp[i].tolist())) if r.want_top else (),
            experts=experts[i],
        )
        for i, r in enumerate(rows)
    ]


class StepRow(Protocol):
    """What a decode step reads of a request (the scheduler's Active)."""

    slot: int
    next_token: int | None
    position: int
    emitted: int

    @property
    def request(self) -> GenerationRequest: ...

    def sampling_row(self, masked: bool = True) -> SamplingRow: ...


Row = TypeVar("Row", bound=StepRow)


def next_step_rows(unread: list[Row], decoding: list[Row], goes_on: Callable[[Row], bool], max_context: int,
                   masked: bool = True, unread_steps: int = 1):
    """The rows of the next decode step (the scheduler's Active requests) and the runner's
    arguments for them. unread: the rows of a step (or a burst of unread_steps steps)
    dispatched and not yet read back; those that go on (goes_on) are chained to it
    (their token is on the device), unless they end in it for their length. Every other
    row of `decoding` feeds its token from the host. masked=False: the rows without
    their grammars' bitmasks (a deferred step's)."""
    rows = [a for a in unread if goes_on(a) and not ends_at_unread_step(a, max_context, unread_steps)]
    chained = [True] * len(rows)
    in_unread = set(map(id, unread))  # by identity: a request's fields hold arrays
    for act in decoding:
        if id(act) not in in_unread:
            rows.append(act)
            chained.append(False)
    tokens = [0 if link else a.next_token for a, link in zip(rows, chained)]
    positions = [a.position + unread_steps * link for a, link in zip(rows, chained)]
    args = (tokens, [a.slot for a in rows], positions, [a.sampling_row(masked) for a in rows], chained)
    return rows, args


def ends_at_unread_step(act: StepRow, max_context: int, steps: int = 1) -> bool:
    """Whether the unread step (or burst of `steps`) a request is in ends it for its
    length, whatever it samples."""
    return act.emitted + steps >= act.request.max_tokens or act.position + steps + 1 >= max_context


def dispatch_steps(rows: list[StepRow], args, most: int, max_context: int) -> int:
    """How many steps a dispatch of these rows (next_step_rows's) takes: `most` (the
    runner's burst_steps) where every row has that many tokens to go before its
    max_tokens or the context ends it (a row chained to an unread step is that step's
    tokens further on), else one."""
    if most == 1:
        return 1
    positions = args[2]
    fits = all(a.emitted + (p - a.position) + most <= a.request.max_tokens and p + most + 1 <= max_context
               for a, p in zip(rows, positions))
    return most if fits else 1
