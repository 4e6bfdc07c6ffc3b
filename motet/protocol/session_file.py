"""motet's session file: one slot's tokens and KV on disk, for another engine (or a later
run) to restore. Byte by byte in docs/sessions.md.

KV is only valid under the settings that made it, so the header names all of them and a
reader that expects others is refused, with the reason. Then come the token ids, then
each layer's K and V with the wire's layer checksum, read one layer at a time.
"""

from __future__ import annotations

import json
import math
import os
import struct
import tempfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, fields
from typing import BinaryIO

import ml_dtypes  # noqa: F401 - gives numpy the bfloat16 dtype's name
import numpy as np

from ..runtime.kv_format import host_row
from .wire import layer_checksum

MAGIC = b"motet session\n"  # readable with `head -1`
VERSION = 1
MAX_HEADER = 1 << 20  # a header length above this is corruption, not a header
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_BLOB = struct.Struct("<QQ")  # byte length, checksum


class SessionError(ValueError):
    """A session file this engine must not restore; the message says why."""


@dataclass(frozen=True)
class SessionHeader:
    """Everything that must be the same for saved KV to mean the same thing."""

    model: str  # a fingerprint of the model files, computed by the caller
    engine_version: str
    dtype: str  # the KV's element type, e.g. "bfloat16"
    layers: int
    kv_heads: int
    head_dim: int
    k_layout: str  # a shape string, e.g. "tokens,kv_heads,head_dim"
    v_layout: str
    max_context: int
    rope_theta: float
    rope_scaling: str  # "" for none
    # Other switches that change the KV's arithmetic (a backend, a kernel choice), so a
    # new one needs no new format version. Given as a mapping or pairs; kept sorted.
    settings: tuple[tuple[str, str], ...] = ()

    def __post_init__(self):
        for name in ("model", "engine_version", "dtype", "k_layout", "v_layout", "rope_scaling"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"SessionHeader.{name} is a string, not {getattr(self, name)!r}")
        for name in ("layers", "kv_heads", "head_dim", "max_context"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"SessionHeader.{name} is a positive integer, not {value!r}")
        theta = float(self.rope_theta)
        if not (math.isfinite(theta) and theta > 0):  # NaN would never match itself
            raise ValueError(f"SessionHeader.rope_theta is a positive number, not {self.rope_theta!r}")
        pairs = self.settings.items() if isinstance(self.settings, Mapping) else self.settings
        settings = tuple(sorted((k, v) for k, v in pairs))
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in settings):
            raise ValueError(f"SessionHeader.settings maps strings to strings, not {settings!r}")
        object.__setattr__(self, "rope_theta", theta)
        object.__setattr__(self, "settings", settings)

    def as_json(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["settings"] = dict(self.settings)
        return out


@dataclass(frozen=True)
class Session:
    header: SessionHeader
    tokens: tuple[int, ...]
    layers: tuple[tuple[bytes, bytes], ...]  # (K, V) per layer


# ---- writing -------------------------------------------------------------------------


def write_session(
    path: str | os.PathLike,
    header: SessionHeader,
    tokens: Sequence[int],
    layers: Iterable[tuple[bytes, bytes]],
) -> int:
    """Write a session file atomically and return its size. The bytes go to a temp file in
    the same directory (so the rename cannot cross file systems), are fsynced, and replace
    `path` in one step; on any failure the temp file is removed and `path` is untouched.
    The file is readable by its owner only: KV holds the conversation."""
    tokens = list(tokens)
    if len(tokens) > header.max_context:
        raise ValueError(f"{len(tokens)} tokens do not fit the max context of {header.max_context}")
    try:
        token_bytes = struct.pack(f"<{len(tokens)}I", *tokens)
    except struct.error:
        raise ValueError("token ids are integers from 0 to 2**32 - 1") from None
    head = json.dumps(header.as_json(), sort_keys=True, separators=(",", ":")).encode()
    path = os.path.abspath(path)
    directory, name = os.path.split(path)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(MAGIC + _U32.pack(VERSION) + _U32.pack(len(head)) + head)
            f.write(_U64.pack(len(tokens)) + _U64.pack(layer_checksum(token_bytes)) + token_bytes)
            count = 0
            for count, (k, v) in enumerate(layers, 1):
                if count > header.layers:
                    raise ValueError(f"more layers were given than the header's {header.layers}")
                f.write(_U32.pack(count - 1))
                for blob in (memoryview(k).cast("B"), memoryview(v).cast("B")):
                    f.write(_BLOB.pack(len(blob), layer_checksum(blob)))
                    f.write(blob)
            if count != header.layers:
                raise ValueError(f"{count} layers were given; the header says {header.layers}")
            f.flush()
            os.fsync(f.fileno())
            size = f.tell()
        os.replace(tmp, path)
    except BaseException:
        with suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    _fsync_dir(directory)
    return size


def _fsync_dir(directory: str) -> None:
    # Makes the rename itself durable. Best effort: the file is already complete and in
    # place, and some file systems refuse to fsync a directory.
    with suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


# ---- reading -------------------------------------------------------------------------


def layer_arrays(header: SessionHeader, tokens: int, k: bytes | memoryview,
                 v: bytes | memoryview) -> tuple[np.ndarray, np.ndarray]:
    """A layer's bytes as host arrays; SessionError when their size does not fit."""
    name, row = host_row(header.dtype, header.head_dim)
    dtype = np.dtype(name)  # bfloat16 too: ml_dtypes gives numpy its name
    shape = (tokens, header.kv_heads, row)
    want = int(np.prod(shape)) * dtype.itemsize
    for name, blob in (("K", k), ("V", v)):
        if len(blob) != want:
            raise SessionError(f"a layer's {name} holds {len(blob)} bytes; {tokens} tokens need {want}")
    return np.frombuffer(k, dtype).reshape(shape), np.frombuffer(v, dtype).reshape(shape)


class SessionReader:
    """A session file being read: magic, version, header and token ids are checked when
    it is made; `layers()` then reads and verifies one layer at a time, and after the
    last one refuses trailing bytes."""

    def __init__(self, f: BinaryIO, expect: SessionHeader):
        self.f = f
        self.left = os.fstat(f.fileno()).st_size - f.tell()
        self.header = expect
        start = self.f.read(min(len(MAGIC), self.left))
        self.left -= len(start)
        if start != MAGIC:
            if MAGIC.startswith(start):
                raise SessionError("truncated: the file ends inside the magic")
            raise SessionError("not a session file: it does not start with motet's session magic")
        (version,) = _U32.unpack(self._take(4, "the format version"))
        if version != VERSION:
            raise SessionError(f"unsupported session format version {version} (this motet reads version {VERSION})")
        (size,) = _U32.unpack(self._take(4, "the header length"))
        if size > MAX_HEADER:
            raise SessionError(f"the header is not readable: it claims {size} bytes, over the limit of {MAX_HEADER}")
        _check_header(self._take(size, "the header"), expect)
        (count,) = _U64.unpack(self._take(8, "the token count"))
        if count > expect.max_context:
            raise SessionError(f"token count {count} out of range: the max context is {expect.max_context}")
        (sent,) = _U64.unpack(self._take(8, "the token checksum"))
        data = self._take(4 * count, "the token ids")
        _verify(data, sent, "the token ids")
        self.tokens: tuple[int, ...] = struct.unpack(f"<{count}I", data)
        self.next_layer = 0

    def layers(self) -> Iterator[tuple[bytes, bytes]]:
        while self.next_layer < self.header.layers:
            i = self.next_layer
            (mark,) = _U32.unpack(self._take(4, f"layer {i}"))
            if mark != i:
                raise SessionError(f"layer {i}: the record is marked layer {mark}")
            pair = (self._blob(f"layer {i} K"), self._blob(f"layer {i} V"))
            self.next_layer += 1
            yield pair
        if self.left:
            raise SessionError(f"trailing bytes after the last layer ({self.left} of them)")

    def _blob(self, what: str) -> bytes:
        length, sent = _BLOB.unpack(self._take(_BLOB.size, what))
        data = self._take(length, what)
        _verify(data, sent, what)
        return data

    def _take(self, n: int, what: str) -> bytes:
        # Sizes are checked against what is left before reading, so a corrupt length
        # cannot make us allocate more than the file holds.
        if n > self.left:
            raise SessionError(f"truncated: the file ends inside {what} ({n} bytes needed, {self.left} left)")
        data = self.f.read(n)
        if len(data) != n:  # the file shrank while we read it
            raise SessionError(f"truncated: the file ends inside {what}")
        self.left -= n
        return data


def _verify(data: bytes, sent: int, what: str) -> None:
    got = layer_checksum(data)
    if got != sent:
        raise SessionError(f"{what}: the checksum says {sent:#018x} but the bytes sum to {got:#018x}")


_ABSENT = object()


def _check_header(raw: bytes, expect: SessionHeader) -> None:
    try:
        found = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # not UTF-8, not JSON, nested too deep, a
        # number of too many digits: corruption all the same
        raise SessionError(f"the header is not readable: {exc}") from None
    if not isinstance(found, dict):
        raise SessionError("the header is not readable: it is not a JSON object")
    wanted = expect.as_json()
    if isinstance(found.get("settings"), dict):  # compared key by key, so the message names the key
        wanted.update({f"settings[{k!r}]": v for k, v in wanted.pop("settings").items()})
        found.update({f"settings[{k!r}]": v for k, v in found.pop("settings").items()})
    problems = []
    for name in sorted(wanted.keys() | found.keys()):
        want, got = wanted.get(name, _ABSENT), found.get(name, _ABSENT)
        if type(want) is not type(got) or want != got:  # True must not match 1, nor 4096.0 match 4096
            problems.append(f"{name}: expected {_show(want)}, found {_show(got)}")
    if problems:
        raise SessionError("the session does not match this engine: " + "; ".join(problems))


def _show(value) -> str:
    return "nothing" if value is _ABSENT else repr(value)


@contextmanager
def open_session(path: str | os.PathLike, expect: SessionHeader) -> Iterator[SessionReader]:
    """`with open_session(p, header) as s:` then `s.tokens`, and `for k, v in s.layers()`."""
    with open(path, "rb") as f:
        yield SessionReader(f, expect)


def read_session(path: str | os.PathLike, expect: SessionHeader) -> Session:
    with open_session(path, expect) as s:
        return Session(s.header, s.tokens, tuple(s.layers()))
