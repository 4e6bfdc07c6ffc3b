"""Server → engine: SUBMIT, CANCEL, STOP, and motet's SAVE, RESTORE, ERASE, PREFILL;
their events, the engine's decoder and the server's encoders."""

from __future__ import annotations

from dataclasses import dataclass

from .lines import MAX_PATH, MAX_PAYLOAD, LineBuffer, _u64
from .options import parse_options


@dataclass(frozen=True)
class Submit:
    request_id: int
    slot: int
    max_tokens: int
    temperature: float
    top_p: float
    payload: bytes
    grammar: bytes | None = None
    options: tuple[tuple[str, str], ...] = ()  # [extension] options.py: key=value words after the fields


@dataclass(frozen=True)
class Cancel:
    request_id: int


@dataclass(frozen=True)
class Stop:
    request_id: int


# [extension] a slot's KV: session files and prefill-only requests


@dataclass(frozen=True)
class Save:
    """`SAVE <id> <slot> <bytes>\\n<path>\\n`: write the slot's session file to `path`."""

    request_id: int
    slot: int
    path: str


@dataclass(frozen=True)
class Restore:
    """`RESTORE <id> <slot> <bytes>\\n<path>\\n`: load the session file at `path` into the slot."""

    request_id: int
    slot: int
    path: str


@dataclass(frozen=True)
class Erase:
    """`ERASE <id> <slot>`: forget the slot's history."""

    request_id: int
    slot: int


@dataclass(frozen=True)
class Prefill:
    """`PREFILL <id> <slot> <bytes>\\n<payload>\\n`: read the prompt up to its last token."""

    request_id: int
    slot: int
    payload: bytes


@dataclass(frozen=True)
class Malformed:
    """A request that could not be read: answer `ERROR <request_id> BAD_REQUEST`
    (request_id 0 when not even the id could be read). The stream goes on."""

    request_id: int
    reason: str


@dataclass(frozen=True)
class BadFrame:
    """A payload not followed by its `\\n`: answer `ERROR <id> BAD_FRAME`; the stream is
    out of step, so nothing after it is read."""

    request_id: int


class RequestReader:
    """What both protocols' request decoders share: lines and byte-counted payloads in,
    events out, until a frame out of step closes the stream. `_next` returns the next
    event, or None when more bytes are needed."""

    def __init__(self):
        self.lines = LineBuffer()
        self.pending: tuple | None = None  # a header waiting for its payload: (n, make, bad)
        self.closed = False

    def feed(self, data: bytes) -> list:
        if self.closed:
            return []
        self.lines.feed(data)
        events = []
        while not self.closed:
            event = self._next()
            if event is None:
                break
            events.append(event)
        return events

    def _next(self):
        raise NotImplementedError

    def _expect(self, n: int, make, bad):
        """n payload bytes and a `\\n` follow: `make(payload)` is the event they give;
        without the `\\n` the frame is out of step, `bad` is the event and the stream
        closes."""
        self.pending = (n, make, bad)
        return self._payload()

    def _payload(self):
        n, make, bad = self.pending
        body = self.lines.take(n + 1)
        if body is None:
            return None
        self.pending = None
        if body[-1:] != b"\n":
            self.closed = True
            return bad
        return make(body[:-1])


