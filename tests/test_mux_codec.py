"""The mux codecs: round trips, every malformed input's documented event, and fuzzing
with arbitrary bytes split at arbitrary points."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from motet.protocol import mux


def feed_all(decoder, data: bytes, cuts=()) -> list:
    bounds = [0, *sorted(c % (len(data) + 1) for c in cuts), len(data)]
    events = []
    for a, b in zip(bounds, bounds[1:]):
        events += decoder.feed(data[a:b])
    return events


SUBMIT = mux.Submit(7, 2, 64, 0.7, 0.95, "line one\nligne deux: é 🎉\n".encode())


def test_submit_round_trip_whatever_the_split():
    wire = mux.encode_submit(SUBMIT) + mux.encode_cancel(7) + mux.encode_stop(9)
    expected = [SUBMIT, mux.Cancel(7), mux.Stop(9)]
    assert mux.RequestDecoder().feed(wire) == expected
    one_by_one = mux.RequestDecoder()
    assert [e for i in range(len(wire)) for e in one_by_one.feed(wire[i : i + 1])] == expected


def test_the_optional_grammar_bytes_are_consumed():
    s = mux.Submit(3, 0, 8, 0.0, 1.0, b"prompt", b"root ::= x")
    assert mux.RequestDecoder().feed(mux.encode_submit(s) + b"CANCEL 3\n") == [s, mux.Cancel(3)]


def test_a_wrong_trailing_delimiter_is_a_bad_frame_and_ends_the_stream():
    decoder = mux.RequestDecoder()
    assert decoder.feed(b"SUBMIT 5 0 3 8 0 1\nabcX") == [mux.BadFrame(5)]
    assert decoder.closed
    assert decoder.feed(b"CANCEL 5\n") == []


def test_an_unreadable_header_is_a_bad_request_for_id_0_and_the_stream_goes_on():
    events = mux.RequestDecoder().feed(b"SUBMIT x y\nHELLO\nCANCEL 0\nCANCEL 4\n")
    assert [type(e) for e in events] == [mux.Malformed, mux.Malformed, mux.Malformed, mux.Cancel]
    assert all(e.request_id == 0 for e in events[:3])


def test_a_bad_field_with_known_sizes_skips_its_payload():
    events = mux.RequestDecoder().feed(b"SUBMIT 6 0 5 many 0.5 1\nhello\nCANCEL 6\n")
    assert events[0] == mux.Malformed(6, events[0].reason) and "many" in events[0].reason
    assert events[1:] == [mux.Cancel(6)]


def test_an_over_long_line_is_refused_and_dropped_however_it_arrives():
    wire = b"X" * (mux.MAX_LINE + 10) + b"YY\nSTOP 2\n"
    for cuts in ((), (mux.MAX_LINE + 10,), (5, mux.MAX_LINE + 11)):
        events = feed_all(mux.RequestDecoder(), wire, cuts)
        assert [type(e) for e in events] == [mux.Malformed, mux.Stop]


def test_blank_lines_and_crlf_are_tolerated():
    assert mux.RequestDecoder().feed(b"\n\n\r\nCANCEL 8\r\n") == [mux.Cancel(8)]


def test_responses_round_trip():
    done = mux.Done(7, 12, 31.5, 0.0, 1.25, 40, True)
    wire = (
        mux.encode_ready()
        + mux.encode_telemetry("STAT", 0, "0.00", "0.0", "0.81")
        + mux.encode_data(7, "héllo\nworld")
        + mux.encode_topk(7, [(-0.1, b"a"), (-2.5, b"\n b"), (-3.0, b"")])
        + b"FUTURE_KIND 1 2 3\n"  # unknown kinds are skipped
        + mux.encode_telemetry("ENTROPY", "1.5", "2.0")
        + mux.encode_done(done)
        + mux.encode_error(9, "CONTEXT_EXCEEDED", 5000, 4096)
    )
    expected = [
        mux.Ready(),
        mux.Telemetry("STAT", ("0", "0.00", "0.0", "0.81")),
        mux.Data(7, "héllo\nworld".encode()),
        mux.TopK(7, ((-0.1, b"a"), (-2.5, b"\n b"), (-3.0, b""))),
        mux.Telemetry("ENTROPY", ("1.5", "2.0")),
        done,
        mux.Error(9, "CONTEXT_EXCEEDED", ("5000", "4096")),
    ]
    assert mux.ResponseDecoder().feed(wire) == expected
    one_by_one = mux.ResponseDecoder()
    assert [e for i in range(len(wire)) for e in one_by_one.feed(wire[i : i + 1])] == expected


def test_long_text_is_cut_into_data_frames_between_characters():
    text = "é" * mux.MAX_DATA  # two bytes each: no frame may end inside one
    events = mux.ResponseDecoder().feed(mux.encode_data(3, text))
    assert len(events) >= 2
    assert all(len(e.data) <= mux.MAX_DATA for e in events)
    assert all(e.data.decode("utf-8") for e in events)  # each frame is valid UTF-8
    assert b"".join(e.data for e in events).decode() == text


def test_malformed_known_lines_are_reported_not_fatal():
    events = mux.ResponseDecoder().feed(b"DONE 1 STAT x\nTOPK 1 2 -0.1 zz\nERROR\nDATA 1 2\nab\n")
    assert [type(e) for e in events] == [mux.BadLine, mux.BadLine, mux.BadLine, mux.Data]


REQUEST_EVENTS = (mux.Submit, mux.Cancel, mux.Stop, mux.Malformed, mux.BadFrame)
RESPONSE_EVENTS = (mux.Ready, mux.Data, mux.TopK, mux.Done, mux.Error, mux.Telemetry, mux.BadLine)
words = st.sampled_from([b"SUBMIT", b"CANCEL", b"STOP", b"DATA", b"DONE", b"TOPK", b"ERROR",
                         b"STAT", b" ", b"\n", b"1", b"0", b"-3", b"5", b"0.5", b"x", b"\x00",
                         b"\xff", b"\r\n", mux.READY])
streams = st.one_of(st.binary(max_size=300), st.lists(words, max_size=60).map(b"".join))


@settings(max_examples=300)
@given(streams, st.lists(st.integers(0, 10_000), max_size=8))
def test_request_decoder_never_crashes_and_ignores_the_split(data, cuts):
    whole = mux.RequestDecoder().feed(data)
    assert all(isinstance(e, REQUEST_EVENTS) for e in whole)
    assert feed_all(mux.RequestDecoder(), data, cuts) == whole


@settings(max_examples=300)
@given(streams, st.lists(st.integers(0, 10_000), max_size=8))
def test_response_decoder_never_crashes_and_ignores_the_split(data, cuts):
    whole = mux.ResponseDecoder().feed(data)
    assert all(isinstance(e, RESPONSE_EVENTS) for e in whole)
    assert feed_all(mux.ResponseDecoder(), data, cuts) == whole
