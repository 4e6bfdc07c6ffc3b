"""The engine API's requests and events: what the fronts (stdio bridge, HTTP server)
and embedding programs see. Both the in-process Engine and a mux client speak these."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np

# "grammar": the request's grammar left no token to sample (Grammar)
FinishReason = Literal["stop", "length", "cancelled", "prefilled", "grammar"]
GrammarKind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]
GRAMMAR_KINDS: tuple[GrammarKind, ...] = ("json_schema", "json_object", "regex", "choice", "grammar")
MAX_GRAMMAR_CHARS = 1 << 20
MAX_TOP_K = (1 << 31) - 1  # the sampler keeps top_k in int32
MAX_LOGIT_BIAS = 100.0  # OpenAI's bound on a logit_bias value
MAX_REPETITION_PENALTY = 100.0  # far past any useful value; bounds what a request may send


def sampling_problem(max_tokens: int, temperature: float, top_p: float) -> str | None:
    """What is wrong with these sampling settings, or None: one rule for the engines'
    requests and the command's flags."""
    if max_tokens < 1:
        return f"max_tokens must be at least 1, got {max_tokens}"
    if not 0 <= temperature <= 100:
        return f"temperature must be in [0, 100], got {temperature}"
    if not 0 < top_p <= 1:
        return f"top_p must be in (0, 1], got {top_p}"
    return None


@dataclass(frozen=True)
class Grammar:
    """What a request's answer must match (vLLM's structured_outputs): a JSON schema (as
    JSON text), any JSON object (`text` empty), a regular expression, one of a list of
    strings (a JSON array), or a grammar in Lark or llama.cpp's GBNF."""

    kind: GrammarKind
    text: str = ""
    after: str = ""  # the grammar applies once the answer holds this text (a reasoning block's end)

    def __post_init__(self):
        from .errors import BadRequest

        if self.kind not in GRAMMAR_KINDS:
            raise BadRequest(f"a grammar's kind is one of {', '.join(GRAMMAR_KINDS)}, got {self.kind!r}")
        if len(self.text) > MAX_GRAMMAR_CHARS:
            raise BadRequest(f"the grammar holds {len(self.text)} characters; at most {MAX_GRAMMAR_CHARS}")


