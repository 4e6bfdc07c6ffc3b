"""The worker wire codec: the header's constants and layouts, every documented error with
its exact sentence, and fuzzing with arbitrary bytes split at arbitrary points."""

from __future__ import annotations

import re
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from motet.protocol import wire
from motet.protocol.wire import Frame, Msg, WireError


def feed_all(decoder, data: bytes, cuts=()) -> list:
    bounds = [0, *sorted(c % (len(data) + 1) for c in cuts), len(data)]
    events = []
    for a, b in zip(bounds, bounds[1:]):
        events += decoder.feed(data[a:b])
    return events


# The decoder's own errors; anything else it returns would be undocumented.
FRAME_ERRORS = re.compile(r"a frame of \d+ payload bytes is over the limit of \d+|a frame of length 0 has no kind byte")


def test_constants_match_the_header():
    kinds = (wire.K_GEN, wire.K_DECODE, wire.K_PREFILL, wire.K_LAYER, wire.K_FIRST, wire.K_RESULT, wire.K_ERROR)
    assert kinds == (1, 2, 3, 10, 11, 20, 21)
    assert wire.MAX_FRAME == 64 * 1024 * 1024
    assert wire.REQUEST_WAIT_S == 600
    assert wire.kind_name(wire.K_LAYER) == "LAYER" and wire.kind_name(99) == "kind 99"


# ---- frames --------------------------------------------------------------------------


def test_a_frame_is_length_of_what_follows_then_kind_then_payload():
    assert wire.encode_frame(wire.K_GEN, b"ab") == b"\x03\x00\x00\x00\x01ab"
    assert wire.encode_frame(wire.K_FIRST, b"") == b"\x01\x00\x00\x00\x0b"
    assert wire.frame_head(wire.K_RESULT, 300) == struct.pack("<IB", 301, 20)


def test_frames_round_trip_whatever_the_split():
    frames = [Frame(wire.K_GEN, b"x=1\n\nhi"), Frame(wire.K_FIRST, b""), Frame(200, bytes(range(256)))]
    data = b"".join(wire.encode_frame(f.kind, f.payload) for f in frames)
    for cut in range(len(data) + 1):
        assert feed_all(wire.FrameDecoder(), data, (cut,)) == frames
    one_by_one = wire.FrameDecoder()
    assert [e for i in range(len(data)) for e in one_by_one.feed(data[i : i + 1])] == frames


def test_the_limit_is_on_the_payload_and_a_frame_over_it_closes_the_decoder():
    decoder = wire.FrameDecoder(max_payload=8)
    assert decoder.feed(wire.frame_head(1, 8) + b"12345678") == [Frame(1, b"12345678")]
    [error] = decoder.feed(struct.pack("<IB", 10, 1) + b"123456789" + wire.encode_frame(1, b""))
    assert isinstance(error, WireError) and str(error) == "a frame of 9 payload bytes is over the limit of 8"
    assert decoder.closed and decoder.feed(wire.encode_frame(1, b"")) == []
    assert decoder.end_of_stream() is None


def test_a_frame_over_64_mib_is_refused_from_its_length_alone():
    [error] = wire.FrameDecoder().feed(struct.pack("<I", wire.MAX_FRAME + 2))
    assert str(error) == f"a frame of {wire.MAX_FRAME + 1} payload bytes is over the limit of {wire.MAX_FRAME}"
    assert wire.FrameDecoder().feed(struct.pack("<IB", wire.MAX_FRAME + 1, 3)) == []  # exactly the limit: waits
    with pytest.raises(WireError, match="over the limit"):
        wire.frame_head(wire.K_LAYER, wire.MAX_FRAME + 1)


def test_a_zero_length_has_no_kind_and_closes_the_decoder():
    decoder = wire.FrameDecoder()
    [error] = decoder.feed(b"\x00\x00\x00\x00" + wire.encode_frame(1, b"a"))
    assert str(error) == "a frame of length 0 has no kind byte" and decoder.closed


def test_the_end_of_the_stream_inside_a_frame_is_reported():
    decoder = wire.FrameDecoder()
    assert decoder.feed(wire.encode_frame(1, b"abc")[:-1]) == []
    assert str(decoder.end_of_stream()) == "the stream ended inside a frame (7 bytes of it came)"
    clean = wire.FrameDecoder()
    clean.feed(wire.encode_frame(1, b"abc"))
    assert clean.end_of_stream() is None


def test_a_kind_must_be_one_byte():
    with pytest.raises(ValueError, match="one byte"):
        wire.encode_frame(256, b"")


