"""The mirror codec: one device call of the leader's runner as bytes, for the followers of
a multi-process group to repeat (docs/scaling.md, "Several processes or hosts").

Sans-IO: `encode(op, args, records)` → one frame; `decode(frame, records)` → (op, args);
`split(frame)` cuts a frame into parts small enough for one key of the coordinator's
store and `join` puts them back. The transport (actors/device_group.py) moves the bytes.

A frame is  VERSION u8 | op u8 | the args as one list value. A value is a tag byte, then:

    N  None                     T / F  True / False
    i  int, i64                 f      float, f64
    s  str: u32 length, UTF-8   L      list: u32 count, the values
    A  numpy array: u8 length + dtype name, u8 ndim, u64 per dim, the C-order bytes
    R  a record (a dataclass of the `records` table): u8 index, its fields as a list

Tuples encode as lists. All numbers are little-endian. A frame that does not decode
exactly raises MirrorError.
"""

from __future__ import annotations

import struct
from dataclasses import fields
from enum import IntEnum

import ml_dtypes
import numpy as np

VERSION = 1
PART_BYTES = 1 << 20  # one key of the coordinator's store holds at most this much
MAX_DEPTH = 8

_U8 = struct.Struct("<B")
_U32 = struct.Struct("<I")
_I64 = struct.Struct("<q")
_F64 = struct.Struct("<d")
_U64 = struct.Struct("<Q")

# Element types an array may have, by name.
DTYPES = {name: np.dtype(name) for name in (
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "float16", "float32", "float64")}
DTYPES["bfloat16"] = np.dtype(ml_dtypes.bfloat16)


class Op(IntEnum):
    """What the followers do with a frame. START builds the runner (its args: slots,
    context, chunk, the model's fingerprint, the experts' plan, their start-up heat, and
    whether the pool prefetches); the others are the runner's device calls, PLACE a
    tiered pool's placement (its moves are device calls)."""

    STOP = 0
    START = 1
    PREFILL = 2
    EXTEND = 3
    DECODE = 4
    READ_LAYERS = 5
    WRITE_LAYERS = 6
    COPY_SLOT = 7
    PLACE = 8
    WARM_PREFILL = 9
    WARM_DECODE = 10
    WARM_MOVE = 11


class MirrorError(ValueError):
    """A frame that is not one this codec wrote (or a value it cannot write); says why."""


# ---- encoding ---------------------------------------------------------------------------


def encode(op: Op, args, records: tuple[type, ...] = ()) -> bytes:
    out = bytearray(_U8.pack(VERSION) + _U8.pack(Op(op)))
    _put(out, list(args), records, 0)
    return bytes(out)


def _put(out: bytearray, value, records, depth: int) -> None:
    if depth > MAX_DEPTH:
        raise MirrorError(f"values nest deeper than {MAX_DEPTH}")
    if value is None:
        out += b"N"
    elif value is True or value is False or isinstance(value, np.bool_):
        out += b"T" if value else b"F"
    elif isinstance(value, (int, np.integer)):
        if not -(1 << 63) <= int(value) < 1 << 63:
            raise MirrorError(f"the int {value} does not fit 64 bits")
        out += b"i" + _I64.pack(int(value))
    elif isinstance(value, (float, np.floating)):
        out += b"f" + _F64.pack(float(value))
    elif isinstance(value, str):
        data = value.encode("utf-8")
        out += b"s" + _U32.pack(len(data)) + data
    elif isinstance(value, (list, tuple)):
        out += b"L" + _U32.pack(len(value))
        for item in value:
            _put(out, item, records, depth + 1)
    elif isinstance(value, np.ndarray):
        name = next((n for n, dtype in DTYPES.items() if dtype == value.dtype), None)
        if name is None:
            raise MirrorError(f"arrays of {value.dtype} are not carried")
        out += b"A" + _U8.pack(len(name)) + name.encode() + _U8.pack(value.ndim)
        out += b"".join(_U64.pack(n) for n in value.shape)
        out += np.ascontiguousarray(value).tobytes()  # every host motet runs on is little-endian
    elif type(value) in records:
        out += b"R" + _U8.pack(records.index(type(value)))
        _put(out, [getattr(value, f.name) for f in fields(value)], records, depth + 1)
    else:
        raise MirrorError(f"a {type(value).__name__} is not carried (not in the records table)")