@dataclass(frozen=True)
class GenerationRequest:
    prompt: str | tuple[int, ...]
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no cut
    min_p: float = 0.0  # 0: no cut
    # On the model's logits before sampling, greedy included (vLLM's meanings):
    presence_penalty: float = 0.0  # minus this for a token the answer holds
    frequency_penalty: float = 0.0  # minus this times how often the answer holds it
    repetition_penalty: float = 1.0  # a token in the prompt or the answer: divided (positive) or multiplied
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    stop_token_ids: tuple[int, ...] = ()  # sampling one ends the request ("stop"; not emitted)
    grammar: Grammar | None = None  # the answer matches it (constrained decoding)
    seed: int | None = None
    slot: int | None = None
    stop: tuple[str, ...] = ()
    top_logprobs: int = 0
    request_id: int | None = None
    # Read the prompt up to its last token (n - 1 tokens in the slot's KV: where a request
    # continuing it resumes) and finish "prefilled" without generating.
    prefill_only: bool = False

    @classmethod
    def of(cls, prompt, *, stop=(), **fields) -> GenerationRequest:
        """From an engine's stream() arguments: a prompt of text or token ids, and one stop
        string or several."""
        if isinstance(bias := fields.get("logit_bias"), dict):
            fields["logit_bias"] = tuple((int(t), float(b)) for t, b in bias.items())
        if "stop_token_ids" in fields:
            fields["stop_token_ids"] = tuple(fields["stop_token_ids"])
        return cls(prompt=prompt if isinstance(prompt, str) else tuple(prompt),
                   stop=(stop,) if isinstance(stop, str) else tuple(stop), **fields)

    @property
    def uses_history(self) -> bool:
        """Whether sampling reads what the slot's request has seen: a penalty or a bias."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1
                    or self.logit_bias)

    def __post_init__(self):
        from .errors import BadRequest

        if (problem := sampling_problem(self.max_tokens, self.temperature, self.top_p)) is not None:
            raise BadRequest(problem)
        if not 0 <= self.top_k <= MAX_TOP_K:
            raise BadRequest(f"top_k must be in [0, {MAX_TOP_K}] (0: no cut), got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise BadRequest(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise BadRequest(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise BadRequest(f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}] (1: none), "
                             f"got {self.repetition_penalty}")
        for token, bias in self.logit_bias:
            if token < 0 or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise BadRequest(f"logit_bias maps token ids (>= 0) to values in [-{MAX_LOGIT_BIAS:g}, "
                                 f"{MAX_LOGIT_BIAS:g}], got {token}: {bias}")
        if any(token < 0 for token in self.stop_token_ids):
            raise BadRequest(f"stop_token_ids are token ids (>= 0), got {list(self.stop_token_ids)}")
        if not 0 <= self.top_logprobs <= 5:
            raise BadRequest(f"top_logprobs must be in [0, 5], got {self.top_logprobs}")
        if self.request_id is not None and self.request_id <= 0:
            raise BadRequest(f"request ids are positive, got {self.request_id}")


@dataclass(frozen=True)
class SlotFile:
    """A slot saved to or restored from a session file."""

    slot: int
    tokens: int  # token ids whose KV the file holds
    bytes: int  # the file's size
    ms: float  # milliseconds the save or restore took


@dataclass(frozen=True)
class TopCandidate:
    token_id: int | None  # None from a mux engine: the wire carries text only
    text: str
    logprob: float


@dataclass(frozen=True)
class TokenEvent:
    """Text released by one sampled token (may be empty while UTF-8 or a possible stop
    string is incomplete), with the token's logprob and, when asked, its top candidates.
    A mux engine reports text only: `token_id` is None, and `logprob` is known only when
    top candidates were asked for (None otherwise)."""

    request_id: int
    text: str
    token_id: int | None
    logprob: float | None
    top: tuple[TopCandidate, ...] = ()


@dataclass(frozen=True)
class TurnStats:
    request_id: int
    slot: int
    finish_reason: FinishReason
    prompt_tokens: int
    reused_tokens: int  # prompt tokens whose KV the slot already held
    emitted_tokens: int
    time_to_first_token_s: float
    decode_tokens_per_s: float
    total_s: float
    copied_tokens: int = 0  # of the reused, those copied from another slot (prefix sharing, n choices)


@dataclass(frozen=True)
class Telemetry:
    """Per-turn figures, published for the fronts (PERF, ENTROPY, HITS lines, /metrics)."""

    request_id: int
    prefill_s: float
    decode_s: float
    sample_s: float
    expert_counts: tuple[tuple[int, ...], ...] = ()  # per MoE layer, per expert: routed tokens
    expert_wait_s: float = 0.0  # tiered: seconds its steps spent moving experts onto the device
    expert_disk_s: float = 0.0  # of those, reading experts from the model file


@dataclass(frozen=True)
class ExpertTiers:
    """Where a model's experts are now: a byte per (MoE layer, expert), row-major, 0 disk,
    1 host RAM, 2 device; the counts per tier (they sum to layers × experts) and the
    bytes on the device (all weights there) and in RAM (experts); pool lookups and
    prefetch guesses since start. A resident model has every expert on the device."""

    mode: str  # "resident" or "tiered"
    rows: int
    cols: int
    tiers: bytes
    device: int
    ram: int
    disk: int
    device_gb: float
    ram_gb: float
    pool_slots: int  # device slots per MoE layer
    lookups: int = 0  # unique (layer, expert) pairs steps needed
    hits: int = 0  # of those, already on the device
    guessed: int = 0  # experts named by prefetch guesses
    guessed_right: int = 0  # of those, routed by their layer
    routed_after_guess: int = 0  # experts routed by layers that had a guess
    gpus: tuple[tuple[float, float, int], ...] = ()  # per GPU: used GB, total GB, experts

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 1.0

    @property
    def prefetch_recall(self) -> float | None:
        """Of the experts a guessed layer routed to, the share the guess named."""
        return self.guessed_right / self.routed_after_guess if self.routed_after_guess else None

    @property
    def prefetch_precision(self) -> float | None:
        """Of the experts guesses named, the share their layer routed to."""
        return self.guessed_right / self.guessed if self.guessed else None


@dataclass(frozen=True)
class StepRouting:
    """The experts one device call routed to, summed over its rows and its `steps`
    decode steps (a burst's several): per MoE layer, per expert, tokens, a read-only
    int64 array [MoE layers, experts] (for a dense model: empty, and `tokens` says how
    many ran). Tiered: the call's pool lookups and hits, its moves (layer, expert, old
    tier, new tier), and the tiers after it when they changed."""

    counts: np.ndarray
    tokens: int
    lookups: int = 0
    hits: int = 0
    moves: tuple[tuple[int, int, int, int], ...] = ()
    tiers: ExpertTiers | None = None
    steps: int = 1


@dataclass(frozen=True)
class Perf:
    """A turn's time split the way the mux PERF line reports it, in seconds: the whole
    turn, expert loads from disk, waits for experts, expert matmuls, attention, KV
    bookkeeping, the LM head and sampling."""

    dt: float = 0.0
    t_edisk: float = 0.0
    t_ewait: float = 0.0
    t_emm: float = 0.0
    t_attn: float = 0.0
    t_kvb: float = 0.0
    t_head: float = 0.0


@dataclass(frozen=True)
class TurnReport:
    """A finished turn's telemetry as the fronts show it (the mux telemetry block)."""

    perf: Perf
    entropy: tuple[float, ...]  # per MoE layer, bits
    gpus: tuple[tuple[float, float, int], ...] = ()  # per device: used GB, total GB, experts
    repin: tuple[tuple[int, int, int, int], ...] = ()  # layer, expert, old tier, device
    hit_pct: float = 100.0  # the turn's expert pool hit rate (100 when all are resident)