@given(st.binary(max_size=300), st.lists(st.integers(0, 300), max_size=6), st.sampled_from([0, 5, wire.MAX_FRAME]))
def test_arbitrary_bytes_give_frames_or_a_documented_error_and_never_crash(data, cuts, limit):
    decoder = wire.FrameDecoder(max_payload=limit)
    events = feed_all(decoder, data, cuts)
    assert all(isinstance(e, (Frame, WireError)) for e in events)
    errors = [i for i, e in enumerate(events) if isinstance(e, WireError)]
    assert errors in ([], [len(events) - 1])  # an error is the last thing the stream says
    for e in events[: len(events) - len(errors)]:
        assert 0 <= e.kind <= 255 and len(e.payload) <= limit
    if errors:
        assert FRAME_ERRORS.fullmatch(str(events[-1])) and decoder.closed
    # Splitting never changes what comes out.
    assert [(type(e), str(e) if isinstance(e, WireError) else e) for e in events] == [
        (type(e), str(e) if isinstance(e, WireError) else e) for e in wire.FrameDecoder(limit).feed(data)
    ]


FRAMES = st.lists(st.builds(Frame, st.integers(0, 255), st.binary(max_size=100)), max_size=8)


@given(FRAMES, st.lists(st.integers(0, 1000), max_size=10))
def test_any_frames_round_trip_under_any_split(frames, cuts):
    data = b"".join(wire.encode_frame(f.kind, f.payload) for f in frames)
    decoder = wire.FrameDecoder()
    assert feed_all(decoder, data, cuts) == frames
    assert decoder.end_of_stream() is None


# ---- messages ------------------------------------------------------------------------


def test_a_msg_is_sorted_lines_a_blank_line_and_a_body():
    msg = Msg({"b": "two", "a": 1}, "the body\nwith lines")
    assert wire.encode_msg(msg) == b"a=1\nb=two\n\nthe body\nwith lines"
    assert msg == Msg((("a", "1"), ("b", "two")), "the body\nwith lines")
    assert wire.decode_msg(wire.encode_msg(msg)) == msg
    assert wire.encode_msg(Msg()) == b"\n" and wire.decode_msg(b"\n") == Msg()


def test_decoding_is_lenient_where_the_header_is_silent():
    assert wire.decode_msg(b"") == Msg()
    assert wire.decode_msg(b"b=1\na=x=y") == Msg({"a": "x=y", "b": "1"})  # no blank line: no body
    assert wire.decode_msg(b"a=1\na=2\n\n") == Msg({"a": "2"})  # the last value wins
    assert wire.decode_msg(b"z=1\na=2\n\n\n\nbody\n") == Msg({"a": "2", "z": "1"}, "\n\nbody\n")
    assert wire.decode_msg(b"=\n\n") == Msg({"": ""})


def test_msg_errors_use_the_headers_sentences():
    with pytest.raises(WireError) as exc:
        wire.decode_msg(b"a=1\n\n\xff")
    assert str(exc.value) == "a message that is not UTF-8"
    with pytest.raises(WireError) as exc:
        wire.decode_msg(b"a=1\nno equals sign\n\nbody")
    assert str(exc.value) == "a header line without '=': \"no equals sign\""
    with pytest.raises(WireError) as exc:
        wire.decode_msg(b"a=1\r\n\r\n")  # lines end with \n alone
    assert str(exc.value) == "a header line without '=': \"\r\""


def test_numbers():
    msg = Msg({"n": "42", "max": str(2**64 - 1), "zero": "0"})
    assert (msg.number("n"), msg.number("max"), msg.number("zero")) == (42, 2**64 - 1, 0)
    with pytest.raises(WireError) as exc:
        msg.number("rows")
    assert str(exc.value) == "missing rows"
    for bad in ("", "-1", "+1", " 1", "1 ", "1_000", "1.5", "0x10", "١٢", str(2**64)):
        with pytest.raises(WireError) as exc:
            Msg({"k": bad}).number("k")
        assert str(exc.value) == "k: not a number"


def test_a_lone_surrogate_cannot_be_written():
    with pytest.raises(ValueError, match="lone surrogate"):
        wire.encode_msg(Msg({"a": "\ud800"}))


@pytest.mark.parametrize(
    "fields", [{"a=b": "1"}, {"a\nb": "1"}, {"a": "1\n2"}, {"a": True}, {"a": 1.5}, (("a", "1"), ("a", "2"))]
)
def test_a_msg_that_could_not_be_read_back_is_refused(fields):
    with pytest.raises(ValueError):
        Msg(fields)


