"""Frames over a Trio stream: the thin I/O layer under the sans-IO codec in
protocol/wire.py (docs/wire.md), and a slot's KV moved over it.

    FrameStream(stream)         one per connection: `receive()` the next frame (also
                                `async for`), `send(kind, payload)` / `send_msg(kind, msg)`
    connect(address)            `async with connect("host:port") as frames`: a client's
    request(address, kind, msg) one request answered by one frame (K_GEN, K_DECODE): the
                                answer's kind and Msg, within the request wait
    send_layers(frames, hold)   a prefill worker's side: a held slot's KV, one K_LAYER a layer
    Handover(frames, header, n) a decode worker's side: the K_LAYER frames as the arrays
                                `Engine.install_slot` takes, then K_FIRST checked
"""

from __future__ import annotations

import time
from collections import deque
from contextlib import asynccontextmanager

import trio

from ..protocol import wire
from ..protocol.session_file import SessionError, SessionHeader, layer_arrays
from ..protocol.wire import K_ERROR, K_FIRST, K_LAYER, Frame, Msg, WireError
from ..runtime.addresses import parse_address
from ..runtime.groups import sole_error

RECEIVE_SIZE = 1 << 18  # bytes asked of the socket at a time
SEND_WHOLE = 1 << 16  # a payload up to this size goes out joined to its head, larger ones after it


class FrameStream:
    """A stream's bytes as frames. One task receives and one task sends (a Trio stream
    refuses two concurrent senders)."""

    def __init__(self, stream: trio.abc.Stream, max_payload: int = wire.MAX_FRAME):
        self.stream = stream
        self._decoder = wire.FrameDecoder(max_payload)
        self._ready: deque[Frame] = deque()
        self._error: WireError | None = None

    async def receive(self) -> Frame:
        """The next frame. trio.EndOfChannel when the peer closed the stream between
        frames; WireError when its bytes break the framing (a length over the limit,
        a stream cut inside a frame): nothing after that can be read."""
        while not self._ready:
            if self._error is not None:
                raise self._error
            data = await self.stream.receive_some(RECEIVE_SIZE)
            if not data:
                self._error = self._decoder.end_of_stream()
                if self._error is None:
                    raise trio.EndOfChannel
                continue
            # bytes() of the bytes a socket gives is that same object: no copy
            for event in self._decoder.feed(bytes(data)):  # an error is always the last event
                if isinstance(event, WireError):
                    self._error = event
                else:
                    self._ready.append(event)
        return self._ready.popleft()

    def __aiter__(self):
        return self

    async def __anext__(self) -> Frame:
        try:
            return await self.receive()
        except trio.EndOfChannel:
            raise StopAsyncIteration from None

    async def send(self, kind: int, payload: bytes) -> None:
        if len(payload) <= SEND_WHOLE:
            await self.stream.send_all(wire.encode_frame(kind, payload))
        else:  # a KV layer: not copied once more just to join it to five bytes
            await self.stream.send_all(wire.frame_head(kind, len(payload)))
            await self.stream.send_all(payload)

    async def send_msg(self, kind: int, msg: Msg) -> None:
        await self.send(kind, wire.encode_msg(msg))


@asynccontextmanager
async def connect(address: str):
    """A connection to a worker as a FrameStream; OSError when it cannot be made."""
    host, port = parse_address(address)
    stream = await trio.open_tcp_stream(host, port)
    async with stream:
        yield FrameStream(stream)


async def request(address: str, kind: int, msg: Msg, *, wait: float = wire.REQUEST_WAIT_S) -> tuple[int, Msg]:
    """Send one request and read its one-frame answer: (K_RESULT or K_ERROR, its Msg).
    trio.TooSlowError past `wait` seconds; OSError or trio.BrokenResourceError when the
    connection fails; trio.EndOfChannel or WireError when it ends without an answer."""
    with trio.fail_after(wait):
        async with connect(address) as frames:
            await frames.send_msg(kind, msg)
            answer = await frames.receive()
    return answer.kind, wire.decode_msg(answer.payload)


# ---- KV layers: a prefill worker's answer --------------------------------------------------


def facts(header: SessionHeader) -> dict[str, str]:
    """What two engines must share for one's KV to mean the same in the other."""
    return {"model": header.model, "dtype": header.dtype, "layers": str(header.layers),
            "kv_heads": str(header.kv_heads), "head_dim": str(header.head_dim), "kv_layout": header.k_layout}


def refusal(msg: Msg, header: SessionHeader, *, required: bool) -> str | None:
    """Why the facts in `msg` do not match `header` (None: they match; a fact absent from
    `msg` is a mismatch only when `required`)."""
    for key, mine in facts(header).items():
        theirs = msg.get(key)
        if theirs != mine and (required or theirs is not None):
            return f"the peer's {key} is {theirs!r}, this worker's {mine!r}"
    return None


class HandoverFailed(Exception):
    """A prefill worker's answer that cannot be used."""