@dataclass(frozen=True)
class ExpertState:
    """The latest expert map: per (MoE layer, expert) a byte `tier << 6 | heat`, a bit per
    expert routed recently, a counter that moves with each HITS, the last turn's entropy."""

    rows: int
    cols: int
    emap: bytes
    hits: bytes
    seq: int
    entropy: tuple[float, ...]
    tiers: tuple[int, int, int] | tuple[()] = ()  # experts on the device, in RAM, on disk
    repin: tuple[tuple[int, int, int, int], ...] = ()  # recent: layer, expert, old tier, device
    hit_rate: float | None = None  # pool hits / lookups since start (None: never looked up)
    prefetch_recall: float | None = None  # see ExpertTiers


@dataclass(frozen=True)
class EngineStatistics:
    """A snapshot of the engine's load."""

    running: int  # requests holding a slot (prefilling or decoding)
    waiting: int  # requests queued for a slot
    slots_total: int
    closing: bool  # draining: new requests are refused
    prefix_store_bytes: int = 0  # host RAM holding prefixes pushed out of the slots (prefix_cache_gb)


@dataclass(frozen=True)
class StartupReport:
    """How an engine came up: seconds to ready (loading the model, then compiling and
    running every shape it will run), and the executables that took. None where a mux
    child did not say."""

    ready_s: float  # from start() to ready: what the first request would have waited
    load_s: float | None = None  # reading and placing the model
    warmup_s: float | None = None  # compiling and running each shape once (0: warm-up off)
    shapes: int | None = None  # the shapes warmed (actors/warmup.py)
    compiled: int | None = None  # executables XLA compiled while starting
    from_cache: int | None = None  # executables the persistent cache held
    compiles_after_ready: int | None = None  # executables needed since: 0 unless a shape was missed
    cache_dir: str | None = None  # the persistent compilation cache (None: off)


