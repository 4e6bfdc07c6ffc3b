"""The mux line protocol (see docs in the seeds' mux-protocol.md), as sans-IO codecs.

Each direction has a decoder that takes bytes as they arrive (split anywhere) and
returns typed events, and encoder functions that turn events into bytes. No I/O here:
the stdio bridge and the mux client move the bytes.

    server → engine:  SUBMIT, CANCEL, STOP           RequestDecoder / encode_submit ...
                      SAVE, RESTORE, ERASE, PREFILL  [extension] encode_save ...
    engine → server:  READY, DATA, TOPK, DONE, ERROR, telemetry lines
                                                     ResponseDecoder / encode_data ...
                      SAVED, RESTORED, ERASED, PREFILLED, KVSAVE_FAIL, WARMUP,
                      ERROR .. SESSION_REFUSED       [extension] ExtendedResponseDecoder
"""

from __future__ import annotations

import math
from dataclasses import dataclass

READY = b"\x01\x01READY\x01\x01"
MAX_LINE = 64 * 1024  # a header or telemetry line longer than this is refused
MAX_PAYLOAD = 64 * 1024 * 1024
MAX_DATA = 64 * 1024  # one DATA frame carries at most this many bytes
MAX_PATH = 4096  # a SAVE or RESTORE path longer than this (in bytes) is refused

# ---- events: server → engine ---------------------------------------------------------


@dataclass(frozen=True)
class Submit:
    request_id: int
    slot: int
    max_tokens: int
    temperature: float
    top_p: float
    payload: bytes
    grammar: bytes | None = None


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


# ---- events: engine → server ---------------------------------------------------------


@dataclass(frozen=True)
class Ready:
    pass


@dataclass(frozen=True)
class Data:
    request_id: int
    data: bytes


@dataclass(frozen=True)
class TopK:
    request_id: int
    candidates: tuple[tuple[float, bytes], ...]  # (logprob, token text)


@dataclass(frozen=True)
class Done:
    request_id: int
    emitted: int
    tokens_per_s: float
    hit_pct: float
    rss_gb: float
    prompt_tokens: int
    length_limited: bool


@dataclass(frozen=True)
class Error:
    request_id: int
    code: str
    args: tuple[str, ...] = ()


@dataclass(frozen=True)
class Telemetry:
    """A telemetry line (STAT, HWINFO, TIERS, EMAP, HITS, REPIN, PERF, ENTROPY, GPUS),
    kept as its fields: advisory, rendered by whoever knows it."""

    kind: str
    fields: tuple[str, ...]


@dataclass(frozen=True)
class BadLine:
    """A line of a known kind that does not parse (the decoder goes on)."""

    line: bytes
    reason: str


# TURN is motet's extension: `TURN <id> <slot> <reused_tokens> <ttft_s>` before a turn's block.
TELEMETRY_KINDS = frozenset(
    {"STAT", "HWINFO", "TIERS", "EMAP", "HITS", "REPIN", "PERF", "ENTROPY", "GPUS", "TURN"}
)


# ---- shared line splitting -------------------------------------------------------------


class LineBuffer:
    """Splits a byte stream into lines and byte-counted payloads."""

    def __init__(self):
        self.buf = bytearray()
        self.skipping = False  # inside an over-long line, dropping bytes to its end

    def feed(self, data: bytes) -> None:
        self.buf += data

    def line(self) -> bytes | None | Exception:
        """The next complete line without its `\\n` (and a `\\r` before it), None when
        more bytes are needed, or ValueError for a line over MAX_LINE (dropped)."""
        end = self.buf.find(b"\n")
        if end < 0:
            if len(self.buf) > MAX_LINE:
                self.buf.clear()
                self.skipping = True
            return None
        line = bytes(self.buf[:end])
        del self.buf[: end + 1]
        if self.skipping or end > MAX_LINE:
            self.skipping = False
            return ValueError("line too long")
        return line.removesuffix(b"\r")

    def take(self, n: int) -> bytes | None:
        if len(self.buf) < n:
            return None
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out


def _u64(text: str, what: str, nonzero: bool = False) -> int:
    value = int(text)
    if not 0 <= value < 1 << 64 or (nonzero and value == 0):
        raise ValueError(f"{what} out of range: {text}")
    return value


# ---- server → engine ---------------------------------------------------------------------


