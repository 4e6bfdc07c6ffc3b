"""What the engine tests share (test_engine.py, test_engine_errors.py,
test_engine_outputs.py): the geometries, and the helpers that run a request and read its
events. Their fixtures (`llama`, `kind`, `open_engine`) are in conftest.py."""

from __future__ import annotations

import trio

from motet.runtime.api import FinishEvent, TokenEvent
from motet.runtime.errors import EngineError

# The tiny llama checkpoint (vocab 512, context 512): for tests that need *a* model.
TINY = dict(kv_slots=4, max_context=256, prefill_chunk=16, prefill_chunk_alone=16)
# The default model (SmolLM2-135M): one geometry for all its engines.
SMOL = dict(kv_slots=16, max_context=512, prefill_chunk=64, prefill_chunk_alone=64)

TIMEOUT = 240  # seconds; a hang fails the test instead of the suite


async def run(engine, prompt, **kwargs) -> tuple[list[TokenEvent], FinishEvent]:
    """One request, streamed to the end: its token events and its finish event."""
    async with engine.stream(prompt, **kwargs) as events:
        tokens = [event async for event in events if isinstance(event, TokenEvent)]
    return tokens, events.finish


def ids(tokens: list[TokenEvent]) -> list[int]:
    return [t.token_id for t in tokens]


def outputs(tokens: list[TokenEvent]) -> list[tuple[int | None, str]]:
    """What a request produced, token by token: ids (None from a mux engine) and texts."""
    return [(t.token_id, t.text) for t in tokens]


def text(tokens: list[TokenEvent], finish: FinishEvent) -> str:
    return "".join(t.text for t in tokens) + finish.text_tail


def encode(model, prompt: str) -> tuple[int, ...]:
    """The tokens an engine runs for a text prompt (Engine.encode; `motet mux` uses it too)."""
    tok = model.tokenizer
    add_bos = tok.add_bos and not (tok.bos_token and prompt.startswith(tok.bos_token))
    return tuple(tok.encode(prompt, add_special=add_bos))


def text_of_length(model, n: int) -> str:
    """A text prompt of exactly n tokens."""
    words = "sea " * n
    while len(encode(model, words)) > n:
        words = words[:-4]
    assert len(encode(model, words)) == n
    return words


def resident(prompt: tuple[int, ...], generated: list[int], finish: FinishEvent) -> tuple[int, ...]:
    """The tokens whose KV a slot holds after a turn: the prompt and every generated token
    fed back. The last emitted token is fed back only when the turn ended on an
    end-of-turn token (sampled after it); on `length` or a cancel it was never run."""
    fed = generated if finish.stats.finish_reason == "stop" else generated[:-1]
    return tuple(prompt) + tuple(fed)


async def consume(engine, prompt, log, *, ready_after=1, task_status=trio.TASK_STATUS_IGNORED,
                  **kwargs):
    """Stream `prompt` into `log`; started once accepted; `ready` after a few tokens. An
    engine error ends up in the log too."""
    ready = trio.Event()
    try:
        async with engine.stream(prompt, **kwargs) as events:
            task_status.started(ready)
            async for event in events:
                log.append(event)
                if len(log) >= ready_after:
                    ready.set()
    except EngineError as exc:
        log.append(exc)
