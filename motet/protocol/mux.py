"""The mux line protocol (see docs in the seeds' mux-protocol.md), as sans-IO codecs.

Each direction has a decoder that takes bytes as they arrive (split anywhere) and
returns typed events, and encoder functions that turn events into bytes. No I/O here:
the stdio bridge and the mux client move the bytes.

    server → engine:  SUBMIT, CANCEL, STOP           RequestDecoder / encode_submit ...
    engine → server:  READY, DATA, TOPK, DONE, ERROR, telemetry lines
                                                     ResponseDecoder / encode_data ...
"""

from __future__ import annotations

from dataclasses import dataclass

READY = b"\x01\x01READY\x01\x01"
MAX_LINE = 64 * 1024  # a header or telemetry line longer than this is refused
MAX_PAYLOAD = 64 * 1024 * 1024
MAX_DATA = 64 * 1024  # one DATA frame carries at most this many bytes

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
    """The engine's reader of SUBMIT / CANCEL / STOP."""

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
            problem = None
        except ValueError as exc:
            fields, problem = None, str(exc)
        # The sizes are known, so the payload is consumed even when a field is bad.
        self.pending = (rid, n, grammar, fields, problem)
        return self._payload()

    def _payload(self):
        rid, n, grammar, fields, problem = self.pending
        body = self.lines.take(n + (grammar or 0) + 1)
        if body is None:
            return None
        self.pending = None
        if body[-1:] != b"\n":
            self.closed = True
            return BadFrame(rid)
        if problem is not None:
            return Malformed(rid, problem)
        slot, max_tokens, temperature, top_p = fields
        grammar_bytes = body[n:-1] if grammar is not None else None
        return Submit(rid, slot, max_tokens, temperature, top_p, body[:n], grammar_bytes)


def encode_submit(s: Submit) -> bytes:
    grammar = f" {len(s.grammar)}" if s.grammar is not None else ""
    head = f"SUBMIT {s.request_id} {s.slot} {len(s.payload)} {s.max_tokens} {s.temperature:g} {s.top_p:g}{grammar}\n"
    return head.encode() + s.payload + (s.grammar or b"") + b"\n"


def encode_cancel(request_id: int) -> bytes:
    return f"CANCEL {request_id}\n".encode()


def encode_stop(request_id: int) -> bytes:
    return f"STOP {request_id}\n".encode()


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
            return self._parse(kind, args)
        except (ValueError, IndexError) as exc:
            return BadLine(line, f"{kind}: {exc}")

    def _parse(self, kind: str, args: list[str]):
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


class ExtendedResponseDecoder(ResponseDecoder):
    """A ResponseDecoder that also reads motet's extension lines (TURN, LOAD_FAIL), which
    the plain decoder skips as unknown kinds."""

    def _parse(self, kind: str, args: list[str]):
        if kind == "TURN":
            if len(args) != 4:
                raise ValueError("TURN takes an id, a slot, reused tokens and seconds")
            return Turn(_u64(args[0], "id", nonzero=True), int(args[1]), int(args[2]), float(args[3]))
        if kind == "LOAD_FAIL":
            fail_kind = args[0].removeprefix("kind=") if args else ""
            return LoadFail(fail_kind, " ".join(args[1:]))
        return super()._parse(kind, args)
