"""`motet worker`: one Engine behind the TCP wire of docs/wire.md, in one of three roles.

    mono     answers K_GEN: the whole generation here
    prefill  answers K_PREFILL: reads the prompt into a slot, streams the slot's KV as one
             K_LAYER frame per layer, then K_FIRST (the first token, the facts to check)
    decode   answers K_DECODE: a prefill worker reads the prompt, its layers go into a
             slot of this worker's own as they arrive, and the rest is generated here.
             When that handover fails (no peer, a broken connection, a K_ERROR, refused
             facts, a bad checksum, no answer in time) it reads the prompt itself:
             `fallback=1`, and never an error for its client.

A connection is served by one task, one request after another; connections run
concurrently, each request in a KV slot of its own.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace

import trio

from ..protocol import wire
from ..protocol.sampling_keys import SAMPLING_KEYS, fields_of, read_real
from ..protocol.session_file import SessionHeader
from ..protocol.wire import K_DECODE, K_ERROR, K_FIRST, K_GEN, K_PREFILL, K_RESULT, Frame, Msg, WireError
from ..runtime.addresses import format_address, parse_address
from ..runtime.api import GenerationRequest
from ..runtime.config import WorkerSettings
from ..runtime.engine_api import InProcessEngineAPI
from ..runtime.errors import BadRequest, ContextExceeded, EmptyPrompt, EngineError
from ..runtime.slot_table import SlotQueue
from .frame_io import (
    HANDOVER_ERRORS,
    FrameStream,
    Handover,
    connect,
    facts,
    refusal,
    send_layers,
)

log = logging.getLogger("motet.wire.worker")

ROLES = {"mono": K_GEN, "prefill": K_PREFILL, "decode": K_DECODE}  # the one kind each answers


@dataclass(frozen=True)
class Sampling:
    """A request's sampling keys, each optional (docs/wire.md): max_tokens, temperature,
    top_p, and the engine's other fields as protocol/sampling_keys.py writes them."""

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    keys: tuple[tuple[str, str], ...] = ()  # (key, value) of SAMPLING_KEYS, as given

    @classmethod
    def from_msg(cls, msg: Msg) -> Sampling:
        def real(key: str, default: float) -> float:
            value = msg.get(key)
            try:
                return default if value is None else read_real(value, key)
            except ValueError as exc:
                raise WireError(str(exc)) from None

        max_tokens = msg.number("max_tokens") if msg.get("max_tokens") is not None else cls.max_tokens
        keys = tuple((k, v) for k, v in msg.fields if k in SAMPLING_KEYS)
        try:
            fields_of(keys)
        except ValueError as exc:
            raise WireError(str(exc)) from None
        sampling = cls(max_tokens, real("temperature", cls.temperature), real("top_p", cls.top_p), keys)
        GenerationRequest.of("", **sampling.kwargs())  # BadRequest, in the engine's words, for a value out of range
        return sampling

    def kwargs(self) -> dict:
        return dict(max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p,
                    **fields_of(self.keys))

    def fields(self) -> dict:
        return {"max_tokens": str(self.max_tokens), "temperature": repr(self.temperature),
                "top_p": repr(self.top_p), **dict(self.keys)}


def ms_since(started: float) -> int:
    return round((time.perf_counter() - started) * 1000)


