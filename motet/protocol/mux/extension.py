"""motet's extension lines (engine → server), for clients that know them: TURN, LOAD_FAIL,
SAVED, RESTORED, ERASED, PREFILLED, KVSAVE_FAIL, WARMUP, and ERROR .. SESSION_REFUSED."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .lines import _u64
from .responses import ResponseDecoder, encode_error


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
            ready_s, load_s, warmup_s = (float(a) for a in args[:3])
            if not all(math.isfinite(x) and x >= 0 for x in (ready_s, load_s, warmup_s)):
                raise ValueError("WARMUP durations are seconds, finite and not negative")
            shapes, compiled, from_cache = (_u64(a, "count") for a in args[3:])
            return Warmup(ready_s, load_s, warmup_s, shapes, compiled, from_cache)
        if kind == "ERROR" and args[1:2] == ["SESSION_REFUSED"]:
            # The reason is free text (UTF-8): the rest of the line after the code, as written.
            reason = b"".join(line.split(None, 3)[3:]).strip()
            return SessionRefused(_u64(args[0], "id"), reason.decode("utf-8", "replace"))
        return super()._parse(kind, args, line)
