"""Fuzzing of every byte codec that takes outside bytes, each with a corpus kept in the repo.

Per parser, one property says what any input may give (its typed events, or its one
documented error type) and that the input's split never changes the answer; it runs on
every seed file in `tests/corpus/<parser>/` as is (so a regression found once stays
pinned: the `regression_*` files each crashed a parser before its fix), and on
hypothesis's inputs: arbitrary bytes, and the seeds mutated (bytes flipped, inserted,
deleted, spliced, cut; fuzz_inputs.py). Runs are bounded (`max_examples` modest, no
deadline).

    mux_request, mux_response, legacy   motet/protocol/mux/, legacy.py (and what the
                                        MuxEngine does with a child's telemetry lines)
    wire_frames, wire_msg, wire_layer   motet/protocol/wire.py
    session_file                        motet/protocol/session_file.py

What the HTTP server parses (the OpenAI and Anthropic bodies, the live app, the OpenAPI
document and schemathesis) is fuzzed in test_fuzz_http.py. The codecs' own tests
(test_mux_codec.py, test_legacy_codec.py, test_wire.py, test_session_file.py) hold their
exact-output examples and round trips.
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path
from types import SimpleNamespace

from fuzz_inputs import CUTS, FUZZ, corpus, feed_all, inputs, same
from hypothesis import given
from test_session_file import HEADER

from motet.engines.mux_engine import MuxEngine
from motet.protocol import legacy, mux, wire
from motet.protocol.session_file import SessionError, read_session

# ---- the mux codec, both directions ---------------------------------------------------

REQUEST_EVENTS = (mux.Submit, mux.Cancel, mux.Stop, mux.Malformed, mux.BadFrame,
                  mux.Save, mux.Restore, mux.Erase, mux.Prefill)
RESPONSE_EVENTS = (mux.Ready, mux.Data, mux.TopK, mux.Done, mux.Error, mux.Telemetry, mux.BadLine,
                   mux.Turn, mux.LoadFail, mux.Saved, mux.Restored, mux.Erased, mux.Prefilled, mux.SessionRefused,
                   mux.KvSaveFail, mux.Warmup)


def check_mux_requests(data: bytes, cuts=()) -> None:
    whole = mux.RequestDecoder().feed(data)
    assert all(isinstance(e, REQUEST_EVENTS) for e in whole)
    assert all(isinstance(e, mux.BadFrame) is False for e in whole[:-1])  # BAD_FRAME ends the stream
    assert same(feed_all(mux.RequestDecoder(), data, cuts), whole)


def check_mux_responses(data: bytes, cuts=()) -> None:
    whole = mux.ExtendedResponseDecoder().feed(data)
    assert all(isinstance(e, RESPONSE_EVENTS) for e in whole)
    assert same(feed_all(mux.ExtendedResponseDecoder(), data, cuts), whole)
    # What a MuxEngine does with them: lines for no open request are dropped, telemetry
    # (also for requests it has open: stand-ins here) is read or logged, never raised.
    engine = MuxEngine(["motet", "mux"])
    for event in whole:
        engine._on_event(event)
    engine._streams = {rid: SimpleNamespace(perf=None, slot=0, repin=[]) for rid in (1, 7)}
    for event in whole:
        if isinstance(event, mux.Telemetry):
            engine._on_event(event)


@corpus("mux_request")
def test_mux_request_corpus(seed):
    check_mux_requests(seed.read_bytes(), (7, 100, 5000))


@FUZZ
@given(inputs("mux_request"), CUTS)
def test_mux_requests_fuzzed(data, cuts):
    check_mux_requests(data, cuts)


@corpus("mux_response")
def test_mux_response_corpus(seed):
    check_mux_responses(seed.read_bytes(), (3, 50))


@FUZZ
@given(inputs("mux_response"), CUTS)
def test_mux_responses_fuzzed(data, cuts):
    check_mux_responses(data, cuts)


# ---- the legacy protocol ----------------------------------------------------------------

LEGACY_EVENTS = (legacy.UserLine, legacy.Reset, legacy.More, legacy.RawPrompt, legacy.BadFrame, mux.Malformed)


def check_legacy(data: bytes, cuts=()) -> None:
    whole = legacy.LegacyDecoder().feed(data)
    assert all(isinstance(e, LEGACY_EVENTS) for e in whole)
    assert not any(isinstance(e, legacy.BadFrame) for e in whole[:-1])
    assert same(feed_all(legacy.LegacyDecoder(), data, cuts), whole)


@corpus("legacy")
def test_legacy_corpus(seed):
    check_legacy(seed.read_bytes(), (1, 20))


@FUZZ
@given(inputs("legacy"), CUTS)
def test_legacy_fuzzed(data, cuts):
    check_legacy(data, cuts)


# ---- the worker wire: frames, Msg, K_LAYER ---------------------------------------------

FRAME_ERROR = re.compile(r"a frame of \d+ payload bytes is over the limit of \d+|a frame of length 0 has no kind byte")
MSG_ERROR = re.compile(r"a message that is not UTF-8|a header line without '=': \".*\"", re.S)
LAYER_ERROR = re.compile(r"a layer payload of \d+ bytes is shorter than its 16-byte head"
                         r"|layer \d+: the checksum says 0x[0-9a-f]{16} but the bytes sum to 0x[0-9a-f]{16}")


def check_msg(payload: bytes) -> None:
    try:
        msg = wire.decode_msg(payload)
    except wire.WireError as exc:
        assert MSG_ERROR.fullmatch(str(exc)), str(exc)
    else:
        assert wire.decode_msg(wire.encode_msg(msg)) == msg


def check_layer(payload: bytes) -> None:
    try:
        layer = wire.decode_layer(payload)
    except wire.WireError as exc:
        assert LAYER_ERROR.fullmatch(str(exc)), str(exc)
    else:
        assert wire.encode_layer(layer.layer, layer.rows, layer.data) == payload


def check_frames(data: bytes, cuts=()) -> None:
    decoder = wire.FrameDecoder()
    events = feed_all(decoder, data, cuts)
    *frames, last = events or [None]
    assert all(isinstance(f, wire.Frame) for f in frames)
    if isinstance(last, wire.WireError):
        assert FRAME_ERROR.fullmatch(str(last)) and decoder.closed
    elif last is not None:
        frames.append(last)
    ended = decoder.end_of_stream()
    assert ended is None or str(ended).startswith("the stream ended inside a frame")
    for frame in frames:  # what a worker does with each: its kind's decoder
        (check_layer if frame.kind == wire.K_LAYER else check_msg)(frame.payload)


@corpus("wire_frames")
def test_wire_frames_corpus(seed):
    check_frames(seed.read_bytes(), (2, 9))


@FUZZ
@given(inputs("wire_frames"), CUTS)
def test_wire_frames_fuzzed(data, cuts):
    check_frames(data, cuts)


@corpus("wire_msg")
def test_wire_msg_corpus(seed):
    check_msg(seed.read_bytes())


@FUZZ
@given(inputs("wire_msg"))
def test_wire_msg_fuzzed(data):
    check_msg(data)


@corpus("wire_layer")
def test_wire_layer_corpus(seed):
    check_layer(seed.read_bytes())


@FUZZ
@given(inputs("wire_layer", 64))
def test_wire_layer_fuzzed(data):
    check_layer(data)


# ---- the session file ---------------------------------------------------------------------
# (truncation and corruption at every byte, with the exact reasons: test_session_file.py)


def check_session(path: Path, data: bytes) -> None:
    path.write_bytes(data)
    try:
        session = read_session(path, HEADER)
    except SessionError as exc:
        assert str(exc)
    else:
        assert len(session.tokens) <= HEADER.max_context and len(session.layers) == HEADER.layers


@corpus("session_file")
def test_session_file_corpus(seed, tmp_path):
    check_session(tmp_path / "slot.session", seed.read_bytes())


def test_session_file_fuzzed():
    with tempfile.TemporaryDirectory() as folder:
        @FUZZ
        @given(inputs("session_file"))
        def run(data):
            check_session(Path(folder) / "slot.session", data)

        run()
