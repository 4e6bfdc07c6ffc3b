"""The mux codecs: round trips, every malformed input's documented event, and fuzzing
with arbitrary bytes split at arbitrary points."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from motet.protocol import mux
from motet.protocol.mux.options import grammar_after, grammar_after_option
from motet.protocol.sampling_keys import fields_of, pairs_of


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


def test_submit_options_round_trip_and_read_as_the_engines_fields():
    options = (("seed", "42"), ("top_k", "40"), ("logit_bias", "13:-100.0,2:2.5"), ("stop_token_ids", "2,7"))
    for grammar in (None, b'root ::= "x"'):
        s = mux.Submit(3, 0, 8, 0.7, 0.9, b"prompt", grammar, options)
        wire = mux.encode_submit(s)
        assert wire.split(b"\n")[0].endswith(b" seed=42 top_k=40 logit_bias=13:-100.0,2:2.5 stop_token_ids=2,7")
        assert mux.RequestDecoder().feed(wire + b"CANCEL 3\n") == [s, mux.Cancel(3)]
    assert fields_of(options) == {"seed": 42, "top_k": 40, "logit_bias": {13: -100.0, 2: 2.5},
                                  "stop_token_ids": (2, 7)}
    fields = {"seed": 42, "top_k": 40, "min_p": 0.0, "logit_bias": ((13, -100.0), (2, 2.5)), "stop_token_ids": (2, 7)}
    assert pairs_of(fields) == options  # the defaults (min_p 0) left out


def test_grammar_after_rides_as_an_option_percent_encoded():
    for after in ("</think>", "end of thought %\n"):
        option = grammar_after_option(after)
        s = mux.Submit(3, 0, 8, 0.7, 0.9, b"prompt", b'root ::= "x"', (option,))
        wire = mux.encode_submit(s)
        assert b" " not in wire.split(b"\n")[0].rpartition(b"grammar_after=")[2]
        (decoded,) = mux.RequestDecoder().feed(wire)
        assert decoded == s and grammar_after(decoded.options) == after
    assert mux.encode_submit(s).split(b"\n")[0].endswith(b"grammar_after=end%20of%20thought%20%25%0A")
    assert grammar_after_option("</think>") == ("grammar_after", "</think>")


def test_a_bad_submit_option_is_a_bad_request_and_its_payload_is_skipped():
    for option, words in ((b"temperature=1", b"unknown SUBMIT option"), (b"top_k=x", b"not a whole number"),
                          (b"logit_bias=5", b"not token:value"), (b"seed=1 seed=2", b"given twice"),
                          (b"min_p=nan", b"not a number"), (b"grammar_after=", b"is empty"),
                          (b"grammar_after=%ff", b"codec")):
        events = mux.RequestDecoder().feed(b"SUBMIT 6 0 5 8 0.5 1 " + option + b"\nhello\nCANCEL 6\n")
        assert events[0].request_id == 6 and words.decode() in events[0].reason, events
        assert events[1:] == [mux.Cancel(6)]


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


# ---- [extension] slot commands and their replies ----------------------------------------

SLOT_COMMANDS = [
    mux.Save(1, 0, "/tmp/sessions/é 1.session"),
    mux.Restore(2, 15, "relative/path"),
    mux.Erase(3, 4),
    mux.Prefill(4, 1, "line one\nligne deux: é\n".encode()),
    mux.Prefill(5, 2, b""),  # an empty prompt is the engine's to refuse (EMPTY_PROMPT)
]
SLOT_WIRE = (mux.encode_save(SLOT_COMMANDS[0]) + mux.encode_restore(SLOT_COMMANDS[1])
             + mux.encode_erase(SLOT_COMMANDS[2]) + mux.encode_prefill(SLOT_COMMANDS[3])
             + mux.encode_prefill(SLOT_COMMANDS[4]) + mux.encode_cancel(4))


def test_slot_commands_round_trip_whatever_the_split():
    expected = [*SLOT_COMMANDS, mux.Cancel(4)]
    assert mux.RequestDecoder().feed(SLOT_WIRE) == expected
    one_by_one = mux.RequestDecoder()
    assert [e for i in range(len(SLOT_WIRE)) for e in one_by_one.feed(SLOT_WIRE[i : i + 1])] == expected


@settings(max_examples=100)
@given(st.lists(st.integers(0, 10_000), max_size=8))
def test_slot_commands_ignore_the_split(cuts):
    assert feed_all(mux.RequestDecoder(), SLOT_WIRE, cuts) == [*SLOT_COMMANDS, mux.Cancel(4)]


def test_bad_slot_commands_are_bad_requests_and_their_payload_is_skipped():
    wire = (b"SAVE 5 x 3\nabc\n"  # a slot that is no number: the path is consumed all the same
            b"SAVE 6 0 0\n\n"  # no path
            b"RESTORE 7 0 2\n\xff\xfe\n"  # not UTF-8
            b"RESTORE 8 0 3\na\x00b\n"  # a NUL
            + f"SAVE 9 0 {mux.MAX_PATH + 1}\n".encode() + b"p" * (mux.MAX_PATH + 1) + b"\n"
            + b"ERASE 10 y\nERASE 0 1\nERASE 11\nSAVE 12 0\nPREFILL 13 0 -1\nSTOP 14\n")
    events = mux.RequestDecoder().feed(wire)
    assert [(type(e), e.request_id) for e in events] == [
        *((mux.Malformed, rid) for rid in (5, 6, 7, 8, 9, 10)), *((mux.Malformed, 0) for _ in range(4)),
        (mux.Stop, 14),
    ]
    assert "UTF-8" in events[2].reason and "NUL" in events[3].reason


def test_a_slot_payload_without_its_newline_is_a_bad_frame():
    decoder = mux.RequestDecoder()
    assert decoder.feed(b"PREFILL 5 0 3\nabcX") == [mux.BadFrame(5)]
    assert decoder.closed
    assert mux.RequestDecoder().feed(b"SAVE 6 0 2\nabc\n") == [mux.BadFrame(6)]


SLOT_REPLIES = [
    mux.Saved(1, 0, 120, 40960, 12.5),
    mux.Restored(2, 15, 120, 40960, 3.0),
    mux.Erased(3, 4, 77),
    mux.Prefilled(4, 1, 9, 2, 0.5),
    mux.SessionRefused(5, "truncated: the file ends inside layer 1 V (2432 bytes needed, 2422 left)"),
    mux.SessionRefused(6, "settings['backend']: expected 'cpu', found 'tpu' — é"),
]


def test_slot_replies_round_trip_in_the_extended_decoder_only():
    wire = (mux.encode_saved(SLOT_REPLIES[0]) + mux.encode_restored(SLOT_REPLIES[1])
            + mux.encode_erased(SLOT_REPLIES[2]) + mux.encode_prefilled(SLOT_REPLIES[3])
            + mux.encode_session_refused(5, SLOT_REPLIES[4].reason)
            + mux.encode_session_refused(6, "settings['backend']:\n  expected 'cpu', found 'tpu' — é"))
    assert mux.ExtendedResponseDecoder().feed(wire) == SLOT_REPLIES
    one_by_one = mux.ExtendedResponseDecoder()
    assert [e for i in range(len(wire)) for e in one_by_one.feed(wire[i : i + 1])] == SLOT_REPLIES
    # A server that knows none of them: the replies are unknown kinds, the refusals errors.
    plain = mux.ResponseDecoder().feed(wire)
    assert [(type(e), e.request_id, e.code) for e in plain] == [(mux.Error, 5, "SESSION_REFUSED"),
                                                                 (mux.Error, 6, "SESSION_REFUSED")]


def test_warmup_is_an_extension_line_other_servers_skip():
    line = mux.encode_warmup(mux.Warmup(12.5, 3.25, 9.0, 21, 40, 3))
    assert line == b"WARMUP 12.50 3.25 9.00 21 40 3\n"
    assert mux.ExtendedResponseDecoder().feed(mux.READY + b"\n" + line) == [mux.Ready(), mux.Warmup(12.5, 3.25, 9.0, 21, 40, 3)]
    assert mux.ResponseDecoder().feed(line) == []  # an unknown kind, as the protocol says


def test_malformed_warmup_lines_are_bad_lines():
    events = mux.ExtendedResponseDecoder().feed(b"WARMUP 1 2 3 4 5\nWARMUP nan 1 1 1 1 1\nWARMUP 1 1 -1 1 1 1\n"
                                                 b"WARMUP 1 1 1 1 -2 1\n")
    assert [type(e) for e in events] == [mux.BadLine] * 4


def test_malformed_slot_replies_are_bad_lines():
    events = mux.ExtendedResponseDecoder().feed(b"SAVED 1 0 x 3 1.0\nERASED 1\nPREFILLED 0 1 2 3 4\n")
    assert [type(e) for e in events] == [mux.BadLine] * 3


REQUEST_EVENTS = (mux.Submit, mux.Cancel, mux.Stop, mux.Malformed, mux.BadFrame,
                  mux.Save, mux.Restore, mux.Erase, mux.Prefill)
RESPONSE_EVENTS = (mux.Ready, mux.Data, mux.TopK, mux.Done, mux.Error, mux.Telemetry, mux.BadLine)
EXTENDED_EVENTS = (*RESPONSE_EVENTS, mux.Turn, mux.LoadFail, mux.Saved, mux.Restored, mux.Erased,
                   mux.Prefilled, mux.SessionRefused, mux.KvSaveFail, mux.Warmup)
words = st.sampled_from([b"SUBMIT", b"CANCEL", b"STOP", b"DATA", b"DONE", b"TOPK", b"ERROR",
                         b"STAT", b"SAVE", b"RESTORE", b"ERASE", b"PREFILL", b"SAVED", b"RESTORED", b"KVSAVE_FAIL",
                         b"WARMUP", b"nan", b"inf",
                         b"ERASED", b"PREFILLED", b"SESSION_REFUSED", b" ", b"\n", b"1", b"0", b"-3",
                         b"5", b"0.5", b"x", b"\x00", b"\xff", b"\r\n", mux.READY])
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


@settings(max_examples=300)
@given(streams, st.lists(st.integers(0, 10_000), max_size=8))
def test_extended_response_decoder_never_crashes_and_ignores_the_split(data, cuts):
    whole = mux.ExtendedResponseDecoder().feed(data)
    assert all(isinstance(e, EXTENDED_EVENTS) for e in whole)
    assert list(map(repr, feed_all(mux.ExtendedResponseDecoder(), data, cuts))) == list(map(repr, whole))