class RequestReader:
    """What both protocols' request decoders share: lines and byte-counted payloads in,
    events out, until a frame out of step closes the stream. `_next` returns the next
    event, or None when more bytes are needed."""

    def __init__(self):
        self.lines = LineBuffer()
        self.pending: tuple | None = None  # a header waiting for its payload
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
        if len(args) not in (6, 7):
            raise ValueError(f"SUBMIT takes 6 or 7 fields, got {len(args)}")
        rid = _u64(args[0], "id", nonzero=True)
        n = int(args[2])
        grammar = int(args[6]) if len(args) == 7 else None
        if not 0 <= n <= MAX_PAYLOAD or not 0 <= (grammar or 0) <= MAX_PAYLOAD:
            raise ValueError("payload size out of range")
        try:
            fields = (int(args[1]), int(args[3]), float(args[4]), float(args[5]))
        except ValueError as exc:
            problem = str(exc)
            return self._expect(rid, n + (grammar or 0), lambda body: Malformed(rid, problem))

        def submit(body: bytes) -> Submit:
            slot, max_tokens, temperature, top_p = fields
            return Submit(rid, slot, max_tokens, temperature, top_p, body[:n],
                          body[n:] if grammar is not None else None)

        return self._expect(rid, n + (grammar or 0), submit)

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
        return self._expect(rid, n, lambda body: _slot_event(rid, slot, lambda i: make(rid, i, body)))

    def _expect(self, rid: int, n: int, make):
        """n payload bytes and a `\\n` follow; `make(payload)` is the event they give."""
        self.pending = (rid, n, make)
        return self._payload()

    def _payload(self):
        rid, n, make = self.pending
        body = self.lines.take(n + 1)
        if body is None:
            return None
        self.pending = None
        if body[-1:] != b"\n":
            self.closed = True
            return BadFrame(rid)
        return make(body[:-1])


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
    head = f"SUBMIT {s.request_id} {s.slot} {len(s.payload)} {s.max_tokens} {s.temperature:g} {s.top_p:g}{grammar}\n"
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


# ---- engine → server ---------------------------------------------------------------------


def encode_ready() -> bytes:
    return READY + b"\n"


def encode_data(request_id: int, text: str) -> bytes:
    """One or more DATA frames; each at most MAX_DATA bytes, cut between characters."""
    data = text.encode("utf-8")
    out = []
    while data:
        cut = min(len(data), MAX_DATA)
        while cut < len(data) and (data[cut] & 0xC0) == 0x80:  # inside a character
            cut -= 1
        out.append(f"DATA {request_id} {cut}\n".encode() + data[:cut] + b"\n")
        data = data[cut:]
    return b"".join(out)


def encode_topk(request_id: int, candidates: list[tuple[float, bytes]]) -> bytes:
    fields = " ".join(f"{lp:.4f} {text.hex() or '-'}" for lp, text in candidates)
    return f"TOPK {request_id} {len(candidates)} {fields}\n".encode()


def encode_done(d: Done) -> bytes:
    return (
        f"DONE {d.request_id} STAT {d.emitted} {d.tokens_per_s:.2f} {d.hit_pct:.1f} "
        f"{d.rss_gb:.2f} {d.prompt_tokens} {int(d.length_limited)}\n"
    ).encode()


def encode_error(request_id: int, code: str, *args) -> bytes:
    return " ".join(["ERROR", str(request_id), code, *map(str, args)]).encode() + b"\n"


def encode_telemetry(kind: str, *fields) -> bytes:
    return " ".join([kind, *map(str, fields)]).encode() + b"\n"


