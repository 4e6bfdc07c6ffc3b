"""The mirror codec (motet/protocol/mirror.py): a runner's device call as bytes for the
followers of a group. Exact bytes, round trips (hypothesis), parts, and refusals: any
bytes decode to a call or raise MirrorError, nothing else."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from motet.actors.runner import MIRROR_RECORDS, SamplingRow
from motet.protocol.mirror import DTYPES, MirrorError, Op, decode, encode, join, parts_in, split

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))


def same(a, b) -> bool:
    """Equal values, arrays compared by dtype, shape and bytes (NaN is NaN)."""
    if isinstance(a, np.ndarray):
        return (isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape
                and a.tobytes() == b.tobytes())
    if isinstance(a, SamplingRow):
        return type(b) is SamplingRow and all(same(getattr(a, f), getattr(b, f))
                                              for f in ("temperature", "top_p", "top_k", "min_p", "key", "want_top"))
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(map(same, a, b))
    if isinstance(a, float):
        return isinstance(b, float) and (a == b or (a != a and b != b))
    return type(a) is type(b) and a == b


def test_exact_bytes():
    assert encode(Op.EXTEND, (3, [7, 8], 0)) == (
        b"\x01\x03" + b"L\x03\x00\x00\x00"
        + b"i\x03" + b"\x00" * 7 + b"L\x02\x00\x00\x00" + b"i\x07" + b"\x00" * 7 + b"i\x08" + b"\x00" * 7
        + b"i" + b"\x00" * 8
    )
    assert encode(Op.STOP, ()) == b"\x01\x00L\x00\x00\x00\x00"


def test_a_decode_call_round_trips():
    key = np.array([12, 34], np.uint32)
    rows = [SamplingRow(0.7, 0.9, 40, 0.05, key, True, 0.5, -1.0, 1.2, True, np.arange(4, dtype=np.int32)),
            SamplingRow(0.0, 1.0, 0, 0.0, key, False)]
    op, args = decode(encode(Op.DECODE, ([5, 6], [0, 1], [10, 11], rows), MIRROR_RECORDS), MIRROR_RECORDS)
    assert op is Op.DECODE and same(args, [[5, 6], [0, 1], [10, 11], rows])


def test_a_bfloat16_layer_round_trips_through_parts():
    k = (np.arange(3 * 2 * 4 * 1000) / 7).astype(ml_dtypes.bfloat16).reshape(3000, 2, 4)
    frame = encode(Op.WRITE_LAYERS, (1, 2, [(k, k[:0])]))
    parts = split(frame, part_bytes=10_000)
    assert len(parts) == parts_in(parts[0]) == -(-len(frame) // 10_000) > 1
    assert all(len(p) <= 10_004 for p in parts)
    op, args = decode(join(parts))
    assert op is Op.WRITE_LAYERS and same(args, [1, 2, [[k, k[:0]]]])
    with pytest.raises(MirrorError, match="parts"):
        join(parts[:-1])


def test_an_empty_array_round_trips_whatever_its_other_dimensions():
    """Found by test_round_trip: the size check refused (2, 3, 0) as larger than the frame."""
    empty = np.zeros((2, 3, 0), np.float64)
    op, args = decode(encode(Op.DECODE, [empty], ()), ())
    assert op == Op.DECODE and args[0].shape == (2, 3, 0) and args[0].dtype == np.float64


def test_an_empty_frame_is_one_part():
    assert split(b"") == [b"\x01\x00\x00\x00"] and join(split(b"")) == b""


@pytest.mark.parametrize(("value", "words"), [
    (1 << 63, "does not fit 64 bits"),
    (object(), "object is not carried"),
    (SamplingRow(0.0, 1.0, 0, 0.0, np.zeros(2, np.uint32), False), "SamplingRow is not carried"),
    (np.zeros(2, np.complex64), "arrays of complex64"),
    ([[[[[[[[[[1]]]]]]]]]], "nest deeper"),
])
def test_values_it_does_not_carry(value, words):
    with pytest.raises(MirrorError, match=words):
        encode(Op.EXTEND, (value,))  # no records table: a SamplingRow is unknown


@pytest.mark.parametrize(("frame", "words"), [
    (b"", "ends early"),
    (b"\x02\x00L\x00\x00\x00\x00", "version 2"),
    (b"\x01\x63L\x00\x00\x00\x00", "unknown op 99"),
    (b"\x01\x00N", "args are a list"),
    (b"\x01\x00L\x00\x00\x00\x00!", "1 bytes past the end"),
    (b"\x01\x00L\x01\x00\x00\x00?", "unknown value tag"),
    (b"\x01\x00L\x01\x00\x00\x00A\x05int99\x00", "unknown array element type 'int99'"),
    (b"\x01\x00L\x01\x00\x00\x00A\x05int32\x01" + b"\xff" * 8, "larger than the frame"),
    (b"\x01\x00L\x01\x00\x00\x00R\x00L\x00\x00\x00\x00", "record 0 is not in the table"),
    (b"\x01\x00L\x01\x00\x00\x00s\x01\x00\x00\x00\xff", "not UTF-8"),
])
def test_frames_it_refuses(frame, words):
    with pytest.raises(MirrorError, match=words):
        decode(frame)


def test_a_record_with_the_wrong_fields_is_refused():
    frame = b"\x01\x00L\x01\x00\x00\x00R\x00L\x01\x00\x00\x00N"
    with pytest.raises(MirrorError, match="a SamplingRow has 11 fields"):
        decode(frame, MIRROR_RECORDS)


# ---- properties -------------------------------------------------------------------------

arrays = st.sampled_from(sorted(DTYPES)).flatmap(
    lambda name: hnp.arrays(DTYPES[name], hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4),
                            elements=None if name != "bfloat16" else st.floats(-1e3, 1e3, width=32)))
rows = st.builds(SamplingRow, st.floats(0, 2), st.floats(0, 1), st.integers(0, 1 << 20), st.floats(0, 1),
                 hnp.arrays(np.uint32, 2), st.booleans(), st.floats(-2, 2), st.floats(-2, 2), st.floats(0.01, 2),
                 st.booleans(), st.one_of(st.none(), hnp.arrays(np.int32, st.integers(0, 8))))
scalars = st.one_of(st.none(), st.booleans(), st.integers(-(1 << 63), (1 << 63) - 1),
                    st.floats(allow_nan=True), st.text(max_size=20), arrays, rows)
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4), max_leaves=12)


@FUZZ
@given(st.sampled_from(list(Op)), st.lists(values, max_size=5), st.integers(1, 64))
def test_round_trip(op, args, part_bytes):
    frame = encode(op, args, MIRROR_RECORDS)
    decoded_op, decoded = decode(join(split(frame, part_bytes)), MIRROR_RECORDS)
    assert decoded_op is op and same(decoded, args)


@FUZZ
@given(st.binary(max_size=200))
def test_any_bytes_decode_or_raise_mirror_error(data):
    try:
        op, args = decode(data, MIRROR_RECORDS)
    except MirrorError:
        return
    assert isinstance(op, Op) and isinstance(args, list)


@FUZZ
@given(st.lists(values, max_size=4), st.data())
def test_damaged_frames_decode_or_raise_mirror_error(args, data):
    frame = bytearray(encode(Op.DECODE, args, MIRROR_RECORDS))
    if frame:
        at = data.draw(st.integers(0, len(frame) - 1))
        frame[at] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(frame)))
    try:
        decode(bytes(frame[:cut]), MIRROR_RECORDS)
    except MirrorError:
        pass
