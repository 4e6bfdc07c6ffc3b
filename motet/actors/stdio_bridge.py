"""StdioBridge: speaks the mux protocol over a pair of byte streams (stdin/stdout in
`motet mux`) to any engine with the runtime API. One reader task decodes requests; every
line goes through one writer, so frames never interleave."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import psutil
import trio

from ..protocol import mux
from ..runtime.api import FinishEvent, StepRouting, TokenEvent
from ..runtime.errors import BadRequest, ContextExceeded, EngineError, NotFound
from ..runtime.experts import HITS_EVERY, ExpertMap, device_moves
from .bridge import Intake, cpu_name, rss_gb

log = logging.getLogger(__name__)
READ_SIZE = 65536


@dataclass(frozen=True)
class BridgeSettings:
    topk: bool = False  # SERVE_TOPK=1: a TOPK line per token


class StdioBridge:
    def __init__(self, engine, settings: BridgeSettings, receive, send):
        self.engine = engine
        self.settings = settings
        self.input = receive
        self.output = send
        self.out_send, self.out_receive = trio.open_memory_channel(1024)
        self.intake = Intake()
        self.experts = ExpertMap.for_model(engine.model.config)
        self.experts.set_tiers(engine.expert_tiers())

    async def run(self) -> None:
        """Until stdin ends (or a bad frame): then in-flight requests finish first."""
        async with trio.open_nursery() as writer_scope:
            writer_scope.start_soon(self._writer)
            routing = await self.engine.telemetry(buffer=1024)
            await self._handshake()
            hits_scope = trio.CancelScope()
            writer_scope.start_soon(self._hits, routing, hits_scope)
            async with trio.open_nursery() as requests:
                self.intake.work = requests
                with self.intake.reading:
                    await self._reader(requests)
            hits_scope.cancel()
            await self.out_send.aclose()  # the writer writes what is queued, then ends

    async def _hits(self, routing, scope: trio.CancelScope):
        """A HITS line every few device steps: the experts routed since the last one."""
        with scope:
            steps = 0
            async for event in routing:
                if isinstance(event, StepRouting):
                    self.experts.add_step(event)
                    repin = b"".join(mux.encode_telemetry("REPIN", *move) for move in device_moves(event.moves))
                    if repin:
                        await self._write(repin)
                    steps += 1
                    if steps % HITS_EVERY == 0:
                        await self._write(self._hits_line())

    def _hits_line(self) -> bytes:
        return mux.encode_telemetry("HITS", self.experts.rows, self.experts.cols, self.experts.take_hits().hex())

    async def _writer(self):
        async with self.out_receive:
            async for frame in self.out_receive:
                await self.output.send_all(frame)

    async def _write(self, frame: bytes):
        await self.out_send.send(frame)

    def _hwinfo(self) -> bytes:
        vm = psutil.virtual_memory()
        gpus = self.experts.tiers.gpus  # the engine's view of its GPUs (none on a CPU host)
        return mux.encode_telemetry(
            "HWINFO", os.cpu_count(), f"{vm.total / 1e9:.1f}", f"{vm.available / 1e9:.1f}", len(gpus),
            f"{sum(total for _, total, _ in gpus):.1f}", f"{cpu_name()}|",
        )

    def _tiers(self) -> bytes:
        tiers = self.experts.tiers
        return mux.encode_telemetry(
            "TIERS", *self.experts.tier_counts(), f"{tiers.device_gb:.2f}", f"{tiers.ram_gb:.2f}"
        )

    @staticmethod
    def _gpus(gpus) -> bytes:
        return mux.encode_telemetry(
            "GPUS", len(gpus), *(x for used, total, n in gpus for x in (f"{used:.2f}", f"{total:.2f}", n))
        )

    async def _handshake(self):
        await self._write(
            mux.encode_ready()
            + mux.encode_telemetry("STAT", 0, "0.00", "0.0", f"{rss_gb():.2f}")
            + self._hwinfo() + self._tiers() + self._emap()
        )

    def _emap(self) -> bytes:
        return mux.encode_telemetry("EMAP", self.experts.rows, self.experts.cols, self.experts.emap().hex())

    async def _reader(self, requests: trio.Nursery):
        decoder = mux.RequestDecoder()
        while not decoder.closed:
            data = await self.input.receive_some(READ_SIZE)
            if not data:
                return  # EOF: the nursery waits for the requests in flight
            for event in decoder.feed(data):
                await self._dispatch(event, requests)

    async def _dispatch(self, event, requests: trio.Nursery):
        match event:
            case mux.Submit():
                await self._submit(event, requests)
            case mux.Cancel(rid):
                await self._control(self.engine.cancel, rid)
            case mux.Stop(rid):
                await self._control(self.engine.stop, rid)
            case mux.Malformed(rid, reason):
                log.warning("request %d: %s", rid, reason)
                await self._write(mux.encode_error(rid, BadRequest.code))
            case mux.BadFrame(rid):
                await self._write(mux.encode_error(rid, "BAD_FRAME"))

    async def _control(self, call, rid: int):
        try:
            await call(rid)
        except NotFound:
            await self._write(mux.encode_error(rid, NotFound.code))

    async def _submit(self, sub: mux.Submit, requests: trio.Nursery):
        if sub.grammar is not None:
            await self._write(mux.encode_error(sub.request_id, BadRequest.code))
            return
        if b"\x00" in sub.payload:
            await self._write(mux.encode_error(sub.request_id, BadRequest.code))
            return
        prompt = sub.payload.decode("utf-8", "replace")
        try:
            stream = self.engine.stream(
                prompt, max_tokens=max(1, sub.max_tokens), temperature=sub.temperature,
                top_p=sub.top_p, slot=sub.slot, request_id=sub.request_id,
                top_logprobs=5 if self.settings.topk else 0,
            )
            events = await stream.__aenter__()
        except EngineError as exc:
            await self._write(self._error(sub.request_id, exc))
            return
        requests.start_soon(self._relay, sub.request_id, stream, events)

    def _error(self, rid: int, exc: EngineError) -> bytes:
        if isinstance(exc, ContextExceeded):
            return mux.encode_error(rid, exc.code, exc.used, exc.limit)
        return mux.encode_error(rid, exc.code)

    async def _relay(self, rid: int, stream, events):
        """Write one request's frames; the request was accepted before this task starts."""
        try:
            async for event in events:
                if isinstance(event, TokenEvent):
                    frame = mux.encode_data(rid, event.text)
                    if self.settings.topk and event.top:
                        frame += mux.encode_topk(
                            rid, [(c.logprob, c.text.encode()) for c in event.top]
                        )
                    if frame:
                        await self._write(frame)
                elif isinstance(event, FinishEvent):
                    await self._finish(rid, event)
        finally:
            await stream.__aexit__(None, None, None)

    async def _finish(self, rid: int, event: FinishEvent):
        stats = event.stats
        if stats.finish_reason == "cancelled":
            await self._write(mux.encode_error(rid, "CANCELLED"))
            return
        tail = mux.encode_data(rid, event.text_tail) if event.text_tail else b""
        report = event.report
        self.experts.end_turn(report.entropy)
        p = report.perf
        perf = mux.encode_telemetry(
            "PERF", rid, *(f"{x:.4f}" for x in (p.dt, p.t_edisk, p.t_ewait, p.t_emm, p.t_attn, p.t_kvb, p.t_head))
        )
        # [extension] what the turn reused: servers that do not know TURN skip it
        turn = mux.encode_telemetry(
            "TURN", rid, stats.slot, stats.reused_tokens, f"{stats.time_to_first_token_s:.4f}"
        )
        done = mux.Done(
            rid, stats.emitted_tokens, stats.decode_tokens_per_s, report.hit_pct, rss_gb(),
            stats.prompt_tokens, stats.finish_reason == "length",
        )
        await self._write(
            tail + turn + self._hwinfo() + perf
            + mux.encode_telemetry("ENTROPY", *(f"{h:.3f}" for h in report.entropy))
            + self._gpus(report.gpus) + self._tiers() + self._emap()
            + self._hits_line()
            + mux.encode_done(done)
        )