class RequestDecoder(RequestReader):
    """The engine's reader of SUBMIT / CANCEL / STOP, and of motet's SAVE / RESTORE /
    ERASE / PREFILL [extension]."""

    def _next(self):
        if self.pending is not None:
            return self._payload()
        line = b""
        while not line.strip():  # blank lines between requests are skipped
            line = self.lines.line()
            if line is None:
                return None
            if isinstance(line, Exception):
                return Malformed(0, str(line))
        try:
            # Split as the bytes were tested for blankness (ASCII whitespace): str.split
            # would also split on \x1c-\x1f, and a line of those alone has no words.
            words = [w.decode("ascii") for w in line.split()]
        except UnicodeDecodeError:
            return Malformed(0, "a request line must be ASCII")
        kind, args = words[0], words[1:]
        try:
            if kind == "SUBMIT":
                return self._submit_header(args)
            if kind in ("CANCEL", "STOP") and len(args) == 1:
                rid = _u64(args[0], "id", nonzero=True)
                return Cancel(rid) if kind == "CANCEL" else Stop(rid)
            if kind in _SLOT_PAYLOADS:
                return self._slot_header(kind, args)
            if kind == "ERASE" and len(args) == 2:
                rid = _u64(args[0], "id", nonzero=True)
                return _slot_event(rid, args[1], lambda slot: Erase(rid, slot))
        except ValueError as exc:
            return Malformed(0, f"{kind}: {exc}")
        return Malformed(0, f"unknown or malformed request {kind!r}")

    def _submit_header(self, args: list[str]):
        first = next((i for i, a in enumerate(args) if "=" in a), len(args))
        args, words = args[:first], args[first:]  # the fields, then the options
        if len(args) not in (6, 7):
            raise ValueError(f"SUBMIT takes 6 or 7 fields, got {len(args)}")
        rid = _u64(args[0], "id", nonzero=True)
        n = int(args[2])
        grammar = int(args[6]) if len(args) == 7 else None
        if not 0 <= n <= MAX_PAYLOAD or not 0 <= (grammar or 0) <= MAX_PAYLOAD:
            raise ValueError("payload size out of range")
        try:
            fields = (int(args[1]), int(args[3]), float(args[4]), float(args[5]))
            options = parse_options(words)
        except ValueError as exc:
            problem = str(exc)
            return self._expect(n + (grammar or 0), lambda body: Malformed(rid, problem), BadFrame(rid))

        def submit(body: bytes) -> Submit:
            slot, max_tokens, temperature, top_p = fields
            return Submit(rid, slot, max_tokens, temperature, top_p, body[:n],
                          body[n:] if grammar is not None else None, options)

        return self._expect(n + (grammar or 0), submit, BadFrame(rid))

    def _slot_header(self, kind: str, args: list[str]):
        """SAVE, RESTORE, PREFILL: `<id> <slot> <bytes>`, then that many bytes and `\\n`."""
        if len(args) != 3:
            raise ValueError(f"{kind} takes 3 fields, got {len(args)}")
        rid = _u64(args[0], "id", nonzero=True)
        n = int(args[2])
        if not 0 <= n <= MAX_PAYLOAD:
            raise ValueError("payload size out of range")
        make, slot = _SLOT_PAYLOADS[kind], args[1]
        # The size is known, so the payload is consumed even when the slot is bad.
        return self._expect(n, lambda body: _slot_event(rid, slot, lambda i: make(rid, i, body)), BadFrame(rid))


def _slot_event(rid: int, slot_text: str, make):
    """The event `make(slot)`, or Malformed(rid) when the slot field is not a number (or
    make refuses its payload with a ValueError)."""
    try:
        return make(int(slot_text))
    except ValueError as exc:
        return Malformed(rid, str(exc))


def _path(payload: bytes) -> str:
    if not payload or len(payload) > MAX_PATH:
        raise ValueError(f"a path is 1 to {MAX_PATH} bytes, got {len(payload)}")
    if b"\x00" in payload:
        raise ValueError("a path cannot hold a NUL byte")
    try:
        return payload.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError("a path must be UTF-8") from None


_SLOT_PAYLOADS = {  # the request kinds with a slot and a byte-counted payload
    "SAVE": lambda rid, slot, body: Save(rid, slot, _path(body)),
    "RESTORE": lambda rid, slot, body: Restore(rid, slot, _path(body)),
    "PREFILL": Prefill,
}


def encode_submit(s: Submit) -> bytes:
    grammar = f" {len(s.grammar)}" if s.grammar is not None else ""
    options = "".join(f" {key}={value}" for key, value in s.options)
    head = (f"SUBMIT {s.request_id} {s.slot} {len(s.payload)} {s.max_tokens} {s.temperature:g} {s.top_p:g}"
            f"{grammar}{options}\n")
    return head.encode() + s.payload + (s.grammar or b"") + b"\n"


def encode_cancel(request_id: int) -> bytes:
    return f"CANCEL {request_id}\n".encode()


def encode_stop(request_id: int) -> bytes:
    return f"STOP {request_id}\n".encode()


def encode_save(s: Save) -> bytes:
    path = s.path.encode("utf-8")
    return f"SAVE {s.request_id} {s.slot} {len(path)}\n".encode() + path + b"\n"


def encode_restore(r: Restore) -> bytes:
    path = r.path.encode("utf-8")
    return f"RESTORE {r.request_id} {r.slot} {len(path)}\n".encode() + path + b"\n"


def encode_erase(e: Erase) -> bytes:
    return f"ERASE {e.request_id} {e.slot}\n".encode()


def encode_prefill(p: Prefill) -> bytes:
    return f"PREFILL {p.request_id} {p.slot} {len(p.payload)}\n".encode() + p.payload + b"\n"

