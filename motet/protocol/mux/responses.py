"""Engine → server: READY, DATA, TOPK, DONE, ERROR and the telemetry lines; their
events, the engine's encoders and the server's decoder."""

from __future__ import annotations

from dataclasses import dataclass

from .lines import MAX_DATA, MAX_PAYLOAD, READY, LineBuffer, _u64


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
        events: list = []
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