KEYS = st.text(st.characters(blacklist_categories=["Cs"], blacklist_characters="=\n"), max_size=12)
VALUES = st.text(st.characters(blacklist_categories=["Cs"], blacklist_characters="\n"), max_size=20)
MSGS = st.builds(Msg, st.dictionaries(KEYS, VALUES | st.integers(0, 2**64), max_size=6), st.text(max_size=60))


@given(st.lists(MSGS, max_size=4), st.lists(st.integers(0, 2000), max_size=10))
def test_any_msgs_round_trip_in_frames_under_any_split(msgs, cuts):
    data = b"".join(wire.encode_frame(wire.K_GEN, wire.encode_msg(m)) for m in msgs)
    frames = feed_all(wire.FrameDecoder(), data, cuts)
    assert [wire.decode_msg(f.payload) for f in frames] == msgs


@given(st.binary(max_size=200))
def test_arbitrary_bytes_decode_to_a_msg_or_a_documented_error(data):
    try:
        msg = wire.decode_msg(data)
    except WireError as exc:
        assert str(exc) == "a message that is not UTF-8" or str(exc).startswith("a header line without '=': \"")
    else:
        assert wire.decode_msg(wire.encode_msg(msg)) == msg


# ---- layers --------------------------------------------------------------------------


def reference_checksum(data: bytes) -> int:
    padded = data + b"\0" * (-len(data) % 8)
    return sum(int.from_bytes(padded[i : i + 8], "little") for i in range(0, len(padded), 8)) % 2**64


def test_the_layer_checksum_wraps_and_pads():
    assert wire.layer_checksum(b"") == 0
    assert wire.layer_checksum(b"\x01") == 1
    assert wire.layer_checksum(b"\x00" * 8 + b"\x00\x01") == 256
    assert wire.layer_checksum(b"\xff" * 8 + b"\x02") == 1  # 2**64 - 1 + 2, wrapped
    assert wire.layer_checksum(bytearray(b"\xff" * 16)) == 2**64 - 2


@given(st.binary(max_size=200))
def test_the_layer_checksum_is_the_word_sum(data):
    assert wire.layer_checksum(data) == reference_checksum(data)
    assert wire.layer_checksum(memoryview(b"x" + data)[1:]) == reference_checksum(data)  # unaligned


def test_a_layer_payload_is_layer_rows_checksum_bytes():
    data = bytes(range(20))
    payload = wire.encode_layer(3, 7, data)
    assert payload == struct.pack("<IIQ", 3, 7, reference_checksum(data)) + data
    assert wire.decode_layer(payload) == wire.Layer(3, 7, reference_checksum(data), data)


def test_a_layer_checksum_mismatch_names_the_layer_and_both_sums():
    payload = bytearray(wire.encode_layer(5, 1, b"\x01" + bytes(15)))
    payload[-1] ^= 0x80
    with pytest.raises(WireError) as exc:
        wire.decode_layer(bytes(payload))
    assert str(exc.value) == (
        "layer 5: the checksum says 0x0000000000000001 but the bytes sum to 0x8000000000000001"
    )


def test_a_layer_payload_shorter_than_its_head_is_refused():
    with pytest.raises(WireError) as exc:
        wire.decode_layer(b"\x00" * 15)
    assert str(exc.value) == "a layer payload of 15 bytes is shorter than its 16-byte head"
    with pytest.raises(ValueError, match="u32"):
        wire.encode_layer(2**32, 0, b"")


@given(st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1), st.binary(max_size=300), st.lists(st.integers(0, 400)))
def test_any_layer_round_trips_in_a_frame_under_any_split(layer, rows, data, cuts):
    [frame] = feed_all(wire.FrameDecoder(), wire.encode_frame(wire.K_LAYER, wire.encode_layer(layer, rows, data)), cuts)
    assert frame.kind == wire.K_LAYER
    assert wire.decode_layer(frame.payload) == wire.Layer(layer, rows, reference_checksum(data), data)


@settings(max_examples=300)
@given(st.binary(max_size=64))
def test_arbitrary_layer_payloads_decode_or_give_a_documented_error(payload):
    try:
        layer = wire.decode_layer(payload)
    except WireError as exc:
        assert re.fullmatch(
            r"a layer payload of \d+ bytes is shorter than its 16-byte head"
            r"|layer \d+: the checksum says 0x[0-9a-f]{16} but the bytes sum to 0x[0-9a-f]{16}",
            str(exc),
        )
    else:
        assert wire.encode_layer(layer.layer, layer.rows, layer.data) == payload