class Worker:
    def __init__(self, engine: InProcessEngineAPI, settings: WorkerSettings):
        self.engine = engine
        self.settings = settings
        self.header: SessionHeader = engine.session_header
        self.slots = SlotQueue(engine.kv_slots)  # a request waits here for a free slot
        self.kind = ROLES[settings.role]
        self.handle = {"mono": self.generate, "prefill": self.prefill, "decode": self.decode}[settings.role]

    async def serve(self, *, task_status=trio.TASK_STATUS_IGNORED):
        """Accept connections until cancelled; `task_status` gets the bound HOST:PORT."""
        host, port = parse_address(self.settings.listen, listening=True)
        listeners = await trio.open_tcp_listeners(port, host=host)
        task_status.started(format_address(*listeners[0].socket.getsockname()[:2]))
        await trio.serve_listeners(self.serve_connection, listeners)

    async def serve_connection(self, stream: trio.SocketStream) -> None:
        frames = FrameStream(stream)
        async with stream:
            try:
                while True:
                    try:
                        frame = await frames.receive()
                    except trio.EndOfChannel:
                        return
                    except WireError as exc:  # the framing broke: say why, then hang up
                        await frames.send_msg(K_ERROR, error_msg(exc))
                        return
                    await self.answer(frames, frame)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                log.info("a client hung up before its answer")
            except Exception as exc:  # a bug: this connection ends, the worker serves on
                log.exception("a request failed")
                with trio.move_on_after(1):
                    await frames.send_msg(K_ERROR, Msg({"code": "ENGINE_ERROR"}, f"internal error: {exc!r}"))

    async def answer(self, frames: FrameStream, frame: Frame) -> None:
        try:
            if frame.kind != self.kind:
                raise WireError(f"a {self.settings.role} worker answers {wire.kind_name(self.kind)}, "
                                f"not {wire.kind_name(frame.kind)}")
            await self.handle(frames, wire.decode_msg(frame.payload))
        except (WireError, EngineError) as exc:
            await frames.send_msg(K_ERROR, error_msg(exc))

    # ---- mono ---------------------------------------------------------------------------

    async def generate(self, frames: FrameStream, msg: Msg) -> None:
        started = time.perf_counter()
        done = await self.engine.complete(msg.body, **Sampling.from_msg(msg).kwargs())
        fields = {"tokens": len(done.token_ids), "finish": done.stats.finish_reason,
                  "prompt_tokens": done.stats.prompt_tokens, "reused": done.stats.reused_tokens}
        await frames.send_msg(K_RESULT, Msg(fields | {"ms": ms_since(started)}, done.text))

    # ---- prefill ------------------------------------------------------------------------

    async def prefill(self, frames: FrameStream, msg: Msg) -> None:
        started = time.perf_counter()
        sampling = replace(Sampling.from_msg(msg), max_tokens=1)
        if (why := refusal(msg, self.header, required=False)) is not None:
            raise BadRequest(why)  # refused before any work: a peer that could not use the KV
        prompt = self.engine.encode(msg.body)
        fields = facts(self.header) | {"tokens": len(prompt)}
        async with self.slots.holding(prompt) as slot:
            done = await self.engine.complete(prompt, slot=slot, **sampling.kwargs())
            fields["prefill_ms"] = ms_since(started)
            if not done.token_ids:  # the turn ended at its first token: no KV worth moving
                fields["finish"] = "stop"
            else:
                fields["first"] = done.token_ids[0]
                sending = time.perf_counter()
                async with self.engine.hold_slot(slot) as hold:
                    if hold.history != prompt:
                        held = len(hold.history)
                        raise EngineError(f"slot {slot} holds {held} tokens, not the prompt's {len(prompt)}")
                    fields["bytes"] = await send_layers(frames, hold, len(prompt), self.header.layers)
                fields["send_ms"] = ms_since(sending)
        await frames.send_msg(K_FIRST, Msg(fields))

    # ---- decode -------------------------------------------------------------------------

    async def decode(self, frames: FrameStream, msg: Msg) -> None:
        started = time.perf_counter()
        sampling = Sampling.from_msg(msg)
        peer = msg.get("prefill") or self.settings.prefill
        try:
            if peer is not None:
                parse_address(peer)
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        prompt = self.engine.encode(msg.body)
        if not prompt:
            raise EmptyPrompt()
        if len(prompt) >= self.header.max_context:
            raise ContextExceeded(len(prompt), self.header.max_context)
        async with self.slots.holding(prompt) as slot:
            handover, why = None, "no prefill worker was named"
            if peer is not None:
                with trio.move_on_after(self.settings.request_wait) as waited:
                    try:
                        handover = await self.hand_over(peer, msg.body, prompt, sampling, slot)
                    except HANDOVER_ERRORS as exc:
                        why = f"{type(exc).__name__}: {exc}"
                if waited.cancelled_caught:
                    why = f"the prefill worker gave no answer within {self.settings.request_wait:g} s"
            if handover is None:  # the slot was left empty if a layer had gone in
                log.warning("prefill at %s failed, reading the prompt here: %s", peer, why)
                done = await self.engine.complete(prompt, slot=slot, **sampling.kwargs())
                text, fields = done.text, {"tokens": len(done.token_ids), "finish": done.stats.finish_reason,
                                           "reused": done.stats.reused_tokens, "fallback": 1,
                                           "reason": " ".join(why.split())}
            else:
                text, fields = await self.generate_rest(prompt, slot, sampling, handover)
        fields["prompt_tokens"] = len(prompt)
        await frames.send_msg(K_RESULT, Msg(fields | {"ms": ms_since(started)}, text))

    async def hand_over(self, peer: str, text: str, prompt, sampling: Sampling, slot: int) -> Handover:
        """Ask `peer` to read the prompt, installing its layers into `slot` as they come."""
        async with connect(peer) as frames:
            handover = Handover(frames, self.header, len(prompt))
            await frames.send_msg(K_PREFILL, Msg(sampling.fields() | facts(self.header), text))
            if await handover.layers_follow():
                await self.engine.install_slot(slot, prompt, handover)
        return handover

    async def generate_rest(self, prompt, slot: int, sampling: Sampling, handover: Handover):
        ids: tuple[int, ...] = ()
        finish, reused = "stop", 0
        if handover.first is not None:
            ids, finish = (handover.first,), "length"
            if sampling.max_tokens > 1 and len(prompt) + 1 < self.header.max_context:
                rest = replace(sampling, max_tokens=sampling.max_tokens - 1)
                done = await self.engine.complete(prompt + ids, slot=slot, **rest.kwargs())
                ids, finish, reused = ids + done.token_ids, done.stats.finish_reason, done.stats.reused_tokens
        fields = {"tokens": len(ids), "finish": finish, "reused": reused, "fallback": 0,
                  "prefill_ms": handover.prefill_ms, "transfer_ms": handover.transfer_ms, "bytes": handover.bytes}
        return self.engine.decode(ids), fields


def error_msg(exc: Exception) -> Msg:
    return Msg({"code": getattr(exc, "code", "BAD_MESSAGE")}, str(exc))