class ResponseDecoder:
    """The server's reader of what an engine writes. Kinds it does not know are skipped
    (the protocol's forward-compatibility rule); known kinds that do not parse become
    BadLine events."""

    def __init__(self):
        self.lines = LineBuffer()
        self.pending_data: tuple[int, int] | None = None  # (id, n) of a DATA frame

    def feed(self, data: bytes) -> list:
        self.lines.feed(data)
        events = []
        while True:
            event = self._next()
            if event is None:
                return events
            if event is not _SKIP:
                events.append(event)

    def _next(self):
        if self.pending_data is not None:
            rid, n = self.pending_data
            body = self.lines.take(n + 1)
            if body is None:
                return None
            self.pending_data = None
            if body[-1:] != b"\n":
                return BadLine(body, "DATA payload not followed by a newline")
            return Data(rid, body[:-1])
        line = self.lines.line()
        if line is None:
            return None
        if isinstance(line, Exception):
            return BadLine(b"", str(line))
        if line == READY:
            return Ready()
        words = line.split()
        if not words:
            return _SKIP
        kind = words[0].decode("ascii", "replace")
        args = [w.decode("ascii", "replace") for w in words[1:]]
        try:
            return self._parse(kind, args, line)
        except (ValueError, IndexError) as exc:
            return BadLine(line, f"{kind}: {exc}")

    def _parse(self, kind: str, args: list[str], line: bytes):
        if kind == "DATA":
            if len(args) != 2:
                raise ValueError("DATA takes an id and a byte count")
            n = int(args[1])
            if not 0 <= n <= MAX_PAYLOAD:
                raise ValueError("byte count out of range")
            self.pending_data = (_u64(args[0], "id", nonzero=True), n)
            return self._next()
        if kind == "TOPK":
            count = int(args[1])
            pairs = args[2:]
            if len(pairs) != 2 * count:
                raise ValueError(f"TOPK announces {count} candidates, has {len(pairs) // 2}")
            cands = tuple(
                (float(pairs[i]), b"" if pairs[i + 1] == "-" else bytes.fromhex(pairs[i + 1]))
                for i in range(0, len(pairs), 2)
            )
            return TopK(_u64(args[0], "id", nonzero=True), cands)
        if kind == "DONE":
            if len(args) != 8 or args[1] != "STAT":
                raise ValueError("DONE takes an id, STAT and six numbers")
            return Done(
                _u64(args[0], "id", nonzero=True), int(args[2]), float(args[3]), float(args[4]),
                float(args[5]), int(args[6]), args[7] == "1",
            )
        if kind == "ERROR":
            if len(args) < 2:
                raise ValueError("ERROR takes an id and a code")
            return Error(_u64(args[0], "id"), args[1], tuple(args[2:]))
        if kind in TELEMETRY_KINDS:
            return Telemetry(kind, tuple(args))
        return _SKIP


_SKIP = object()


# ---- motet's extension lines, for clients that know them ---------------------------------


@dataclass(frozen=True)
class Turn:
    """`TURN <id> <slot> <reused_tokens> <ttft_s>`, written before a turn's telemetry block:
    what the turn reused and how long its first token took."""

    request_id: int
    slot: int
    reused_tokens: int
    ttft_s: float


@dataclass(frozen=True)
class LoadFail:
    """`LOAD_FAIL kind=<kind> <detail>`, written instead of READY by a model that cannot load."""

    kind: str
    detail: str


@dataclass(frozen=True)
class Saved:
    """`SAVED <id> <slot> <tokens> <bytes> <ms>`: the slot's session file is written."""

    request_id: int
    slot: int
    tokens: int  # token ids whose KV the file holds
    bytes: int  # the file's size
    ms: float


@dataclass(frozen=True)
class Restored:
    """`RESTORED <id> <slot> <tokens> <bytes> <ms>`: the slot holds the file's KV."""

    request_id: int
    slot: int
    tokens: int
    bytes: int
    ms: float


@dataclass(frozen=True)
class Erased:
    """`ERASED <id> <slot> <tokens>`: the slot forgot the tokens it held."""

    request_id: int
    slot: int
    tokens: int


@dataclass(frozen=True)
class Prefilled:
    """`PREFILLED <id> <slot> <tokens> <reused> <ms>`: the slot's KV holds `tokens` tokens
    of the prompt (all but its last), `reused` of them already there before."""

    request_id: int
    slot: int
    tokens: int
    reused: int
    ms: float


@dataclass(frozen=True)
class KvSaveFail:
    """`KVSAVE_FAIL <slot> <failures>`: with KVSAVE=1 the slot's file could not be written
    (a full disk, no permission); `failures` counts such writes since the engine started.
    Written before the line that ends the turn or command (DONE, CANCELLED, PREFILLED,
    RESTORED), which is answered as usual."""

    slot: int
    failures: int


@dataclass(frozen=True)
class Warmup:
    """`WARMUP <ready_s> <load_s> <warmup_s> <shapes> <compiled> <from_cache>`, once, at the
    end of the start-up lines: how long the engine took to be ready (loading the model,
    then compiling and running every shape it serves) and the executables XLA compiled
    or took from the persistent cache meanwhile."""

    ready_s: float
    load_s: float
    warmup_s: float
    shapes: int
    compiled: int
    from_cache: int


