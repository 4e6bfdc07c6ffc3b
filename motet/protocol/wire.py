"""The TCP wire between prefill and decode workers (docs/wire.md), as a sans-IO codec.

A frame is a u32 little-endian length of what follows, a u8 kind, a payload. Requests
carry a `Msg` (sorted `key=value` lines, a blank line, a body); KV travels as K_LAYER
payloads (layer, rows, checksum, bytes). Nothing here reads or writes a socket: the
I/O layer feeds received bytes to a `FrameDecoder` and writes what `encode_frame` makes.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

# how long a caller waits for a request's answer (a worker's default: a setting's)
from ..runtime.config import REQUEST_WAIT_S as REQUEST_WAIT_S

K_GEN = 1
K_DECODE = 2
K_PREFILL = 3
K_LAYER = 10
K_FIRST = 11
K_RESULT = 20
K_ERROR = 21
KIND_NAMES = {
    K_GEN: "GEN", K_DECODE: "DECODE", K_PREFILL: "PREFILL", K_LAYER: "LAYER",
    K_FIRST: "FIRST", K_RESULT: "RESULT", K_ERROR: "ERROR",
}  # fmt: skip

MAX_FRAME = 64 << 20  # a payload's bytes, at most (the kind byte is not counted)

_LENGTH = struct.Struct("<I")
_LAYER_HEAD = struct.Struct("<IIQ")  # layer, rows, checksum
_U64 = (1 << 64) - 1


class WireError(ValueError):
    """Bytes that break the wire's rules; the message says which rule, in the words the
    other implementations use where they have words for it."""


@dataclass(frozen=True)
class Frame:
    kind: int  # one of the K_* constants, or a kind this side does not know: the
    payload: bytes  # framing does not judge kinds, whoever dispatches does


def _too_big(payload_len: int, limit: int) -> WireError:
    return WireError(f"a frame of {payload_len} payload bytes is over the limit of {limit}")


def frame_head(kind: int, payload_len: int) -> bytes:
    """The 5 bytes before a payload, for writers that send a large payload without
    copying it into one buffer."""
    if not 0 <= kind <= 0xFF:
        raise ValueError(f"a frame kind is one byte, not {kind}")
    if payload_len > MAX_FRAME:
        raise _too_big(payload_len, MAX_FRAME)
    return _LENGTH.pack(payload_len + 1) + bytes((kind,))


def encode_frame(kind: int, payload: bytes) -> bytes:
    return frame_head(kind, len(payload)) + payload


class FrameDecoder:
    """Cuts a byte stream, however it arrives, into frames.

    A declared length over the limit (or of 0, leaving no room for the kind byte) is a
    WireError, and the decoder closes: the bytes after it cannot be trusted to start a
    frame, so nothing more is read from this stream."""

    def __init__(self, max_payload: int = MAX_FRAME):
        self.max_payload = max_payload
        self.buf = bytearray()  # front deletion on a bytearray is cheap (no copy)
        self.closed = False

    def feed(self, data: bytes) -> list[Frame | WireError]:
        if self.closed:
            return []
        self.buf += data
        events: list[Frame | WireError] = []
        while len(self.buf) >= _LENGTH.size:
            (length,) = _LENGTH.unpack_from(self.buf)
            if length == 0 or length - 1 > self.max_payload:
                events.append(
                    WireError("a frame of length 0 has no kind byte")
                    if length == 0
                    else _too_big(length - 1, self.max_payload)
                )
                self.closed = True
                self.buf.clear()
                break
            end = _LENGTH.size + length
            if len(self.buf) < end:
                break
            events.append(Frame(self.buf[_LENGTH.size], bytes(self.buf[_LENGTH.size + 1 : end])))
            del self.buf[:end]
        return events

    def end_of_stream(self) -> WireError | None:
        """The peer closed the stream: a WireError when it stopped inside a frame."""
        if self.closed or not self.buf:
            return None
        return WireError(f"the stream ended inside a frame ({len(self.buf)} bytes of it came)")


# ---- messages ------------------------------------------------------------------------


@dataclass(frozen=True, init=False)
class Msg:
    """`key=value` lines sorted by key (one per key), a blank line, a body.

    `fields` may be given as a mapping or as pairs; it is kept as sorted pairs, so two
    messages with the same content compare equal. Integer values are written in decimal.
    A key holds no `=` or newline and a value no newline: the text could not be read
    back otherwise. The whole message is UTF-8, so the body is text."""

    fields: tuple[tuple[str, str], ...]
    body: str

    def __init__(self, fields: Mapping[str, str | int] | Iterable[tuple[str, str | int]] = (), body: str = ""):
        pairs = fields.items() if isinstance(fields, Mapping) else fields
        kept = tuple(sorted((_key(k), _value(k, v)) for k, v in pairs))
        for i, (k, _) in enumerate(kept):
            if i and kept[i - 1][0] == k:
                raise ValueError(f"a Msg has one value per key; {k!r} was given twice")
        if not isinstance(body, str):
            raise ValueError("a Msg body is text (the whole message is UTF-8)")
        object.__setattr__(self, "fields", kept)
        object.__setattr__(self, "body", body)

    def get(self, key: str) -> str | None:
        return next((v for k, v in self.fields if k == key), None)

    def number(self, key: str) -> int:
        """The value of `key` as an unsigned 64-bit decimal number."""
        value = self.get(key)
        if value is None:
            raise WireError(f"missing {key}")
        # str.isdigit alone would take other scripts' digits; int() would take "_", "+", " ".
        if not (value.isascii() and value.isdigit()) or int(value) > _U64:
            raise WireError(f"{key}: not a number")
        return int(value)


def _key(key: str) -> str:
    if not isinstance(key, str) or "=" in key or "\n" in key:
        raise ValueError(f"a Msg key is text without '=' or a newline, not {key!r}")
    return key


def _value(key: str, value: str | int) -> str:
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str) or "\n" in value:
        raise ValueError(f"the value of Msg key {key!r} is one line of text or an int, not {value!r}")
    return value


def encode_msg(msg: Msg) -> bytes:
    head = "".join(f"{k}={v}\n" for k, v in msg.fields)
    try:
        return f"{head}\n{msg.body}".encode()
    except UnicodeEncodeError:  # a Python str may hold lone surrogates; UTF-8 cannot
        raise ValueError("a Msg holding a lone surrogate cannot be written as UTF-8") from None


def decode_msg(data: bytes) -> Msg:
    """The message in `data`. Lines end with `\\n` alone; when the text ends before the
    blank line, every line was a header line and the body is empty. A key given twice
    keeps its last value (a later set replaces an earlier one, as in the writers)."""
    try:
        text = bytes(data).decode("utf-8")
    except UnicodeDecodeError:
        raise WireError("a message that is not UTF-8") from None
    fields: dict[str, str] = {}
    body = ""
    pos = 0
    while pos < len(text):  # by index, not by splitting: the body may be megabytes
        end = text.find("\n", pos)
        end = len(text) if end < 0 else end
        line = text[pos:end]
        pos = end + 1
        if not line:
            body = text[pos:]
            break
        key, eq, value = line.partition("=")
        if not eq:
            raise WireError(f"a header line without '=': \"{line}\"")
        fields[key] = value
    return Msg(tuple(fields.items()), body)


# ---- KV layers -----------------------------------------------------------------------


def layer_checksum(data: bytes | memoryview) -> int:
    """The wrapping (mod 2**64) sum of `data` read as little-endian u64 words, a short
    last word padded with zero bytes."""
    view = memoryview(data).cast("B")
    whole = len(view) // 8 * 8
    # numpy's unsigned sum wraps mod 2**64, which is the rule; and it runs at memory speed.
    total = int(np.frombuffer(view[:whole], dtype="<u8").sum(dtype=np.uint64))
    return (total + int.from_bytes(view[whole:], "little")) & _U64


@dataclass(frozen=True)
class Layer:
    layer: int
    rows: int
    checksum: int
    data: bytes


def encode_layer(layer: int, rows: int, data: bytes) -> bytes:
    """A K_LAYER payload: u32 layer, u32 rows, u64 checksum (all little-endian), bytes."""
    for name, value in (("layer", layer), ("rows", rows)):
        if not 0 <= value <= 0xFFFFFFFF:
            raise ValueError(f"a K_LAYER {name} is a u32, not {value}")
    return _LAYER_HEAD.pack(layer, rows, layer_checksum(data)) + bytes(data)


def decode_layer(payload: bytes) -> Layer:
    """A K_LAYER payload, its checksum verified."""
    if len(payload) < _LAYER_HEAD.size:
        raise WireError(
            f"a layer payload of {len(payload)} bytes is shorter than its {_LAYER_HEAD.size}-byte head"
        )
    layer, rows, sent = _LAYER_HEAD.unpack_from(payload)
    data = bytes(payload[_LAYER_HEAD.size :])
    got = layer_checksum(data)
    if got != sent:
        raise WireError(f"layer {layer}: the checksum says {sent:#018x} but the bytes sum to {got:#018x}")
    return Layer(layer, rows, sent, data)


def kind_name(kind: int) -> str:
    return KIND_NAMES.get(kind, f"kind {kind}")

