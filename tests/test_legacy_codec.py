"""The legacy protocol's codec: each frame's event, and arbitrary bytes split anywhere."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from motet.protocol import legacy, mux

RAW = legacy.RawPrompt("rendered\nprompt é".encode(), 16, 0.7, 0.9, 1)


def feed_split(data: bytes, cuts=()) -> list:
    decoder = legacy.LegacyDecoder()
    bounds = [0, *sorted(c % (len(data) + 1) for c in cuts), len(data)]
    return [e for a, b in zip(bounds, bounds[1:]) for e in decoder.feed(data[a:b])]


def test_every_frame_whatever_the_split():
    wire = b"hello\n\n\x02RESET\n\x02MORE\n" + legacy.encode_prompt(RAW) + b"bye\r\n"
    expected = [legacy.UserLine("hello"), legacy.Reset(), legacy.More(), RAW, legacy.UserLine("bye")]
    assert feed_split(wire) == expected
    assert feed_split(wire, range(len(wire))) == expected


def test_malformed_frames_keep_the_stream():
    wire = b"\x02NOPE\n\x02PROMPT 3 x 0 1\nabc\n\x02PROMPT\nnext\n"
    events = feed_split(wire)
    assert [type(e) for e in events] == [mux.Malformed, mux.Malformed, mux.Malformed, legacy.UserLine]
    assert events[-1] == legacy.UserLine("next")  # the bad PROMPT's payload was consumed


def test_a_payload_without_its_newline_is_a_bad_frame_and_ends_the_stream():
    decoder = legacy.LegacyDecoder()
    assert decoder.feed(b"\x02PROMPT 3 4 0 1\nabcX") == [legacy.BadFrame()]
    assert decoder.closed and decoder.feed(b"more\n") == []


def test_end_and_error_lines():
    assert legacy.encode_end(5, 12.345, 100.0, 0.5, 9, True) == (
        b"\x01\x01END\x01\x01\nSTAT 5 12.35 100.0 0.50 9 1\n"
    )
    assert legacy.encode_error("CONTEXT_EXCEEDED", 300, 256) == b"\x01\x01ERROR CONTEXT_EXCEEDED 300 256\x01\x01\n"


EVENTS = (legacy.UserLine, legacy.Reset, legacy.More, legacy.RawPrompt, legacy.BadFrame, mux.Malformed)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300), st.lists(st.integers(min_value=0), max_size=6))
def test_arbitrary_bytes_never_crash_the_decoder(data, cuts):
    events = feed_split(data, cuts)
    assert all(isinstance(e, EVENTS) for e in events)
    assert events == feed_split(data)  # the split never changes what is read


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200), st.integers(0, 64), st.floats(0, 2), st.floats(0.01, 1))
def test_prompts_round_trip(payload, max_tokens, temperature, top_p):
    p = legacy.RawPrompt(payload, max_tokens, float(f"{temperature:g}"), float(f"{top_p:g}"), 0)
    assert feed_split(legacy.encode_prompt(p)) == [p]
