"""StdioBridge: speaks the mux protocol over a pair of byte streams (stdin/stdout in
`motet mux`) to any engine with the runtime API. One reader task decodes requests; every
line goes through one writer, so frames never interleave."""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass

import psutil
import trio

from ..protocol import mux
from ..runtime.api import FinishEvent, TokenEvent
from ..runtime.errors import BadRequest, ContextExceeded, EngineError, NotFound

log = logging.getLogger(__name__)
READ_SIZE = 65536


@dataclass(frozen=True)
class BridgeSettings:
    topk: bool = False  # SERVE_TOPK=1: a TOPK line per token


def rss_gb() -> float:
    return psutil.Process().memory_info().rss / 1e9


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "cpu"


class ExpertMap:
    """Heat per (layer, expert) over the engine's life and hits since the last HITS line.
    A dense model is one always-on expert per layer."""

    def __init__(self, rows: int, cols: int):
        self.rows, self.cols = rows, cols
        self.heat = [[0] * cols for _ in range(rows)]
        self.hits = [[False] * cols for _ in range(rows)]

    def add(self, counts) -> None:
        for r, layer in enumerate(counts):
            for c, n in enumerate(layer):
                self.heat[r][c] += n
                self.hits[r][c] = self.hits[r][c] or n > 0

    def emap(self) -> bytes:
        device_tier = 2
        cells = bytes((device_tier << 6) | min(63, n.bit_length()) for row in self.heat for n in row)
        return mux.encode_telemetry("EMAP", self.rows, self.cols, cells.hex())

    def take_hits(self) -> bytes:
        bits = [h for row in self.hits for h in row]
        packed = bytes(
            sum(1 << (7 - j) for j, b in enumerate(bits[i : i + 8]) if b) for i in range(0, len(bits), 8)
        )
        self.hits = [[False] * self.cols for _ in range(self.rows)]
        return mux.encode_telemetry("HITS", self.rows, self.cols, packed.hex() or "00")


def entropy_bits(counts) -> list[float]:
    out = []
    for layer in counts:
        total = sum(layer)
        out.append(max(0.0, -sum(n / total * math.log2(n / total) for n in layer if n)) if total else 0.0)
    return out


class StdioBridge:
    def __init__(self, engine, settings: BridgeSettings, receive, send):
        self.engine = engine
        self.settings = settings
        self.input = receive
        self.output = send
        self.out_send, self.out_receive = trio.open_memory_channel(1024)
        cfg = engine.model.config
        rows, cols = (sum(cfg.moe_layers), cfg.n_experts) if cfg.is_moe else (cfg.n_layers, 1)
        self.experts = ExpertMap(rows, cols)
        self.weights_gb = engine.model.info()["weight_bytes"] / 1e9

    async def run(self) -> None:
        """Until stdin ends (or a bad frame): then in-flight requests finish first."""
        async with trio.open_nursery() as writer_scope:
            writer_scope.start_soon(self._writer)
            await self._handshake()
            async with trio.open_nursery() as requests:
                await self._reader(requests)
            await self.out_send.aclose()

    async def _writer(self):
        async with self.out_receive:
            async for frame in self.out_receive:
                await self.output.send_all(frame)

    async def _write(self, frame: bytes):
        await self.out_send.send(frame)

    def _hwinfo(self) -> bytes:
        vm = psutil.virtual_memory()
        return mux.encode_telemetry(
            "HWINFO", os.cpu_count(), f"{vm.total / 1e9:.1f}", f"{vm.available / 1e9:.1f}", 0, "0.0",
            f"{cpu_name()}|",
        )

    def _tiers(self) -> bytes:
        n = self.experts.rows * self.experts.cols
        return mux.encode_telemetry("TIERS", n, 0, 0, f"{self.weights_gb:.2f}", "0.00")

    async def _handshake(self):
        await self._write(
            mux.encode_ready()
            + mux.encode_telemetry("STAT", 0, "0.00", "0.0", f"{rss_gb():.2f}")
            + self._hwinfo() + self._tiers() + self.experts.emap()
        )

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
        tel = event.telemetry
        counts = tel.expert_counts if tel and tel.expert_counts else [
            [stats.prompt_tokens - stats.reused_tokens + stats.emitted_tokens]
        ] * self.experts.rows
        self.experts.add(counts)
        entropy = entropy_bits(counts)
        perf = mux.encode_telemetry(
            "PERF", rid, f"{stats.total_s:.4f}", "0.0000", "0.0000",
            f"{(tel.prefill_s + tel.decode_s) if tel else 0.0:.4f}", "0.0000", "0.0000",
            f"{tel.sample_s if tel else 0.0:.4f}",
        )
        done = mux.Done(
            rid, stats.emitted_tokens, stats.decode_tokens_per_s, 100.0, rss_gb(),
            stats.prompt_tokens, stats.finish_reason == "length",
        )
        await self._write(
            tail + self._hwinfo() + perf
            + mux.encode_telemetry("ENTROPY", *(f"{h:.3f}" for h in entropy))
            + mux.encode_telemetry("GPUS", 0) + self._tiers() + self.experts.emap()
            + self.experts.take_hits() + mux.encode_done(done)
        )