@dataclass(frozen=True)
class SessionRefused:
    """`ERROR <id> SESSION_REFUSED <reason>`: a session file the engine will not restore."""

    request_id: int
    reason: str


def encode_saved(e: Saved) -> bytes:
    return f"SAVED {e.request_id} {e.slot} {e.tokens} {e.bytes} {e.ms:.1f}\n".encode()


def encode_restored(e: Restored) -> bytes:
    return f"RESTORED {e.request_id} {e.slot} {e.tokens} {e.bytes} {e.ms:.1f}\n".encode()


def encode_erased(e: Erased) -> bytes:
    return f"ERASED {e.request_id} {e.slot} {e.tokens}\n".encode()


def encode_prefilled(e: Prefilled) -> bytes:
    return f"PREFILLED {e.request_id} {e.slot} {e.tokens} {e.reused} {e.ms:.1f}\n".encode()


def encode_kvsave_fail(e: KvSaveFail) -> bytes:
    return f"KVSAVE_FAIL {e.slot} {e.failures}\n".encode()


def encode_warmup(w: Warmup) -> bytes:
    return (f"WARMUP {w.ready_s:.2f} {w.load_s:.2f} {w.warmup_s:.2f} {w.shapes} {w.compiled} "
            f"{w.from_cache}\n").encode()


def encode_session_refused(request_id: int, reason: str) -> bytes:
    """The reason on one line: its whitespace (newlines too) becomes single spaces."""
    return encode_error(request_id, "SESSION_REFUSED", " ".join(reason.split()) or "refused")


_COUNTED_REPLIES = {"SAVED": Saved, "RESTORED": Restored, "PREFILLED": Prefilled}


class ExtendedResponseDecoder(ResponseDecoder):
    """A ResponseDecoder that also reads motet's extension lines (TURN, LOAD_FAIL, SAVED,
    RESTORED, ERASED, PREFILLED, KVSAVE_FAIL, WARMUP, ERROR .. SESSION_REFUSED), which the plain
    decoder skips as unknown kinds (or reads as a plain Error)."""

    def _parse(self, kind: str, args: list[str], line: bytes):
        if kind == "TURN":
            if len(args) != 4:
                raise ValueError("TURN takes an id, a slot, reused tokens and seconds")
            return Turn(_u64(args[0], "id", nonzero=True), int(args[1]), int(args[2]), float(args[3]))
        if kind == "LOAD_FAIL":
            fail_kind = args[0].removeprefix("kind=") if args else ""
            return LoadFail(fail_kind, " ".join(args[1:]))
        if kind in ("SAVED", "RESTORED", "PREFILLED"):
            if len(args) != 5:
                raise ValueError(f"{kind} takes an id, a slot, two counts and milliseconds")
            counts = (int(args[1]), int(args[2]), int(args[3]))
            return _COUNTED_REPLIES[kind](_u64(args[0], "id", nonzero=True), *counts, float(args[4]))
        if kind == "ERASED":
            if len(args) != 3:
                raise ValueError("ERASED takes an id, a slot and a token count")
            return Erased(_u64(args[0], "id", nonzero=True), int(args[1]), int(args[2]))
        if kind == "KVSAVE_FAIL":
            if len(args) != 2:
                raise ValueError("KVSAVE_FAIL takes a slot and a count")
            return KvSaveFail(_u64(args[0], "slot"), _u64(args[1], "count"))
        if kind == "WARMUP":
            if len(args) != 6:
                raise ValueError("WARMUP takes three durations and three counts")
            seconds = [float(a) for a in args[:3]]
            if not all(math.isfinite(x) and x >= 0 for x in seconds):
                raise ValueError("WARMUP durations are seconds, finite and not negative")
            return Warmup(*seconds, *(_u64(a, "count") for a in args[3:]))
        if kind == "ERROR" and args[1:2] == ["SESSION_REFUSED"]:
            # The reason is free text (UTF-8): the rest of the line after the code, as written.
            reason = b"".join(line.split(None, 3)[3:]).strip()
            return SessionRefused(_u64(args[0], "id"), reason.decode("utf-8", "replace"))
        return super()._parse(kind, args, line)
