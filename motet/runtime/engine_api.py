"""EngineAPI: what every engine offers and all a front may call. The in-process Engine,
MuxEngine (a mux child), SplitEngine (prefill and decode engines behind one front) and
RestartingEngine (a mux child started again when it dies) implement it; the HTTP app
and the fronts are typed on it, so an engine plugs into any front unchanged.

A request is a stream: `async with engine.stream(prompt, ...) as events:` submits it and
yields its events (TokenEvents, then one FinishEvent); leaving the block early cancels
it. A refused request raises an EngineError from the `async with` itself.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from .api import (
    Completion,
    EngineStatistics,
    ExpertState,
    ExpertTiers,
    FinishEvent,
    Grammar,
    Health,
    SlotFile,
    StartupReport,
    TokenEvent,
)
from .choices import Choices


class Events(Protocol):
    """One request's events, as `stream` yields them."""

    request_id: int
    finish: FinishEvent | None  # set once the FinishEvent has been read

    def __aiter__(self) -> AsyncIterator[TokenEvent | FinishEvent]: ...


@runtime_checkable
class EngineAPI(Protocol):
    @property
    def name(self) -> str:
        """The model's name, as /v1/models and the mux READY line give it."""
        ...

    def stream(self, prompt: str | Sequence[int], *, max_tokens: int = 256, temperature: float = 0.0,
               top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0, presence_penalty: float = 0.0,
               frequency_penalty: float = 0.0, repetition_penalty: float = 1.0,
               logit_bias: Mapping[int, float] = {}, stop_token_ids: Sequence[int] = (),
               grammar: Grammar | None = None, seed: int | None = None, slot: int | None = None,
               stop: str | Sequence[str] = (), top_logprobs: int = 0, request_id: int | None = None,
               prefill_only: bool = False) -> AbstractAsyncContextManager[Events]:
        """A request's events (runtime/api.py's GenerationRequest says what each field
        does); leaving the block early cancels it."""
        ...

    def choices(self, prompt: str | Sequence[int], n: int, **kwargs: Any) -> AbstractAsyncContextManager[Choices]:
        """n answers to one prompt, their events merged (runtime/choices.py): stream's
        fields, choice i seeded with seed + i; leaving the block early cancels them."""
        ...

    def stream_chat(self, messages: list[dict], **kwargs) -> AbstractAsyncContextManager[Events]: ...

    async def complete(self, prompt: str | Sequence[int], **kwargs) -> Completion: ...

    async def chat(self, messages: list[dict], **kwargs) -> Completion: ...

    def render_chat(self, messages: list[dict], **template_kwargs: Any) -> str:
        """The model's chat template applied, with the assistant's turn opened;
        template_kwargs: more variables for it (vLLM's chat_template_kwargs: enable_thinking...)."""
        ...

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        """The token ids of `text`: as a prompt is read (`add_special`: with the BOS the
        model wants), else the text's own. BadRequest for text that is not Unicode."""
        ...

    def detokenize(self, ids: Sequence[int]) -> str:
        """The text a stream writes for `ids` (special tokens write none); BadRequest for
        an id outside the vocabulary."""
        ...

    async def cancel(self, request_id: int) -> None:
        """Ends a request in flight (finish reason "cancelled"); NotFound when none has this id."""
        ...

    async def stop(self, request_id: int) -> None:
        """Ends a request in flight as if it had stopped (finish reason "stop")."""
        ...

    async def save_slot(self, slot: int, path: str | Path) -> SlotFile: ...

    async def restore_slot(self, slot: int, path: str | Path) -> SlotFile: ...

    async def erase_slot(self, slot: int) -> int:
        """Forgets a slot's KV; the tokens it held."""
        ...

    def statistics(self) -> EngineStatistics: ...

    def expert_state(self) -> ExpertState: ...

    def startup(self) -> StartupReport | None: ...

    def health(self) -> Health: ...


@runtime_checkable
class InProcessEngineAPI(EngineAPI, Protocol):
    """An engine whose model and KV live in this process (Engine): what the stdio bridge
    (`motet mux`) and the TCP worker need beyond EngineAPI. The model and the
    session header are the model layer's and the session codec's types, named loosely
    here so that this layer imports neither."""

    kv_slots: int

    @property
    def model(self) -> Any: ...

    def decode(self, ids: Sequence[int]) -> str:
        """The text a stream gives for these token ids."""
        ...

    @property
    def session_header(self) -> Any:
        """What a session file must match (protocol.session_file.SessionHeader)."""
        ...

    def encode(self, prompt: str | Sequence[int]) -> tuple[int, ...]: ...

    def expert_tiers(self) -> ExpertTiers: ...

    async def telemetry(self, buffer: int = 64) -> Any:
        """A receive channel of StepRouting, one per step, for the expert telemetry lines."""
        ...

    def hold_slot(self, slot: int) -> AbstractAsyncContextManager[Any]:
        """Keeps a slot from new requests while its KV is read out layer by layer."""
        ...

    async def install_slot(self, slot: int, tokens: Sequence[int], layers: Any) -> None:
        """Fills a slot's KV from layers streamed in (a prefill handover)."""
        ...