@dataclass(frozen=True)
class Handover:
    """One handover's figures."""

    tokens: int  # tokens the decode engine restored
    bytes: int  # the session file's size
    prefill_ms: float
    save_ms: float
    restore_ms: float


@dataclass(frozen=True)
class SplitStatistics:
    """A snapshot. requests = handovers + fallbacks + short; the *_ms are sums over the
    handovers (a fallback's partial work is not counted)."""

    requests: int  # requests that reached a decode slot
    handovers: int  # read by the prefill engine, restored into the decode slot
    fallbacks: int  # a handover was due but failed: the decode engine read the prompt itself
    short: int  # the decode engine read the new tokens in place (fewer than min_prompt_tokens)
    bytes: int  # session file bytes handed over
    prefill_ms: float
    save_ms: float
    restore_ms: float
    prefill_alive: bool
    decode_alive: bool
    prefill_restarts: int  # prefill engines started after the first
    min_prompt_tokens: int
    last: Handover | None  # the latest handover's figures

    def metrics(self) -> tuple[tuple[str, str, str, float], ...]:
        """(name, "counter" or "gauge", help, value) for Prometheus; counters without
        their `_total`, which the client library adds."""
        counter, gauge = "counter", "gauge"
        return (
            ("motet_split_requests", counter, "Requests served by the split.", self.requests),
            ("motet_split_handovers", counter, "Prompts read by the prefill engine and handed over.",
             self.handovers),
            ("motet_split_fallbacks", counter, "Handovers that failed: the decode engine read the prompt.",
             self.fallbacks),
            ("motet_split_short", counter, "Prompts short enough for the decode engine to read in place.",
             self.short),
            ("motet_split_handover_bytes", counter, "Session file bytes handed over.", self.bytes),
            ("motet_split_prefill_seconds", counter, "Time the prefill engine spent on handed-over prompts.",
             self.prefill_ms / 1000),
            ("motet_split_save_seconds", counter, "Time spent saving session files.", self.save_ms / 1000),
            ("motet_split_restore_seconds", counter, "Time spent restoring session files.",
             self.restore_ms / 1000),
            ("motet_split_prefill_restarts", counter, "Prefill engines started again.", self.prefill_restarts),
            ("motet_split_prefill_alive", gauge, "1 while the prefill engine serves.", float(self.prefill_alive)),
            ("motet_split_decode_alive", gauge, "1 while the decode engine serves.", float(self.decode_alive)),
            ("motet_split_min_prompt_tokens", gauge, "New tokens from which a prompt is handed over.",
             self.min_prompt_tokens),
        )


@dataclass(frozen=True)
class Health:
    """Whether an engine serves, as /health reports it."""

    status: Literal["ok", "closing", "error"]  # error: it cannot start (reason says why)
    reason: str | None = None
    startup: StartupReport | None = None
    split: SplitStatistics | None = None  # a SplitEngine's handovers and roles

    @classmethod
    def of(cls, closing: bool, startup: StartupReport | None, *, start_error: str | None = None,
           split: SplitStatistics | None = None) -> Health:
        """An engine that is closing is "error" when its start failed (start_error says
        why), else "closing" (draining, or between two children)."""
        if closing:
            return cls("error" if start_error else "closing", start_error, None, split)
        return cls("ok", None, startup, split)


@dataclass(frozen=True)
class FinishEvent:
    stats: TurnStats
    text_tail: str = ""  # text held back until the end (stop-string prefixes, partial UTF-8)
    telemetry: Telemetry | None = None  # the turn's timings and routing (in-process engine)
    report: TurnReport | None = None  # the turn's telemetry as the fronts show it
    stop_sequence: str | None = None  # the stop string that ended the answer, if one did


@dataclass(frozen=True)
class Completion:
    text: str
    token_ids: tuple[int, ...]
    stats: TurnStats
    tokens: tuple[TokenEvent, ...] = field(default=(), repr=False)