# ---- decoding ---------------------------------------------------------------------------


def decode(frame: bytes, records: tuple[type, ...] = ()) -> tuple[Op, list]:
    reader = _Reader(memoryview(frame))
    version = reader.unpack(_U8)
    if version != VERSION:
        raise MirrorError(f"mirror frame version {version}, this codec reads {VERSION}")
    code = reader.unpack(_U8)
    try:
        op = Op(code)
    except ValueError:
        raise MirrorError(f"unknown op {code}") from None
    args = reader.value(records, 0)
    if not isinstance(args, list):
        raise MirrorError("a frame's args are a list")
    if reader.at != len(reader.data):
        raise MirrorError(f"{len(reader.data) - reader.at} bytes past the end of the frame")
    return op, args


class _Reader:
    def __init__(self, data: memoryview):
        self.data, self.at = data, 0

    def take(self, n: int) -> memoryview:
        if n > len(self.data) - self.at:
            raise MirrorError(f"the frame ends early: {n} bytes wanted at byte {self.at} of {len(self.data)}")
        self.at += n
        return self.data[self.at - n : self.at]

    def unpack(self, form: struct.Struct):
        return form.unpack(self.take(form.size))[0]

    def value(self, records, depth: int):
        if depth > MAX_DEPTH:
            raise MirrorError(f"values nest deeper than {MAX_DEPTH}")
        tag = bytes(self.take(1))
        if tag == b"N":
            return None
        if tag in (b"T", b"F"):
            return tag == b"T"
        if tag == b"i":
            return self.unpack(_I64)
        if tag == b"f":
            return self.unpack(_F64)
        if tag == b"s":
            try:
                return str(self.take(self.unpack(_U32)), "utf-8")
            except UnicodeDecodeError:
                raise MirrorError("a string that is not UTF-8") from None
        if tag == b"L":
            return [self.value(records, depth + 1) for _ in range(self.unpack(_U32))]
        if tag == b"A":
            return self.array()
        if tag == b"R":
            index = self.unpack(_U8)
            if index >= len(records):
                raise MirrorError(f"record {index} is not in the table ({len(records)} records)")
            kind = records[index]
            values = self.value(records, depth + 1)
            names = [f.name for f in fields(kind)]
            if not isinstance(values, list) or len(values) != len(names):
                raise MirrorError(f"a {kind.__name__} has {len(names)} fields")
            return kind(**dict(zip(names, values)))
        raise MirrorError(f"unknown value tag {tag!r} at byte {self.at - 1}")

    def array(self) -> np.ndarray:
        name = str(self.take(self.unpack(_U8)), "ascii", "replace")
        dtype = DTYPES.get(name)
        if dtype is None:
            raise MirrorError(f"unknown array element type {name!r}")
        shape = tuple(self.unpack(_U64) for _ in range(self.unpack(_U8)))
        # checked as the product grows (a forged shape cannot make a huge number), and an
        # empty array is empty whatever its other dimensions
        count = 0 if 0 in shape else 1
        for n in shape if count else ():
            count *= n
            if count * dtype.itemsize > len(self.data):
                raise MirrorError(f"an array of shape {shape} is larger than the frame")
        data = self.take(count * dtype.itemsize)
        return np.frombuffer(data, dtype).reshape(shape).copy()


# ---- parts: a frame over several keys ---------------------------------------------------


def split(frame: bytes, part_bytes: int = PART_BYTES) -> list[bytes]:
    """The frame in parts of at most part_bytes (the first has a u32 count of them in
    front, so a reader of the first knows how many follow)."""
    pieces = [frame[i : i + part_bytes] for i in range(0, len(frame), part_bytes)] or [b""]
    return [_U32.pack(len(pieces)) + pieces[0], *pieces[1:]]


def parts_in(first: bytes) -> int:
    """How many parts (the first included) a frame has, from its first part."""
    if len(first) < _U32.size:
        raise MirrorError("a first part holds at least its count")
    count = _U32.unpack_from(first)[0]
    if count < 1:
        raise MirrorError("a frame has at least one part")
    return count


def join(parts: list[bytes]) -> bytes:
    if len(parts) != parts_in(parts[0]):
        raise MirrorError(f"the frame has {parts_in(parts[0])} parts, got {len(parts)}")
    return b"".join([parts[0][_U32.size :], *parts[1:]])