# Whatever makes a handover fail sends the decode worker to read the prompt itself.
HANDOVER_ERRORS = (HandoverFailed, WireError, SessionError, OSError, trio.BrokenResourceError,
                   trio.ClosedResourceError, trio.EndOfChannel)


def layer_payload(layer: int, k, v) -> bytes:
    """A K_LAYER payload: K then V, each [tokens, kv_heads, head_dim] row-major, in the
    engine's dtype (little-endian: the byte order of every host JAX runs on)."""
    return wire.encode_layer(layer, k.shape[0], k.tobytes() + v.tobytes())


async def send_layers(frames: FrameStream, hold, tokens: int, layers: int) -> int:
    """Stream a held slot's KV, one K_LAYER frame per layer; the payload bytes sent.

    Layer i+1 is read from the device while layer i goes out on the socket. The jitted
    forward computed every layer in one call before this starts, so what overlaps the
    transfer is the per-layer device→host reads (and checksums), not the computation."""
    put, take = trio.open_memory_channel(0)  # no buffer: one layer read ahead, no more

    async def read_layers():
        async with put:
            for i in range(layers):
                k, v = await hold.read(i, tokens)
                await put.send(await trio.to_thread.run_sync(layer_payload, i, k, v))

    sent = 0
    with sole_error():
        async with trio.open_nursery() as nursery:
            nursery.start_soon(read_layers)
            async with take:
                async for payload in take:
                    await frames.send(K_LAYER, payload)
                    sent += len(payload)
    return sent


class Handover:
    """A prefill worker's answer as it arrives: its K_LAYER frames as the (K, V) arrays
    `install_slot` takes (each checksum verified), then K_FIRST, whose facts must match
    this worker's. Anything else raises HandoverFailed (or WireError, SessionError)."""

    def __init__(self, frames: FrameStream, header: SessionHeader, tokens: int):
        self.frames = frames
        self.header = header
        self.tokens = tokens
        self.asked = time.perf_counter()
        self.arrived: float | None = None  # when the first frame came
        self.pending: Frame | None = None  # a frame received, not yet taken
        self.layers_in = 0
        self.bytes = 0
        self.first: int | None = None  # the first token; None when the turn ended at once
        self.prefill_ms = self.transfer_ms = 0

    async def receive(self) -> Frame:
        frame = await self.frames.receive()
        if self.arrived is None:
            self.arrived = time.perf_counter()
            self.prefill_ms = round((self.arrived - self.asked) * 1000)
        if frame.kind == K_ERROR:
            raise HandoverFailed(f"the prefill worker answered: {wire.decode_msg(frame.payload).body}")
        return frame

    async def layers_follow(self) -> bool:
        """Wait for the answer's first frame: False when it is K_FIRST (the turn ended at
        its first token, so no KV comes; already checked)."""
        frame = await self.receive()
        if frame.kind == K_FIRST:
            self.end(frame)
            return False
        self.pending = frame
        return True

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.layers_in == self.header.layers:
            self.end(await self.receive())
            raise StopAsyncIteration
        frame, self.pending = self.pending or await self.receive(), None
        if frame.kind != K_LAYER:
            raise HandoverFailed(f"layer {self.layers_in} was due, a {wire.kind_name(frame.kind)} frame came")
        self.bytes += len(frame.payload)
        arrays = await trio.to_thread.run_sync(self.arrays, frame.payload)
        self.layers_in += 1
        return arrays

    def arrays(self, payload: bytes):
        layer = wire.decode_layer(payload)  # WireError on a bad checksum
        if (layer.layer, layer.rows) != (self.layers_in, self.tokens):
            raise HandoverFailed(f"layer {layer.layer} of {layer.rows} tokens came; "
                                 f"layer {self.layers_in} of {self.tokens} was due")
        data = memoryview(layer.data)
        half = len(data) // 2
        return layer_arrays(self.header, self.tokens, data[:half], data[half:])

    def end(self, frame: Frame) -> None:
        """Take K_FIRST: the facts checked, then the first token (or the turn's end)."""
        if frame.kind != K_FIRST:
            raise HandoverFailed(f"K_FIRST was due, a {wire.kind_name(frame.kind)} frame came")
        msg = wire.decode_msg(frame.payload)
        if (why := refusal(msg, self.header, required=True)) is not None:
            raise HandoverFailed(why)
        if msg.number("tokens") != self.tokens:
            raise HandoverFailed(f"the prefill worker read {msg.get('tokens')} tokens, this worker {self.tokens}")
        ended = msg.get("first") is None
        if ended and msg.get("finish") != "stop":
            raise HandoverFailed("a K_FIRST with neither a first token nor finish=stop")
        due = 0 if ended else self.header.layers
        if self.layers_in != due:
            raise HandoverFailed(f"{self.layers_in} layers came, {due} were due")
        self.first = None if ended else msg.number("first")
        assert self.arrived is not None  # set by receive(), which gave this frame
        self.transfer_ms = round((time.perf_counter() - self.arrived) * 1000)
