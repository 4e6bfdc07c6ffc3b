"""What both directions of the mux protocol share: the limits, and a byte stream split
into lines and byte-counted payloads."""

from __future__ import annotations

READY = b"\x01\x01READY\x01\x01"
MAX_LINE = 64 * 1024  # a header or telemetry line longer than this is refused
MAX_PAYLOAD = 64 * 1024 * 1024
MAX_DATA = 64 * 1024  # one DATA frame carries at most this many bytes
MAX_PATH = 4096  # a SAVE or RESTORE path longer than this (in bytes) is refused


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

